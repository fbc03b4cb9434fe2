"""The cross-backend fuzz's programs: written once against unified_amp, run on each
backend in that backend's own interpreter, each run recorded as a JSON trace.

A program is a list of calls, rebuilt from (seed, index) alone: ``with gm:`` blocks (a
forward pass under ``amp.autocast`` blocks, nested or not, with ``enabled=False``, float16
and float32 activations crossing block edges, then one of the backward forms:
``scaler.backward(gm, loss)`` with its options, ``gm.backward(scaler.scale(loss))``,
``gm.backward(loss, dy=scale_factor)``, a forgotten ``scale()``, a framework's own
``.backward()``, none), ``unscale``/``unscale_``/``step``/``update``, optimizer steps,
``clip_grad_norm``, planted inf/NaN, ``zero_grad``, ``state_dict`` round trips through
JSON (also from the other backend's run, and into each framework's own scaler), bad
state dicts, and misuse (calls dropped, repeated and moved at random).

:func:`run_program` runs one on the active backend and returns its trace: per call the
outcome (``"ok"`` or the error's class), the dtypes the forward pass gave, ``stats()``,
the gradients and weights, what ``clip_grad_norm`` returned, the state dict and what the
framework's own scaler made of it. ``test_portable_fuzz.py`` compares the two traces;
``portable_runner.py`` runs programs in the other interpreter.

Float16 throughout, so that the numerics can agree across the frameworks; scales that
overflow only where an inf/NaN is planted (``init_scale`` <= 2**5 and growth every 2nd
step at most, so no scale reaches float16's range in a program) or always (2**40), so
that no skip decision hangs on a last bit the two frameworks round differently.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from typing import Any

import numpy as np

import unified_amp as amp

from .scaler_fuzz_common import misuse

SALT = "portable"
MAX_CALLS = 20
# Cross-backend: the frameworks' float16 kernels round differently in the last bits.
RTOL, ATOL = 2e-2, 2e-3
# Gradients, relative to the magnitudes summed into them (summed_magnitudes, which
# are larger than the gradients: twice in the median): each backend is within a few
# float16 roundings (u = 2**-11) of those. Measured (400 programs each of seeds 1-5
# and 38, 96,740 gradients compared): at most 0.31 of this tolerance used, where
# against the gradients' own magnitude the differences reached 2.5e-2. And no looser:
# with a backend that scales by 0.95, 138 of seed 5's first 200 programs fail at
# 5e-3, as many as against the gradients' own magnitude at RTOL; 132 at 1e-2, 116 at
# 2e-2.
GRAD_RTOL = 5e-3

FORWARDS = {
    # where l1 runs: "f16" (amp.autocast(dtype="float16")), "off"
    # (amp.autocast(enabled=False)) or "none" (no block)
    "first": ["f16", "f16", "f16", "off", "none"],
    # where l2 runs: in l1's block ("same"), in a block nested in it, or in a block of its
    # own after l1's has closed (float16 or float32 activations crossing block edges)
    "second": ["same"] * 10 + ["nested-f16", "nested-off", "after-f16", "after-off",
                               "after-none"],
}
# dtype= spellings an autocast is made with: the same accepted, the same refused, on both
DTYPE_SPELLINGS = {
    "float16": lambda kit: "float16", "half": lambda kit: "half",
    "bf16": lambda kit: "bf16", "np.float16": lambda kit: np.float16,
    "np.dtype": lambda kit: np.dtype("float16"),
    "framework": lambda kit: kit.dtype_object("float16"),
    "FP16": lambda kit: "FP16", "blank": lambda kit: "float16 ",
    "float32": lambda kit: "float32", "np.float32": lambda kit: np.float32,
}
BACKWARDS = ["auto"] * 6 + ["manual"] * 4 + ["dy"] * 2 + ["auto-noupdate", "auto-nounscale",
                                                         "plain", "framework", "none"]


def make_program(seed: int, index: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """(config, calls) from (seed, index) alone; calls are JSON-able lists."""
    rng = random.Random(f"{SALT}:{seed}:{index}")
    config = {
        "init_scale": rng.choice([2.0**2, 2.0**5, 2.0**5, 2.0**40]),
        "growth_interval": rng.choice([2, 3, 2000]),
        "enabled": rng.random() > 0.08,
        "optimizer": rng.choice(["sgd", "sgd-momentum", "adam"]),
        "data": rng.randrange(1 << 16),
    }
    calls: list[list[Any]] = []
    while len(calls) < MAX_CALLS:
        calls.extend(_iteration(rng))
    return config, calls[: rng.randint(1, MAX_CALLS)]


def _block(rng: random.Random, backward: str | None = None) -> list[Any]:
    """A ``with gm:`` block; ``backward``: the iteration's form, which one block in ten
    swaps for any (a forgotten scale(), the framework's own backward, none, ...)."""
    if backward is None or rng.random() < 0.1:
        backward = rng.choice(BACKWARDS)
    call = ["block",
            rng.choice(FORWARDS["first"]), rng.choice(FORWARDS["second"]),
            rng.choice([None, "float32", "float32", "float32"]),  # a cast between the layers
            rng.choice(["both"] * 9 + ["first"]),  # "first": the loss skips l2
            rng.random() < 0.7,  # the loss in float32
            rng.choice([None] * 7 + ["inf", "nan", "loss-inf"]),
            backward,
            rng.randrange(1 << 16)]
    # the blocks' own rules, from the block's data (so the rest of the program is the one
    # drawn before blocks had rules), before the data (call[-1])
    call.insert(8, block_rules(call[-1]))
    return call


# The rows the forward pass calls (l1 and l2 are Linear modules; (o * o).mean()): a rule
# names them by row, the key both backends take.
RULE_ROWS = ("linear", "multiply", "mean")
RULE_KINDS = ("low", "float32", "promote", "input", "refuse")


def block_rules(data: int) -> dict[str, Any]:
    """Rules for a forward's blocks (World.forward), drawn from ``data``: for the
    first block (l1's) and the second (a nested or later one: l2's), each a dict of
    row -> kind, or None (no rules); "refuse" rarely."""
    rng = random.Random(f"{SALT}-rules:{data}")
    out: dict[str, Any] = {}
    for which in ("first", "second"):
        if rng.random() < 0.4:
            keys = rng.sample(RULE_ROWS, rng.randint(1, 2))
            out[which] = {k: "refuse" if rng.random() < 0.05 else rng.choice(RULE_KINDS[:4])
                          for k in keys}
        else:
            out[which] = None
    return out


def _iteration(rng: random.Random) -> list[list[Any]]:
    kind = rng.choice(["auto", "auto", "manual", "manual", "accumulate", "torch-like",
                       "no-update"])
    it: list[list[Any]] = []
    clip = ["clip", rng.choice([0.5, 100.0]), rng.choice(["gm", "gm", "params", "opt"])]
    if kind == "auto":
        it.append(_block(rng, "auto"))
        if rng.random() < 0.4:
            it.append(clip)
        it.append(["opt_step"] if rng.random() < 0.6 else ["step"])
    elif kind == "manual":
        for _ in range(rng.choice([1, 1, 2, 3])):
            it.append(_block(rng, rng.choice(["manual", "manual", "dy"])))
        if rng.random() < 0.1:  # clipped before unscale: refused, the scale still on them
            it.append(clip)
        it.append(["unscale", rng.choice(["gm", "gm", "params", "opt"])])
        if rng.random() < 0.5:
            it.append(clip)
        it.append(["step"] if rng.random() < 0.7 else ["opt_step"])
        it.append(["update", None] if rng.random() < 0.9 else
                  ["update", rng.choice([2.0**3, 2.0**40])])
    elif kind == "accumulate":
        for _ in range(rng.choice([1, 2])):
            it.append(_block(rng, "auto-nounscale"))
        it.append(_block(rng, "auto"))
        if rng.random() < 0.3:
            it.append(clip)
        it.append(["opt_step"])
    elif kind == "torch-like":
        it.append(_block(rng, "manual"))
        if rng.random() < 0.5:
            it.append(["unscale_"])
            if rng.random() < 0.6:
                it.append(clip)
        it.append(["step"])
        it.append(["update", None])
    else:  # update_scale=False, then the user's update()
        it.append(_block(rng, "auto-noupdate"))
        it.append(["opt_step"] if rng.random() < 0.6 else ["step"])
        it.append(["update", None])
    if rng.random() < 0.1:
        it.insert(rng.randrange(1, len(it) + 1), ["poison", rng.choice(["inf", "nan"])])
    if rng.random() < 0.2:
        it.append(["roundtrip", rng.choice(["own", "other"])])
    if rng.random() < 0.1:
        it.insert(rng.randrange(len(it) + 1), ["dtype", rng.choice(sorted(DTYPE_SPELLINGS))])
    it.append(["zero_grad", rng.choice(["gm", "opt"])])
    misuse(rng, it, lambda: rng.choice([
        ["unscale", "gm"], ["update", None], ["step"], ["opt_step"], _block(rng),
        ["roundtrip", "own"], ["zero_grad", "gm"],
        ["load_bad", rng.choice(["empty", "missing", "not-a-dict", "bad-value"])],
        ["clip", 1.0, "gm"]]))
    return it


# -- running a program on the active backend ----------------------------------------------
BAD_STATE_DICTS: dict[str, Any] = {
    "empty": {},
    "missing": {"scale": 8.0, "growth_factor": 2.0},
    "not-a-dict": [("scale", 8.0)],
    "bad-value": {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 3, "_growth_tracker": "0"},
}


class World:
    """One backend's run of one program (the framework through examples/frameworks.py's
    kit: only construction and the ops the frameworks spell differently)."""

    def __init__(self, config: dict[str, Any]):
        from examples import frameworks

        self.kit = kit = frameworks.get()
        self.config = config
        rng = np.random.RandomState(config["data"])
        self.l1, self.l2 = kit.nn.Linear(4, 3), kit.nn.Linear(3, 2)
        # explicit order: MegEngine's parameters() sorts by name
        self.params = [self.l1.weight, self.l1.bias, self.l2.weight, self.l2.bias]
        for p in self.params:
            kit.assign(p, (rng.randn(*p.shape) * 0.5).astype(np.float32))
        name = config["optimizer"]
        self.opt = (kit.adam(self.params, 0.01) if name == "adam" else
                    kit.sgd(self.params, 0.1, momentum=0.9 if name == "sgd-momentum" else 0.0))
        self.gm = amp.GradManager(self.params)
        self.scaler = self.new_scaler()

    def new_scaler(self) -> Any:
        c = self.config
        return amp.GradScaler(init_scale=c["init_scale"], growth_interval=c["growth_interval"],
                              enabled=c["enabled"])

    # -- framework pieces ----------------------------------------------------------------
    def cast32(self, t: Any) -> Any:
        return self.kit.float32(t)

    def framework_backward(self, loss: Any) -> None:
        # The framework's own: torch's Tensor.backward(); MegEngine's tensors have none.
        loss.backward()

    def native_scaler(self) -> Any:
        if self.kit.name == "torch":
            return self.kit.torch.amp.GradScaler("cpu")
        import megengine.amp
        return megengine.amp.GradScaler()

    # -- the calls ---------------------------------------------------------------------------
    def forward(self, record: dict[str, Any], first: str, second: str, cast: str | None,
                which: str, loss32: bool, plant: str | None, rules: dict[str, Any],
                data: int) -> Any:
        kit = self.kit
        x = kit.tensor(_inputs(data, plant))
        # each block with its rules (block_rules); an enabled=False block takes them too
        # and has none in force
        made = {"f16": lambda r: amp.autocast(dtype="float16", rules=r),
                "off": lambda r: amp.autocast(enabled=False, rules=r),
                "none": lambda r: _nothing()}
        blocks = {which_: {k: (lambda f=f, r=rules[which_]: f(r)) for k, f in made.items()}
                  for which_ in ("first", "second")}
        dtypes = record["dtypes"]

        def tail(h: Any) -> Any:
            if cast == "float32":
                h = self.cast32(h)
            out = self.l2(h) if which == "both" else h
            dtypes.append(kit.dtype_name(out))
            o = self.cast32(out) if loss32 else out
            loss = (o * o).mean()
            dtypes.append(kit.dtype_name(loss))
            return loss

        with blocks["first"][first]():
            h = self.l1(x)
            dtypes.append(kit.dtype_name(h))
            if second == "same":
                loss = tail(h)
            elif second.startswith("nested-"):
                with blocks["second"][second[len("nested-"):]]():
                    loss = tail(h)
        if second.startswith("after-"):
            with blocks["second"][second[len("after-"):]]():
                loss = tail(h)
        if plant == "loss-inf":
            loss = loss * float("inf")
        return loss

    def call(self, call: list[Any], record: dict[str, Any], other_state: Any) -> None:
        kind, s, gm = call[0], self.scaler, self.gm
        if kind == "block":
            *forward, backward, rules, data = call[1:]
            with gm:
                loss = self.forward(record, *forward, rules, data)
                if backward == "auto":
                    s.backward(gm, loss)
                elif backward == "auto-noupdate":
                    s.backward(gm, loss, update_scale=False)
                elif backward == "auto-nounscale":
                    s.backward(gm, loss, unscale_grad=False)
                elif backward == "manual":
                    gm.backward(s.scale(loss))
                elif backward == "dy":
                    gm.backward(loss, dy=self.kit.tensor(np.float32(s.scale_factor)))
                elif backward == "plain":
                    gm.backward(loss)
                elif backward == "framework":
                    self.framework_backward(s.scale(loss))
        elif kind == "unscale":
            s.unscale(self.target(call[1]))
        elif kind == "unscale_":
            s.unscale_(self.opt)
        elif kind == "clip":
            record["clip"] = _number(amp.clip_grad_norm(self.target(call[2]), call[1]))
        elif kind == "step":
            s.step(self.opt)
        elif kind == "opt_step":
            self.opt.step()
        elif kind == "update":
            s.update(call[1])
        elif kind == "zero_grad":
            gm.zero_grad() if call[1] == "gm" else self.kit.zero_grad(self.opt)
        elif kind == "poison":
            with_grad = [p for p in self.params if p.grad is not None]
            if with_grad:
                g = self.kit.grad(with_grad[0]).copy()
                g.flat[0] = float(call[1])
                self.kit.set_grad(with_grad[0], g)
        elif kind == "roundtrip":
            state = json.loads(json.dumps(s.state_dict()))
            record["state"] = state
            loaded = state if call[1] == "own" or other_state is None else other_state
            record["loaded_from"] = "own" if loaded is state else "other"
            record["native"] = self.native_load(loaded)
            self.scaler = self.new_scaler()
            self.scaler.load_state_dict(loaded)
        elif kind == "dtype":
            record["autocast_dtype"] = amp.autocast(
                dtype=DTYPE_SPELLINGS[call[1]](self.kit)).dtype
        elif kind == "load_bad":
            bad = BAD_STATE_DICTS[call[1]]
            refusal = self.native_refusal(bad)
            record["native_refusal"] = "accepted" if refusal is None else refusal.__name__
            before = json.dumps(s.state_dict())
            try:
                s.load_state_dict(bad)
            except Exception as e:
                # where both refuse, ours is also the framework's own scaler's type
                record["native_type"] = refusal is not None and isinstance(e, refusal)
                raise
            finally:
                record["unchanged"] = json.dumps(s.state_dict()) == before
        else:
            raise AssertionError(f"unknown call {call!r}")

    def target(self, name: str) -> Any:
        return {"gm": self.gm, "params": self.params, "opt": self.opt}[name]

    def native_load(self, state: dict[str, Any]) -> dict[str, Any] | str:
        """The framework's own scaler, loaded with ``state``: its own state_dict(), or
        why it refused."""
        if not state:
            return "empty (a disabled scaler's)"
        native = self.native_scaler()
        try:
            native.load_state_dict(dict(state))
        except Exception as e:  # noqa: BLE001 -- compared, and named in the failure
            return f"refused: {type(e).__name__}: {e}"
        return json.loads(json.dumps(native.state_dict()))

    def native_refusal(self, bad: Any) -> type | None:
        """The type of the error the framework's own scaler raises loading ``bad``."""
        native = self.native_scaler()
        try:
            native.load_state_dict(bad)
        except Exception as e:  # noqa: BLE001
            return type(e)
        return None

    # -- what is compared ---------------------------------------------------------------------
    def snapshot(self, record: dict[str, Any]) -> None:
        kit = self.kit
        stats = self.scaler.stats()
        record["stats"] = {k: v for k, v in stats.items() if k != "overflows"}
        record["stats"]["overflows"] = len(stats["overflows"])
        record["grads"] = [None if g is None else _numbers(g)
                           for g in (kit.grad(p) for p in self.params)]
        record["weights"] = [_numbers(kit.numpy(p)) for p in self.params]


def _inputs(data: int, plant: str | None) -> np.ndarray:
    x = np.random.RandomState(data).randn(3, 4).astype(np.float32)
    if plant in ("inf", "nan"):
        x[0, 0] = float(plant)
    return x


def summed_magnitudes(weights: list[list[Any]], call: list[Any],
                      spread: list[float] | None = None) -> list[float] | None:
    """The scale of the rounding error a block's backward (``call``, from ``weights``)
    leaves in each parameter's gradient, per unit of the scale it ran with: the
    gradient's largest entry computed in float64 with every input, weight and
    activation replaced by its magnitude (World.forward's arithmetic, whatever its
    dtypes). Each entry bounds the sum of the magnitudes of all that was added up for
    it, through the forward and the backward, and a float16 computation's error is
    within a small multiple of float16's unit roundoff times that, however much the
    terms cancel (the usual bound for sums, |fl(x1 + ... + xn) - (x1 + ... + xn)| <=
    n u (|x1| + ... + |xn|)). None where something planted or overflowed is not
    finite: nothing finite is left to compare there.

    ``spread``: each weight tensor's magnitudes raised by that much. The growth it
    gives bounds how far the gradient moves when each weight moves that far (the
    gradient is a polynomial in the weights, and this one's coefficients are the
    magnitudes of its)."""
    x = np.abs(_inputs(call[-1], call[6]).astype(np.float64))
    if not np.isfinite(x).all() or call[6] == "loss-inf" or \
            any(isinstance(v, str) for w in weights for v in w):
        return None
    w1, b1, w2, b2 = (np.abs(np.array(w, np.float64)) + (spread[j] if spread else 0.0)
                      for j, w in enumerate(weights))
    w1, w2 = w1.reshape(3, 4), w2.reshape(2, 3)
    h = x @ w1.T + b1
    out = h @ w2.T + b2 if call[4] == "both" else h
    d_out = 2 * out / out.size  # (o * o).mean()
    if call[4] != "both":  # l2 takes no part
        return [(d_out.T @ x).max(), d_out.sum(0).max(), 0.0, 0.0]
    d_h = d_out @ w2
    return [(d_h.T @ x).max(), d_h.sum(0).max(), (d_out.T @ h).max(), d_out.sum(0).max()]


def _nothing() -> Any:
    import contextlib
    return contextlib.nullcontext()


def _number(v: float) -> Any:
    """JSON keeps no inf/NaN: those go as strings."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def _numbers(a: Any) -> list[Any]:
    return [_number(v) for v in np.asarray(a, dtype=np.float64).ravel().tolist()]


def run_program(seed: int, index: int, other_states: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """Runs program (seed, index) on the active backend; ``other_states`` maps a call's
    position to the state dict the other backend's run saved there (a "roundtrip" with
    source "other" loads that one). Every call runs, whatever the ones before did."""
    config, calls = make_program(seed, index)
    world = World(config)
    world.snapshot(start := {})
    trace: dict[str, Any] = {"backend": amp.get_backend().name, "config": config,
                             "start": start, "calls": []}
    for i, call in enumerate(calls):
        record: dict[str, Any] = {"call": call, "dtypes": []}
        other = None if other_states is None else other_states.get(str(i))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                world.call(call, record, other)
                record["outcome"] = "ok"
            except Exception as e:  # noqa: BLE001 -- the outcome is what is compared
                record["outcome"] = type(e).__name__
                record["message"] = str(e)[:600]
                record["unified"] = isinstance(e, amp.UnifiedAmpError)
        record["warnings"] = sorted({w.category.__name__ for w in caught
                                     if w.category.__module__.startswith("unified_amp")})
        world.snapshot(record)
        trace["calls"].append(record)
    return trace
