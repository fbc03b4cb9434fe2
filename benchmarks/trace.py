"""Eager against ``megengine.jit.trace``, unified_amp against megengine.amp, in one run:
``UNIFIED_AMP_BACKEND=megengine python -m benchmarks trace [--symbolic 0|1]``.

On the conv net and the transformer block (MegEngine's CPU sizes, float16 autocast),
interleaved round by round on the same model and data:

- ``native``: megengine.amp's step (its autocast, ``GradScaler.backward(gm, loss)``,
  ``opt.step().clear_grad()``); ``native_fwd_traced``: the same with the forward and loss
  traced (megengine.amp's documented use of trace; its whole step cannot be traced:
  docs/COMPILE.md);
- ``unified`` and ``unified_fwd_traced``: the same two with unified_amp's autocast and
  GradScaler;
- ``unified_step`` and ``unified_step_traced``: unified_amp's manual loop
  (``gm.backward(scaler.scale(loss))``, ``scaler.step(opt)``, ``scaler.update()``)
  eagerly and with the whole step traced, where the check, the skip and the scale
  update run on the device.

Blocks are timed in the process's CPU time (all its threads, MegEngine's kernel worker
included): on a shared machine far less sensitive to other processes than wall time.
"""

from __future__ import annotations

from typing import Any, Callable

import megengine
import megengine.amp
from megengine.autodiff import GradManager
from megengine.jit import trace as jit_trace

import unified_amp as amp

from .timing import interleave, ratios, spread
from .workloads import SIZES, lookup

DTYPE = "float16"  # MegEngine's CPU build computes no bfloat16
RATIOS = (("native_fwd_traced", "native"), ("unified_fwd_traced", "unified"),
          ("unified", "native"), ("unified_fwd_traced", "native_fwd_traced"),
          ("unified_step_traced", "unified_step"), ("unified_step_traced", "native"))


def _automatic(w: Any, autocast: Callable[[], Any], scaler: Any,
               symbolic: bool | None) -> Callable[[], Any]:
    """megengine.amp's automatic mode; the forward and loss traced unless symbolic is
    None."""
    gm = GradManager().attach(w.params)

    def forward() -> Any:
        with autocast():
            return w.loss()

    fwd = forward if symbolic is None else jit_trace(forward, symbolic=symbolic)

    def step() -> Any:
        with gm:
            loss = fwd()
            scaler.backward(gm, loss)
        w.optimizer.step().clear_grad()
        return loss

    return step


def _manual(w: Any, symbolic: bool | None) -> Callable[[], Any]:
    """unified_amp's manual loop; the whole step traced unless symbolic is None."""
    gm = GradManager().attach(w.params)
    scaler = amp.GradScaler()

    def step() -> Any:
        with gm:
            with amp.autocast(dtype=DTYPE):
                loss = w.loss()
            gm.backward(scaler.scale(loss))
        scaler.step(w.optimizer)
        scaler.update()
        w.optimizer.clear_grad()
        return loss

    return step if symbolic is None else jit_trace(step, symbolic=symbolic)


def trace(run: Any) -> dict[str, Any]:
    kit = run.kit
    symbolic = bool(1 if run.opts.symbolic is None else run.opts.symbolic)
    sched = run.schedule(dict(warmup=3, rounds=25, steps=2), dict(warmup=1, rounds=2, steps=2))

    def native() -> Any:
        return megengine.amp.autocast(enabled=True, low_prec_dtype=DTYPE)

    def unified() -> Any:
        return amp.autocast(dtype=DTYPE)

    out = {}
    for name in run.workloads():
        size = lookup(SIZES, "megengine", "cpu", run.mode)[name]
        w = kit.build(name, size, run.opts.seed or 0)
        steps = {
            "native": _automatic(w, native, megengine.amp.GradScaler(), None),
            "native_fwd_traced": _automatic(w, native, megengine.amp.GradScaler(), symbolic),
            "unified": _automatic(w, unified, amp.GradScaler(), None),
            "unified_fwd_traced": _automatic(w, unified, amp.GradScaler(), symbolic),
            "unified_step": _manual(w, None),
            "unified_step_traced": _manual(w, symbolic)}
        times = interleave({k: kit.block(s) for k, s in steps.items()}, **sched)
        out[name] = {"size": size,
                     "ms_per_step_cpu": {k: spread([t * 1e3 for t in v])
                                         for k, v in times.items()},
                     "ratios_cpu": {f"{a}/{b}": ratios(times[a], times[b]) for a, b in RATIOS}}
        kit.release(w)
    return {"megengine": megengine.__version__, "dtype": DTYPE, "symbolic": symbolic,
            "schedule": sched, "workloads": out}
