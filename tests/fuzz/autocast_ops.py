"""The autocast fuzz's ops, losses and runner on each framework.

``Runner(framework)`` turns a program (autocast_programs) into a function with
unified_amp's blocks or the native autocast's, runs it on inputs made from the program's
seed, and returns what the two sides are compared on: the loss, the last activation,
every parameter's and the input's gradient (as raw bytes, so NaN and inf compare too),
and each op's (row, input kind, autocast on, output dtype) for the contract checks.
"""

from __future__ import annotations

import numpy as np

import unified_amp as amp

from . import autocast_programs as programs

# fuzz op -> the row of docs/DTYPE_CONTRACT.md (tests/contract/dtype_table.py) its
# recorded output answers to; relu has none.
ROWS = {"linear": "linear", "matmul": "matmul", "bmm": "batched matmul", "conv2d": "conv2d",
        "softmax": "softmax", "log_softmax": "log-softmax", "layer_norm": "layer norm",
        "sum": "sum", "mean": "mean", "exp": "exp", "log": "log", "add_f32": "add low+float32",
        "max_pool": "max pool", "avg_pool": "average pool",
        "global_avg_pool": "global average pool", "batch_norm": "batch norm",
        "cross_entropy": "cross-entropy", "mse": "MSE",
        "bce_with_logits": "binary cross-entropy with logits", "nll": "log-softmax"}


def arrays(p: programs.Program) -> dict[str, np.ndarray]:
    rng = np.random.RandomState([p.seed % 2**31, p.index % 2**31, 33])
    f = lambda *s, scale=0.35: (rng.randn(*s) * scale).astype(np.float32)  # noqa: E731
    return {
        "x": f(4, 8, scale=1.0), "W1": f(8, 8), "b1": f(8), "W2": f(8, 8), "W3": f(2, 8, 8),
        "C": f(2, 2, 3, 3), "cb": f(2), "lnw": 1 + f(8, scale=0.1), "lnb": f(8, scale=0.1),
        "bnw": 1 + f(2, scale=0.1), "bnb": f(2, scale=0.1), "B": f(4, 8),
        "rm": f(2, scale=0.1), "rv": 1 + np.abs(f(2, scale=0.1)),
        "labels": rng.randint(0, 8, size=4).astype(np.int32), "target": f(4, 8),
        "t01": (rng.rand(4, 8) > 0.5).astype(np.float32),
    }


CONSTANTS = ("labels", "target", "t01", "rm", "rv")


class _Kinds:
    def __init__(self, is_low):
        self.is_low = is_low

    def __call__(self, t) -> str:
        return "low" if self.is_low(t) else "float32"


# -- torch ------------------------------------------------------------------------------

def torch_ops():
    import torch
    import torch.nn.functional as F

    kind = _Kinds(lambda t: t.dtype in (torch.float16, torch.bfloat16))

    def rec(out, op, inp, on, y):
        out.append((op, kind(inp), on, y))
        return y

    def img(h):
        return h.reshape(1, 2, 4, 4)

    ops = {
        "linear": lambda h, P, out, on: rec(out, "linear", h, on, F.linear(h, P["W1"], P["b1"])),
        "matmul": lambda h, P, out, on: rec(out, "matmul", h, on, h @ P["W2"]),
        "bmm": lambda h, P, out, on: rec(out, "bmm", h, on, torch.bmm(h.reshape(2, 2, 8),
                                                                     P["W3"])).reshape(4, 8),
        "conv2d": lambda h, P, out, on: rec(out, "conv2d", h, on, F.conv2d(
            img(h), P["C"], P["cb"], padding=1)).reshape(4, 8),
        "softmax": lambda h, P, out, on: rec(out, "softmax", h, on, F.softmax(h, -1)),
        "log_softmax": lambda h, P, out, on: rec(out, "log_softmax", h, on, F.log_softmax(h, -1)),
        "layer_norm": lambda h, P, out, on: rec(out, "layer_norm", h, on, F.layer_norm(
            h, (8,), P["lnw"], P["lnb"])),
        "sum": lambda h, P, out, on: h + 0.1 * rec(out, "sum", h, on, h.sum(-1, keepdim=True)),
        "mean": lambda h, P, out, on: h - rec(out, "mean", h, on, torch.mean(h, -1, keepdim=True)),
        "exp": lambda h, P, out, on: rec(out, "exp", h, on, torch.exp(h * 0.25)),
        "log": lambda h, P, out, on: rec(out, "log", h, on, torch.log(h * h + 1.0)),
        "relu": lambda h, P, out, on: F.relu(h),
        "add_f32": lambda h, P, out, on: rec(out, "add_f32", h, on, h + P["B"]),
        "max_pool": lambda h, P, out, on: rec(out, "max_pool", h, on, F.max_pool2d(
            img(h), 3, 1, 1)).reshape(4, 8),
        "avg_pool": lambda h, P, out, on: rec(out, "avg_pool", h, on, F.avg_pool2d(
            img(h), 3, 1, 1)).reshape(4, 8),
        "global_avg_pool": lambda h, P, out, on: (img(h) + rec(
            out, "global_avg_pool", h, on, F.adaptive_avg_pool2d(img(h), 1))).reshape(4, 8),
        "batch_norm": lambda h, P, out, on: rec(out, "batch_norm", h, on, F.batch_norm(
            img(h), P["rm"], P["rv"], P["bnw"], P["bnb"], training=False)).reshape(4, 8),
    }
    losses = {
        "cross_entropy": lambda h, P, out, on: rec(out, "cross_entropy", h, on, F.cross_entropy(
            h, P["labels"])),
        "mse": lambda h, P, out, on: rec(out, "mse", h, on, F.mse_loss(h, P["target"])),
        "bce_with_logits": lambda h, P, out, on: rec(
            out, "bce_with_logits", h, on, F.binary_cross_entropy_with_logits(h, P["t01"])),
        "nll": lambda h, P, out, on: F.nll_loss(rec(out, "nll", h, on, F.log_softmax(h, -1)),
                                                P["labels"]),
    }
    return ops, losses


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
        self.ops, self.losses = torch_ops()

    def blocks(self, side, p, contract):
        torch = self.torch
        low = getattr(torch, p.low)
        if side == "native":
            outer = lambda: torch.autocast("cpu", dtype=low)  # noqa: E731
            inner = lambda enabled: torch.autocast("cpu", dtype=low, enabled=enabled)  # noqa: E731
        else:
            outer = lambda: amp.autocast(dtype=p.low, contract=contract)  # noqa: E731
            inner = lambda enabled: amp.autocast(  # noqa: E731
                enabled=enabled, dtype=p.low, contract=contract)
        return outer, inner

    def function(self, p, side, contract):
        torch = self.torch
        outer, inner = self.blocks(side, p, contract)
        scope = {"torch": torch, "F32": lambda h: h.float(), "OP": self.ops, "LOSS": self.losses, "OUTER": outer,
                 "INNER": inner, "BREAK": torch._dynamo.graph_break,
                 "CTX": outer() if p.made_outside else None}
        code = compile(programs.source(p, side), f"<autocast fuzz {p.name} {side}>", "exec")
        exec(code, scope)
        return scope["program"]

    def inputs(self, p):
        torch = self.torch
        a = arrays(p)
        P = {k: torch.from_numpy(v.copy()).long() if k == "labels" else
             torch.from_numpy(v.copy()).requires_grad_(k not in CONSTANTS) for k, v in a.items()}
        return P["x"], P

    def run(self, fn, p, compile_with=None):
        x, P = self.inputs(p)
        if compile_with is not None:
            fn = self.torch.compile(fn, backend=compile_with)
        out: list = []
        loss, h = fn(x, P, out)
        loss.backward()
        grads = {k: torch_bits(v.grad) for k, v in P.items() if v.grad is not None}
        return {"loss": torch_bits(loss), "h": torch_bits(h), "grads": grads,
                "ops": [(op, k, on, str(y.dtype).removeprefix("torch.")) for op, k, on, y in out]}


# -- MegEngine ----------------------------------------------------------------------------

def megengine_ops():
    import megengine.functional as F

    kind = _Kinds(lambda t: str(t.dtype) in ("float16", "bfloat16"))

    def rec(out, op, inp, on, y):
        out.append((op, kind(inp), on, y))
        return y

    def img(h):
        return h.reshape(1, 2, 4, 4)

    def nll(h, P, out, on):
        lp = rec(out, "nll", h, on, F.nn.logsoftmax(h, axis=-1))
        return -F.mean(F.nn.indexing_one_hot(lp, P["labels"], 1))

    ops = {
        "linear": lambda h, P, out, on: rec(out, "linear", h, on, F.linear(h, P["W1"], P["b1"])),
        "matmul": lambda h, P, out, on: rec(out, "matmul", h, on, F.matmul(h, P["W2"])),
        "bmm": lambda h, P, out, on: rec(out, "bmm", h, on, F.matmul(h.reshape(2, 2, 8),
                                                                    P["W3"])).reshape(4, 8),
        "conv2d": lambda h, P, out, on: rec(out, "conv2d", h, on, F.conv2d(
            img(h), P["C"], P["cb"].reshape(1, 2, 1, 1), padding=1)).reshape(4, 8),
        "softmax": lambda h, P, out, on: rec(out, "softmax", h, on, F.softmax(h, axis=-1)),
        "log_softmax": lambda h, P, out, on: rec(out, "log_softmax", h, on,
                                                 F.nn.logsoftmax(h, axis=-1)),
        "layer_norm": lambda h, P, out, on: rec(out, "layer_norm", h, on, F.nn.layer_norm(
            h, (8,), True, P["lnw"], P["lnb"])),
        "sum": lambda h, P, out, on: h + 0.1 * rec(out, "sum", h, on,
                                                    F.sum(h, axis=-1, keepdims=True)),
        "mean": lambda h, P, out, on: h - rec(out, "mean", h, on,
                                              F.mean(h, axis=-1, keepdims=True)),
        "exp": lambda h, P, out, on: rec(out, "exp", h, on, F.exp(h * 0.25)),
        "log": lambda h, P, out, on: rec(out, "log", h, on, F.log(h * h + 1.0)),
        "relu": lambda h, P, out, on: F.relu(h),
        "add_f32": lambda h, P, out, on: rec(out, "add_f32", h, on, h + P["B"]),
        "max_pool": lambda h, P, out, on: rec(out, "max_pool", h, on, F.max_pool2d(
            img(h), 3, 1, 1)).reshape(4, 8),
        "avg_pool": lambda h, P, out, on: rec(out, "avg_pool", h, on, F.avg_pool2d(
            img(h), 3, 1, 1)).reshape(4, 8),
        "global_avg_pool": lambda h, P, out, on: (img(h) + rec(
            out, "global_avg_pool", h, on, F.adaptive_avg_pool2d(img(h), (1, 1)))).reshape(4, 8),
        "batch_norm": lambda h, P, out, on: rec(out, "batch_norm", h, on, F.nn.batch_norm(
            img(h), P["rm"].reshape(1, 2, 1, 1), P["rv"].reshape(1, 2, 1, 1),
            P["bnw"].reshape(1, 2, 1, 1), P["bnb"].reshape(1, 2, 1, 1),
            training=False)).reshape(4, 8),
    }
    losses = {
        "cross_entropy": lambda h, P, out, on: rec(out, "cross_entropy", h, on,
                                                   F.nn.cross_entropy(h, P["labels"])),
        "mse": lambda h, P, out, on: rec(out, "mse", h, on, F.nn.square_loss(h, P["target"])),
        "bce_with_logits": lambda h, P, out, on: rec(out, "bce_with_logits", h, on,
                                                     F.nn.binary_cross_entropy(
                                                         h, P["t01"], with_logits=True)),
        "nll": nll,
    }
    return ops, losses


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
        self.ops, self.losses = megengine_ops()

    def function(self, p, side, contract):
        if side == "native":
            outer = lambda: _MegEngineNative(True, p.low)  # noqa: E731
            inner = lambda enabled: _MegEngineNative(enabled, p.low)  # noqa: E731
        else:
            outer = lambda: amp.autocast(dtype=p.low, contract=contract)  # noqa: E731
            inner = lambda enabled: amp.autocast(  # noqa: E731
                enabled=enabled, dtype=p.low, contract=contract)
        scope = {"F32": lambda h: h.astype("float32"), "OP": self.ops, "LOSS": self.losses, "OUTER": outer, "INNER": inner,
                 "BREAK": lambda: None, "CTX": outer() if p.made_outside else None}
        code = compile(programs.source(p, side), f"<autocast fuzz {p.name} {side}>", "exec")
        exec(code, scope)
        return scope["program"]

    def run(self, fn, p, compile_with=None):
        import megengine
        from megengine.autodiff import GradManager

        a = arrays(p)
        P = {k: megengine.tensor(v, dtype="int32" if k == "labels" else "float32")
             for k, v in a.items()}
        trained = [v for k, v in P.items() if k not in CONSTANTS]
        gm = GradManager().attach(trained)
        out: list = []
        with gm:
            loss, h = fn(P["x"], P, out)
            gm.backward(loss)
        grads = {k: megengine_bits(v.grad) for k, v in P.items()
                 if k not in CONSTANTS and v.grad is not None}
        return {"loss": megengine_bits(loss), "h": megengine_bits(h), "grads": grads,
                "ops": [(op, k, on, str(y.dtype)) for op, k, on, y in out]}


def side_for(backend_name: str):
    return TorchSide() if backend_name == "torch" else MegEngineSide()
