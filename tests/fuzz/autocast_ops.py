"""The autocast fuzz's ops, losses and runner on each framework.

Every op is a row of the dtype contract (unified_amp/dtype_contract/), run through the
row's own sample call: the program's (4, 8) activation fills the call's first data
tensor (reshaped, cut or repeated to its shape, and mapped into its domain: positive for
a logarithm, inside (-1, 1) for an arcsine), the call's other data tensors are constants
in the activation's dtype, its parameters are float32 (trained where they are weights),
and the output is cut or repeated back to (4, 8). So a row added to the table enters the
fuzz at once.

``Runner(framework)`` turns a program (autocast_programs) into a function with
unified_amp's blocks or the native autocast's, runs it on inputs made from the program's
seed, and returns what the two sides are compared on: the loss, the last activation,
every parameter's and the input's gradient (as raw bytes, so NaN and inf compare too),
and each op's (row, input kind, autocast on, output dtype) for the contract checks.
"""

from __future__ import annotations

import math
import re

import numpy as np

import unified_amp as amp
from unified_amp.dtype_contract import SAMPLES

from ..contract.dtype_table import NOT_TRAINED, call_of, expected, inputs, names, row
from . import autocast_programs as programs

# The fuzz's final losses, and the table row each one's recorded output answers to.
LOSS_ROWS = {"cross_entropy": "cross-entropy", "mse": "MSE",
             "bce_with_logits": "binary cross-entropy with logits", "nll": "log-softmax"}


def op_names(framework: str) -> tuple[str, ...]:
    """The contract's rows the fuzz draws on ``framework``: those it has."""
    own = "torch-cpu" if framework == "torch" else "megengine"
    return tuple(name for name in programs.ALL_OPS if call_of(row(name), framework) is not None
                 and not programs.native_raises(row(name), own))


def expected_for(op: str, kind: str, low: str, framework: str) -> str:
    """The contract's dtype for an op or loss of a program, given its input's kind."""
    r = row(LOSS_ROWS.get(op, op))
    return expected(r, kind, low, call_of(r, framework))


def arrays(p: programs.Program) -> dict[str, np.ndarray]:
    """The program's inputs: the table's sample arrays from the program's seed (weights
    scaled down, so that chains of matmuls stay in float16's range) and its input x."""
    a = inputs(hash((p.seed, p.index)) % 2**31)
    for name, (_, role, domain) in SAMPLES.items():
        if role == "param" and domain == "normal":
            a[name] = a[name] * np.float32(0.35)
    a["x_in"] = np.random.RandomState([p.seed % 2**31, p.index % 2**31, 33]).randn(
        4, 8).astype(np.float32)
    # what the fuzz's losses take
    a["labels8"], a["target8"] = a["labels"], a["target"]
    return a


TRAINED = {n for n, (_, role, _) in SAMPLES.items() if role == "param"} - NOT_TRAINED


class _Kinds:
    def __init__(self, is_low):
        self.is_low = is_low

    def __call__(self, t) -> str:
        return "low" if self.is_low(t) else "float32"


class _Ops:
    """The table's rows as fuzz ops on one framework: ``math`` holds the framework's
    few primitives (reshape, repeat, the domain maps, casts)."""

    def __init__(self, framework, scope, prim):
        self.framework, self.scope, self.prim = framework, scope, prim
        self.kind = _Kinds(prim["is_low"])

    def rec(self, out, op, inp, on, y, values=()):
        """Records (op, its input's kind, autocast on, output, the dtypes of the floating
        values the call took, in order: what a block's rule of the op casts by)."""
        out.append((op, self.kind(inp), on, y,
                    [self.prim["dtype"](v) for v in values if self.prim["is_float"](v)]))
        return y

    def fit_in(self, h, name):
        """The activation as the sample tensor ``name``: its shape and domain."""
        shape, _, domain = SAMPLES[name]
        n = math.prod(shape)
        flat = self.prim["flat"](h)
        if n > 32:
            flat = self.prim["tile"](flat, -(-n // 32))
        v = self.prim["reshape"](flat[:n], shape)
        maps = {"positive": lambda t: t * t + 0.5, "above1": lambda t: t * t + 1.2,
                "unit": lambda t: self.prim["tanh"](t) * 0.8,
                "probability": lambda t: self.prim["sigmoid"](t) * 0.9 + 0.05,
                "half": lambda t: self.prim["sigmoid"](t) * 0.98}
        return maps.get(domain, lambda t: t)(v)

    def fit_out(self, y):
        """An op's output as the next (4, 8) activation."""
        flat = self.prim["flat"](y)
        n = self.prim["numel"](flat)
        if n < 32:
            flat = self.prim["tile"](flat, -(-32 // n))
        return self.prim["reshape"](flat[:32], (4, 8))

    def op(self, name):
        r = row(name)
        call = call_of(r, self.framework)
        args = names(call)
        # a function, not eval at each call: torch.compile traces into it
        fn = eval(f"lambda {', '.join(args)}: {call}", dict(self.scope))  # noqa: S307
        data = [n for n in args if SAMPLES[n][1] == "data"]
        slot, others = data[0], set(data[1:])
        # the values the op itself takes: not those the call compares first (where's
        # condition, t01 > 0.5, reaches it as a bool tensor)
        taken = [j for j, n in enumerate(args) if not re.search(rf"\b{n}\s*[<>=!]=?\s", call)]

        def run(h, P, out, on):
            values = [self.fit_in(h, n) if n == slot else
                      self.prim["like"](P[n], h) if n in others else P[n] for n in args]
            return self.fit_out(self.rec(out, name, h, on, fn(*values),
                                         [values[j] for j in taken]))

        return run

    def ops(self):
        return {name: self.op(name) for name in op_names(self.framework)}


# -- torch ------------------------------------------------------------------------------

def torch_ops():
    import torch
    import torch.nn.functional as F

    prim = {
        "is_low": lambda t: t.dtype in (torch.float16, torch.bfloat16),
        "flat": lambda t: t.reshape(-1), "numel": lambda t: t.numel(),
        "tile": lambda t, k: t.repeat(k), "reshape": lambda t, s: t.reshape(s),
        "tanh": torch.tanh, "sigmoid": torch.sigmoid,
        "like": lambda t, h: t.to(h.dtype) if t.is_floating_point() else t,
        "is_float": lambda t: t.is_floating_point(), "dtype": lambda t: t.dtype,
    }
    table = _Ops("torch", {"torch": torch, "F": F}, prim)
    rec = table.rec
    losses = {
        "cross_entropy": lambda h, P, out, on: rec(out, "cross_entropy", h, on, F.cross_entropy(
            h, P["labels8"])),
        "mse": lambda h, P, out, on: rec(out, "mse", h, on, F.mse_loss(h, P["target8"])),
        "bce_with_logits": lambda h, P, out, on: rec(
            out, "bce_with_logits", h, on, F.binary_cross_entropy_with_logits(h, P["t01"])),
        "nll": lambda h, P, out, on: F.nll_loss(rec(out, "nll", h, on, F.log_softmax(h, -1)),
                                                P["labels8"]),
    }
    return table.ops(), losses, table


def torch_bits(t):
    """A tensor's bytes, its dtype and shape: equal exactly when the tensors are the
    same bits (NaN included)."""
    import torch

    t = t.detach()
    return (str(t.dtype), tuple(t.shape), t.reshape(-1).contiguous().view(torch.uint8)
            .numpy().tobytes())


class TorchSide:
    """Builds and runs one side of a program on torch."""

    def __init__(self):
        import torch

        self.torch = torch
        self.ops, self.losses, self.table = torch_ops()

    def blocks(self, side, p, contract):
        torch = self.torch
        low = getattr(torch, p.low)
        if side == "native":
            outer = lambda: torch.autocast("cpu", dtype=low)  # noqa: E731
            inner = lambda enabled: torch.autocast("cpu", dtype=low, enabled=enabled)  # noqa: E731
        else:  # the CPU's, as the native's: a block with no device covers CUDA alone
            # where torch sees a GPU (docs/API.md, "Devices")
            outer = lambda rules=None: amp.autocast(  # noqa: E731
                dtype=p.low, device="cpu", contract=contract, rules=rules)
            inner = lambda enabled, rules=None: amp.autocast(  # noqa: E731
                enabled=enabled, dtype=p.low, device="cpu", contract=contract, rules=rules)
        return outer, inner

    def function(self, p, side, contract):
        torch = self.torch
        outer, inner = self.blocks(side, p, contract)
        scope = {"torch": torch, "F32": lambda h: h.float(), "OP": self.ops, "LOSS": self.losses, "OUTER": outer,
                 "INNER": inner, "BREAK": torch._dynamo.graph_break,
                 "CTX": (outer(p.rules or None) if p.rules else outer()) if p.made_outside else None}
        code = compile(programs.source(p, side), f"<autocast fuzz {p.name} {side}>", "exec")
        exec(code, scope)
        return scope["program"]

    def inputs(self, p):
        torch = self.torch
        P = {k: torch.from_numpy(v.copy()) if v.dtype != np.float32 else
             torch.from_numpy(v.copy()).requires_grad_(k in TRAINED or k == "x_in")
             for k, v in arrays(p).items()}
        return P["x_in"], P

    def run(self, fn, p, compile_with=None):
        x, P = self.inputs(p)
        if compile_with is not None:
            fn = self.torch.compile(fn, backend=compile_with)
        out: list = []
        loss, h = fn(x, P, out)
        loss.backward()
        grads = {k: torch_bits(v.grad) for k, v in P.items() if v.grad is not None}
        return {"loss": torch_bits(loss), "h": torch_bits(h), "grads": grads,
                "ops": [(op, k, on, str(y.dtype).removeprefix("torch."),
                         [str(d).removeprefix("torch.") for d in took])
                        for op, k, on, y, took in out]}


# -- MegEngine ----------------------------------------------------------------------------

def megengine_ops():
    import megengine
    import megengine.functional as F

    prim = {
        "is_low": lambda t: str(t.dtype) in ("float16", "bfloat16"),
        "flat": lambda t: t.reshape(-1), "numel": lambda t: t.size,
        "tile": lambda t, k: F.tile(t, (k,)), "reshape": lambda t, s: t.reshape(s),
        "tanh": F.tanh, "sigmoid": F.sigmoid,
        "like": lambda t, h: t.astype(h.dtype) if "float" in str(t.dtype) else t,
        "is_float": lambda t: "float" in str(t.dtype), "dtype": lambda t: str(t.dtype),
    }
    table = _Ops("megengine", {"F": F, "mge": megengine}, prim)
    rec = table.rec

    def nll(h, P, out, on):
        lp = rec(out, "nll", h, on, F.nn.logsoftmax(h, axis=-1))
        return -F.mean(F.nn.indexing_one_hot(lp, P["labels8"], 1))

    losses = {
        "cross_entropy": lambda h, P, out, on: rec(out, "cross_entropy", h, on,
                                                   F.nn.cross_entropy(h, P["labels8"])),
        "mse": lambda h, P, out, on: rec(out, "mse", h, on, F.nn.square_loss(h, P["target8"])),
        "bce_with_logits": lambda h, P, out, on: rec(out, "bce_with_logits", h, on,
                                                     F.nn.binary_cross_entropy(
                                                         h, P["t01"], with_logits=True)),
        "nll": nll,
    }
    ops = table.ops()
    ops_table = table
    # MegEngine 1.13's float32 sin and cos (MKL's vsSin/vsCos; megengine.amp's autocast
    # computes them in float32, and float16 ones go through float32 too) fail on an
    # infinite input ("VML_STATUS_ERRDOM"), and the second such failure in a process
    # aborts it ("terminate called", plain MegEngine: F.cos(tensor([inf])) twice): a
    # long run, seed 40 index 1836, ended there after an overflowed prod. Both sides of
    # the fuzz take the op's input clipped into float16's range first (MegEngine's clip
    # also takes NaN to the upper bound).
    for name in ("sin", "cos"):
        if name in ops:
            ops[name] = _finite_input(ops[name], F)
    return ops, losses, ops_table


def _finite_input(run, F):
    return lambda h, P, out, on: run(F.clip(h, -60000.0, 60000.0), P, out, on)


def megengine_bits(t):
    a = t.numpy()
    return (str(a.dtype), tuple(a.shape), a.tobytes())


class _MegEngineNative:
    """megengine.amp.autocast, nested as torch.autocast nests: megengine.amp's
    ``autocast(enabled=False)`` does nothing inside an enabled block (docs/DROP_IN.md),
    so an inner disabled block is written as leaving the outer native block and entering
    a new one after it -- what a MegEngine user writes to get float32 there."""

    stack: list = []

    def __init__(self, enabled, low):
        self.enabled, self.low, self.native = enabled, low, None

    def _enter_native(self):
        import megengine.amp

        self.native = megengine.amp.autocast(True, low_prec_dtype=self.low)
        self.native.__enter__()

    def __enter__(self):
        if self.stack and self.stack[-1].native is not None:
            self.stack[-1].native.__exit__(None, None, None)
        if self.enabled:
            self._enter_native()
        self.stack.append(self)

    def __exit__(self, *exc):
        self.stack.pop()
        if self.native is not None:
            self.native.__exit__(None, None, None)
            self.native = None
        if self.stack and self.stack[-1].enabled:
            self.stack[-1]._enter_native()


class MegEngineSide:
    def __init__(self):
        import megengine

        self.megengine = megengine
        self.ops, self.losses, self.table = megengine_ops()

    def function(self, p, side, contract):
        if side == "native":
            outer = lambda: _MegEngineNative(True, p.low)  # noqa: E731
            inner = lambda enabled: _MegEngineNative(enabled, p.low)  # noqa: E731
        else:
            outer = lambda rules=None: amp.autocast(  # noqa: E731
                dtype=p.low, contract=contract, rules=rules)
            inner = lambda enabled, rules=None: amp.autocast(  # noqa: E731
                enabled=enabled, dtype=p.low, contract=contract, rules=rules)
        scope = {"F32": lambda h: h.astype("float32"), "OP": self.ops, "LOSS": self.losses, "OUTER": outer, "INNER": inner,
                 "BREAK": lambda: None,
                 "CTX": (outer(p.rules or None) if p.rules else outer()) if p.made_outside else None}
        code = compile(programs.source(p, side), f"<autocast fuzz {p.name} {side}>", "exec")
        exec(code, scope)
        return scope["program"]

    def run(self, fn, p, compile_with=None):
        import megengine
        from megengine.autodiff import GradManager

        P = {k: megengine.tensor(v, dtype="int32" if v.dtype != np.float32 else "float32")
             for k, v in arrays(p).items()}
        trained = {k: v for k, v in P.items() if k in TRAINED or k == "x_in"}
        gm = GradManager().attach(list(trained.values()))
        out: list = []
        with gm:
            loss, h = fn(P["x_in"], P, out)
            gm.backward(loss)
        grads = {k: megengine_bits(v.grad) for k, v in trained.items() if v.grad is not None}
        return {"loss": megengine_bits(loss), "h": megengine_bits(h), "grads": grads,
                "ops": [(op, k, on, str(y.dtype), took) for op, k, on, y, took in out]}


def side_for(backend_name: str):
    return TorchSide() if backend_name == "torch" else MegEngineSide()


# -- a block's own rules -------------------------------------------------------------------

_RULE_KEYS: dict = {}


def rule_keys(side, low: str) -> tuple[str, ...]:
    """The rows a fuzz program's rules may name on ``side``: those the fuzz's own
    plumbing (fitting the activation into a sample's shape and domain, the losses, the
    casts) does not call, found by trying each under a "refuse" rule once: a rule of
    one of those would change the plumbing's dtypes too, and no longer be the op's
    alone to check."""
    key = (type(side).__name__, low)
    if key in _RULE_KEYS:
        return _RULE_KEYS[key]
    p = programs.make(0, 0)
    if isinstance(side, TorchSide):
        import torch

        x, P = side.inputs(p)
        acts = [x.detach(), x.detach().to(getattr(torch, low))]
        block = lambda rules: amp.autocast(dtype=low, device="cpu", rules=rules)  # noqa: E731
        f32 = lambda h: h.float()  # noqa: E731
    else:
        import megengine

        P = {k: megengine.tensor(v, dtype="int32" if v.dtype != np.float32 else "float32")
             for k, v in arrays(p).items()}
        acts = [P["x_in"], P["x_in"].astype(low)]
        block = lambda rules: amp.autocast(dtype=low, rules=rules)  # noqa: E731
        f32 = lambda h: h.astype("float32")  # noqa: E731
    table = side.table
    slots = sorted({n for n, (_, role, _) in SAMPLES.items() if role == "data"})
    clip = table.framework == "megengine" and bool({"sin", "cos"} & set(side.ops))

    def plumbing():
        for h in acts:
            for n in slots:
                table.fit_out(table.fit_in(h, n))
            for n, v in P.items():
                table.prim["like"](v, h)
            f32(h)
            for loss in side.losses.values():
                loss(h, P, [], True)
            if clip:  # MegEngine's sin and cos take a clipped input (megengine_ops)
                import megengine.functional as F

                F.clip(h, -60000.0, 60000.0)

    # Rows that share a function with another row on this framework (MegEngine's
    # F.matmul is matmul's, matrix-vector product's and batched matmul's; F.interpolate
    # and F.pad serve several rows on both): a rule keyed by one of those rows' names
    # is a rule of the function, so it also rules the other rows' calls (on MegEngine,
    # {'matrix-vector product': 'refuse'} refuses a batched matmul: the rules fuzz,
    # seed 0 index 40), where on torch matmul, mv and bmm stay apart. Reported, not
    # drawn: the fuzz checks a rule on its own row's calls.
    from unified_amp.dtype_contract import ROWS

    spell: dict = {}
    for r in ROWS:
        for s in getattr(r, table.framework):
            spell.setdefault(s, set()).add(r.name)
    shared = {n for names_ in spell.values() if len(names_) > 1 for n in names_}
    allowed = []
    for name in op_names(table.framework):
        if name in shared:
            continue
        try:
            with block({name: "refuse"}):
                plumbing()
        except RuntimeError as exc:
            if "refused" not in str(exc):
                raise
            continue
        allowed.append(name)
    _RULE_KEYS[key] = tuple(allowed)
    return _RULE_KEYS[key]
