"""What unified_amp costs against the framework's own AMP: ``python -m benchmarks overhead``.

Every figure is the median, over interleaved rounds, of a per-round ratio (quartiles
beside it), mostly beside a control: a second native copy timed in the same rounds, whose
ratio is what the machine's noise alone makes of 1.0. Each variant trains a model of its
own, made in an order that turns from run to run. On MegEngine the unified scalers start
from megengine.amp's scale (2**4), so both skip the same steps.

- ``eager``: the eager training step of the conv net and the transformer block in the
  native loop's form (torch: ``scaler.scale(loss).backward(); scaler.step(opt);
  scaler.update()``; MegEngine: ``scaler.backward(gm, loss); opt.step()``) with the native
  autocast and GradScaler, with ``amp.autocast()`` + ``amp.GradScaler`` (the defaults),
  and with ``amp.autocast(contract=False)`` + ``amp.GradScaler``; on CUDA at the GPU sizes
  and at the CPU ones (launch-bound there). Also, exactly: the torch calls a forward
  makes, and the Python calls into unified_amp (``unified_amp/``, the adapters) it makes
  under each autocast.
- ``step``: the launch-bound MLP step of issue 27 (6 Linear(256, 256), batch 64) with one
  piece swapped at a time, in CPU time of the Python thread (the host's work, which a
  launch-bound step waits on); on torch, in a run of its own, ``torch.autocast`` with a
  function mode that only calls through: the floor of any contract carried by a mode.
- ``rules``: the same MLP step under ``amp.autocast()`` and under the same block with
  rules (one naming an op the step never calls, one on each of its Linear layers).
- ``mode`` (torch): microseconds per torch call (8x8 linear, relu, add) under
  torch.autocast, with an empty function mode, under ``amp.autocast()`` and
  ``contract=False``.
- ``forensics``: the unified automatic step with ``scaler.watch(model)`` inside
  ``amp.trace_forward(model)`` (hooks installed and removed every step) and after a trace
  was stopped, against the same step without forensics.
- ``pinning``: an MLP step with its middle layer under ``amp.keep_float32`` against the
  same layer run in float32 by hand, and a function's call before and after
  ``amp.register_float_function``.
"""

from __future__ import annotations

import copy
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import unified_amp as amp

from .throughput import low_dtype
from .timing import Block, interleave, made_in_turn, ratios, spread
from .workloads import SIZES, lookup, unified_step

EAGER = ("native", "control", "amp.autocast()", "amp.autocast(contract=False)")


def _scaler(backend: str, device: str) -> amp.GradScaler:
    # each native's call form; on MegEngine megengine.amp's starting scale
    return amp.GradScaler(device) if backend == "torch" else amp.GradScaler(init_scale=2.0**4)


def _unified_autocast(variant: str, device: str) -> Callable[[], Any]:
    # On the kit's device: where torch sees a GPU, a block with no device covers CUDA
    # alone (docs/API.md, "Devices"), and a --device cpu run would time float32.
    contract = variant == "amp.autocast()"
    return lambda: amp.autocast(device=device, contract=contract)


def _count_torch_calls(kit: Any, w: Any, dtype: str) -> int:
    """The torch calls one forward (with its loss) makes, under torch.autocast."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.autocast(kit.device, dtype=getattr(torch, dtype)), Count():
        w.loss()
    return Count.n


def _count_unified_calls(w: Any, autocast: Callable[[], Any]) -> int:
    """Python calls into unified_amp (the core and the adapters) that one forward (with
    its loss) makes inside the block, the block's own entry and exit left out."""
    adapter = Path(inspect.getfile(type(amp.get_backend()))).parents[1]
    ours = (str(Path(amp.__file__).parent), str(adapter))
    n = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event == "call" and frame.f_code.co_filename.startswith(ours):
            n += 1

    with autocast():
        sys.setprofile(profile)
        try:
            w.loss()
        finally:
            sys.setprofile(None)
    return n


def eager(run: Any) -> dict[str, Any]:
    kit = run.kit
    sched = run.schedule(dict(warmup=3, rounds=41, steps=3), dict(warmup=1, rounds=3, steps=2),
                         dict(warmup=5, rounds=15, steps=10))
    dtype = low_dtype(run.backend, kit.device)
    sizes = [("", lookup(SIZES, run.backend, kit.device, run.mode))]
    if kit.device == "cuda" and not run.quick:  # where the per-call cost shows on a GPU
        sizes.append((" (launch-bound)", lookup(SIZES, run.backend, "cpu", "full")))
    out: dict[str, Any] = {}
    for turn, (name, (suffix, size)) in enumerate(
            (n, s) for n in run.workloads() for s in sizes):

        def make(variant: str) -> tuple[Any, Block]:
            w = kit.build(name, size[name], run.opts.seed or 0)
            if variant in ("native", "control"):
                return w, kit.block(kit.native_step(w, dtype))
            return w, kit.block(kit.native_step(w, dtype,
                                                autocast=_unified_autocast(variant, kit.device),
                                                scaler=_scaler(run.backend, kit.device)))

        made = made_in_turn(list(EAGER), make, int(time.time()) + turn)
        blocks = {v: block for v, (_, block) in made.items()}
        times = interleave(blocks, **sched)
        w = made["native"][0]
        counted = {"native": lambda: kit.native_autocast(dtype),
                   **{v: _unified_autocast(v, kit.device) for v in EAGER[2:]}}
        out[name + suffix] = {
            "size": size[name], "dtype": dtype, "native_step_s": spread(times["native"]),
            "ratios": {v: ratios(times[v], times["native"]) for v in EAGER[1:]},
            "per_round_s": times, "final_loss": {v: b.last for v, b in blocks.items()},
            "variants": {v: {"unified_amp_calls_per_forward": _count_unified_calls(w, ac)}
                         for v, ac in counted.items()}}
        if run.backend == "torch":
            out[name + suffix]["torch_calls_per_forward"] = _count_torch_calls(kit, w, dtype)
        blocks.clear()
        for w, _ in made.values():
            kit.release(w)
    return {"schedule": sched, "workloads": out}


# -- the MLP step ------------------------------------------------------------------------
# (name, scaler swapped, autocast swapped, contract) of the MLP table's rows
ROWS = (("the scaler only", True, False, None),
        ("amp.autocast(contract=False) only", False, True, False),
        ("amp.autocast() only", False, True, True),
        ("both, contract off", True, True, False),
        ("both, the defaults", True, True, True))
FLOOR_ROW = "torch.autocast + an empty function mode"
# A block's own rules (docs/API.md, "Your own rules"): one naming an op the step never
# calls, and one on every Linear of the step (the row's own kind, so the same dtypes).
RULE_ROWS = {"amp.autocast(rules={'softmax': 'low'})": {"softmax": "low"},
             "amp.autocast(rules={'linear': 'low'})": {"linear": "low"}}


def _native_with_empty_mode(device: str, dtype: str) -> Callable[[], Any]:
    """A factory for ``torch.autocast`` with a function mode that only calls through."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Empty(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    class Block:  # a class, not a generator: no cost of its own beyond torch.autocast's
        def __enter__(self) -> None:
            self.ac = torch.autocast(device, dtype=getattr(torch, dtype))
            self.ac.__enter__()
            self.mode = Empty()
            self.mode.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.mode.__exit__(*exc)
            self.ac.__exit__(*exc)

    return Block


def _mlp_table(run: Any, dtype: str, sched: dict[str, int], rows: tuple[str, ...]
               ) -> dict[str, Any]:
    kit = run.kit
    clock = time.thread_time if kit.device == "cpu" else time.perf_counter

    def make(name: str) -> Block:
        w = kit.mlp_workload(run.opts.seed or 0)
        if name in ("native", "control"):
            step = kit.native_step(w, dtype)
        elif name == FLOOR_ROW:
            step = kit.native_step(w, dtype, autocast=_native_with_empty_mode(kit.device, dtype))
        elif name in RULE_ROWS:
            step = kit.native_step(w, dtype, autocast=lambda: amp.autocast(
                device=kit.device, rules=RULE_ROWS[name]))
        else:
            _, scaler, autocast, contract = next(r for r in ROWS if r[0] == name)
            step = kit.native_step(
                w, dtype, scaler=_scaler(run.backend, kit.device) if scaler else None,
                autocast=(lambda: amp.autocast(device=kit.device, contract=contract))
                if autocast else None)
        return Block(step, sync=kit.synchronize, clock=clock)

    names = ["native", "control", *rows]
    times = interleave(made_in_turn(names, make, int(time.time())), **sched)
    return {"dtype": dtype, "schedule": sched, "native_step_s": spread(times["native"]),
            "ratios": {name: ratios(times[name], times["native"]) for name in names[1:]},
            "per_round": times}


def step(run: Any) -> dict[str, Any]:
    kit = run.kit
    torch = run.backend == "torch"
    sched = run.schedule(dict(warmup=3, rounds=41 if torch else 21, steps=10 if torch else 4),
                         dict(warmup=1, rounds=3, steps=2))
    dtype = low_dtype(run.backend, kit.device)
    out = {"mlp": _mlp_table(run, dtype, sched, tuple(r[0] for r in ROWS))}
    if torch:  # its own run: timed among the others a ninth model moved them 1-2 points
        out["mode_floor"] = _mlp_table(run, dtype, sched, ("amp.autocast() only", FLOOR_ROW))
    return out


def rules(run: Any) -> dict[str, Any]:
    """The launch-bound MLP step under a block with rules, beside the same block
    without them (and the native's), in one run: what a block's own rules cost."""
    torch = run.backend == "torch"
    sched = run.schedule(dict(warmup=3, rounds=41 if torch else 21, steps=10 if torch else 4),
                         dict(warmup=1, rounds=3, steps=2))
    dtype = low_dtype(run.backend, run.kit.device)
    return {"mlp": _mlp_table(run, dtype, sched, ("amp.autocast() only", *RULE_ROWS))}


# -- the contract's cost per torch call ----------------------------------------------------
def mode(run: Any) -> dict[str, Any]:
    import torch

    contexts: dict[str, Callable[[], Any]] = {
        "torch.autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "+ empty mode": _native_with_empty_mode("cpu", "bfloat16"),
        "amp.autocast": lambda: amp.autocast(dtype="bfloat16", device="cpu"),
        "amp.autocast(contract=False)": lambda: amp.autocast(dtype="bfloat16", device="cpu",
                                                             contract=False)}
    x, w = torch.randn(8, 8), torch.randn(8, 8)

    def block(context: Callable[[], Any]) -> Callable[[int], float]:
        def run_calls(k: int) -> float:  # seconds per torch call, 3 calls an iteration
            with context():
                t0 = time.thread_time()
                for _ in range(k):
                    y = torch.nn.functional.linear(x, w)
                    y = torch.relu(y)
                    y = y + 1
                return (time.thread_time() - t0) / (3 * k) if k else 0.0
        return run_calls

    sched = run.schedule(dict(warmup=200, rounds=15, steps=5000),
                         dict(warmup=200, rounds=3, steps=500))
    per_call = interleave({n: block(c) for n, c in contexts.items()}, **sched)
    base = per_call["torch.autocast"]
    return {"torch": torch.__version__, "schedule": sched,
            "us_per_call": {n: spread([v * 1e6 for v in t]) for n, t in per_call.items()},
            "ratio_to_torch_autocast": {n: ratios(t, base) for n, t in per_call.items()},
            "extra_us_per_call": {n: spread([(a - b) * 1e6 for a, b in zip(t, base)])
                                  for n, t in per_call.items()}}


# -- overflow forensics ------------------------------------------------------------------
def _forensics_step(w: Any, dtype: str, device: str, variant: str) -> Callable[[], Any]:
    """The unified step; "traced" traces each step's forward (the hooks installed and
    removed inside the step: an upper bound for a trace held across steps); "watched"
    started and stopped a trace once: what tracing leaves behind when off."""
    step, scaler = unified_step(w, amp.GradManager(w.params), dtype, device)
    if variant in ("unified", "control"):
        return step
    scaler.watch(w.model)
    tracer = amp.trace_forward(w.model)
    if variant == "watched":
        tracer.start().stop()
        return step

    def traced_step() -> Any:
        with tracer:
            return step()

    return traced_step


def forensics(run: Any) -> dict[str, Any]:
    kit = run.kit
    sched = run.schedule(dict(warmup=3, rounds=31, steps=3), dict(warmup=1, rounds=3, steps=2),
                         dict(warmup=5, rounds=10, steps=10))
    dtype = low_dtype(run.backend, kit.device)
    sizes = lookup(SIZES, run.backend, kit.device, run.mode)
    names = {"unified": "unified", "control": "control", "trace_on": "traced",
             "trace_off": "watched"}
    out = {}
    for name in run.workloads():
        def make(variant: str) -> tuple[Any, Block]:
            w = kit.build(name, sizes[name], run.opts.seed or 0)
            return w, kit.block(_forensics_step(w, dtype, kit.device, variant))

        made = made_in_turn(list(names.values()), make, int(time.time()))
        times = interleave({v: b for v, (_, b) in made.items()}, **sched)
        out[name] = {"size": sizes[name], "dtype": dtype,
                     "unified_step_s": spread(times["unified"]),
                     "ratios": {r: ratios(times[v], times["unified"])
                                for r, v in names.items() if v != "unified"},
                     "per_round_s": times}
        for w, _ in made.values():
            kit.release(w)
    return {"schedule": sched, "workloads": out}


# -- precision pinning -------------------------------------------------------------------
def pinning(run: Any) -> dict[str, Any]:
    kit = run.kit
    big = not run.quick and run.backend == "torch"
    width, batch = (512, 256) if big else (64, 16)
    kit.seed(0)
    rng = np.random.default_rng(0)
    l1, l2, l3 = (kit.place(kit.nn.Linear(width, width)) for _ in range(3))
    x, y = (kit.tensor(rng.standard_normal((batch, width), dtype=np.float32)) for _ in "xy")
    pinned = amp.keep_float32(copy.deepcopy(l2))  # the same weights, pinned once
    gm = amp.GradManager([p for m in (l1, l2, l3, pinned) for p in kit.trainable(m)])

    def middle_by_hand(h: Any) -> Any:
        with amp.autocast(enabled=False):
            return l2(kit.float32(h))

    def make(middle: Callable[[Any], Any]) -> Block:
        def train() -> Any:
            with gm:
                with amp.autocast(device=kit.device):
                    loss = kit.mse(l3(kit.relu(middle(kit.relu(l1(x))))), y)
                gm.backward(loss)
            gm.zero_grad()
            return loss
        return kit.block(train)

    sched = run.schedule(dict(warmup=2, rounds=15, steps=10), dict(warmup=2, rounds=3, steps=2))
    times = interleave({"unpinned": make(l2), "keep_float32": make(pinned),
                        "by_hand": make(middle_by_hand)}, **sched)
    ns = kit.torch if run.backend == "torch" else kit.F
    small = x[:2, :4]

    def call() -> Any:
        with amp.autocast(device=kit.device):
            return ns.sigmoid(small)

    calls = dict(sched, steps=200, warmup=10)
    plain = interleave({"call": Block(call, clock=kit.clock)}, **calls)["call"]
    # registered for the rest of the process: this section runs last
    amp.register_float_function(ns, "sigmoid")
    registered = interleave({"call": Block(call, clock=kit.clock)}, **calls)["call"]
    return {"width": width, "batch": batch, "schedule": sched,
            "step_time_s": {n: spread(v) for n, v in times.items()},
            "ratios": {"keep_float32/by_hand": ratios(times["keep_float32"], times["by_hand"]),
                       "keep_float32/unpinned": ratios(times["keep_float32"],
                                                       times["unpinned"])},
            "registered_call_us": {"plain": spread([t * 1e6 for t in plain]),
                                   "registered_float": spread([t * 1e6 for t in registered])}}
