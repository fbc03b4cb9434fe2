"""Where unified_amp's host time goes in MegEngine's automatic step:
``python -m benchmarks.host_cost_parts`` (MegEngine only).

The loop of ``benchmarks.host_cost`` (``scaler.backward(gm, loss)``,
``opt.step().clear_grad()``, SGD, timed in blocks between syncs, thread CPU time) runs
with megengine.amp's scaler ("native"), unified_amp's, a second native one (the
control), and unified_amp's with one part of its work taken out at a time:

- ``trace copy``: the device copy of the scale that a later ``megengine.jit.trace``
  step starts from, written on every eager step;
- ``float32/device guard``: reading each gradient's dtype and device before MegEngine's
  fused check, which would abort the process on a non-float32 gradient or a mix of
  devices (the check itself stays);
- ``ledger``: the record of which gradients a check unscaled (the double-unscale and
  accumulation errors, and rescaling held gradients before an accumulating backward);
- ``forensics``: the overflow report's loss, hook and skipped-run counter;
- ``all four``.

The parts are taken out of one scaler object each (its own adapter copy for the
guard), so the variants share a process and interleave round by round. A scaler
without these parts is not a correct scaler: this is a measurement only. Each part's
share is the unified ratio minus the ratio without it.

Writes ``<out>/host-cost-parts-megengine.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any, Callable

import unified_amp as amp

from .host_cost import _interleave, _megengine_loop, _ratios
from .report import loadavg, write_json
from .timing import spread


def _without_trace_copy(scaler: Any) -> None:
    scaler._mirror_ahead = lambda: False
    scaler._mirror = lambda: None


def _without_guard(scaler: Any) -> None:
    from megengine.functional.math import _check_non_finite

    backend = copy.copy(scaler._be())
    backend.unscale_and_check = lambda grads, inv_scale: [
        _check_non_finite(list(grads), inv_scale)]
    scaler._backend = backend


def _without_ledger(scaler: Any) -> None:
    ledger = scaler._ledger
    ledger.record = lambda *args, **kwargs: None
    ledger.forget = lambda params: None
    ledger.held = lambda params, version: []


def _without_forensics(scaler: Any) -> None:
    forensics = scaler._forensics
    forensics.saw_loss = lambda outputs: None
    forensics.hook = lambda *args: None
    forensics.counted = lambda *args: None
    forensics.end_iteration = lambda: None


PARTS: dict[str, Callable[[Any], None]] = {
    "trace copy": _without_trace_copy,
    "float32/device guard": _without_guard,
    "ledger": _without_ledger,
    "forensics": _without_forensics,
}


def variants(n: int) -> dict[str, Callable[[int], float]]:
    import megengine.amp

    def native() -> Any:
        return megengine.amp.GradScaler(init_scale=2.0**4)

    def unified(*parts: str) -> Any:
        scaler = amp.GradScaler(init_scale=2.0**4)
        for part in parts:
            PARTS[part](scaler)
        return scaler

    made = {"native": native(), "unified": unified(), "control": native()}
    made.update({f"without {p}": unified(p) for p in PARTS})
    made["without all four"] = unified(*PARTS)
    return {name: _megengine_loop(n, "sgd", scaler) for name, scaler in made.items()}


def python_call_cost(n: int, calls: int = 200, reps: int = 30) -> dict[str, Any]:
    """Thread CPU time of a pure-Python call (a no-op function), ``calls`` at a time,
    with MegEngine's worker idle (after a full sync) and while it runs a training
    step's backward for ``n`` tensors: what the worker's activity does to the Python
    the scaler runs per step."""
    import megengine as mge
    import megengine.functional as F
    import numpy as np
    from megengine.autodiff import GradManager

    def noop() -> None:
        return None

    def timed() -> float:
        t0 = time.thread_time()
        for _ in range(calls):
            noop()
        return (time.thread_time() - t0) / calls

    rng = np.random.RandomState(n)
    params = [mge.Parameter(rng.randn(64).astype("float32")) for _ in range(n)]
    gm = GradManager().attach(params)
    idle, busy = [], []
    for _ in range(reps):
        mge._full_sync()
        idle.append(timed())
        with gm:
            loss = F.concat([p.flatten() for p in params]).sum()
            gm.backward(loss)
        busy.append(timed())
        for p in params:
            p.grad = None
    mge._full_sync()
    return {"idle_us": spread([t * 1e6 for t in idle]),
            "during_backward_us": spread([t * 1e6 for t in busy])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_cost_parts",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tensors", default="10,100")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: 10 tensors, 3 rounds")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if amp.get_backend().name != "megengine":
        p.error("the parts measured are MegEngine's automatic step: run with"
                " UNIFIED_AMP_BACKEND=megengine")
    import megengine

    tensors = (10,) if args.quick else tuple(int(t) for t in args.tensors.split(","))
    rounds = 3 if args.quick else args.rounds
    start, load_before = time.time(), loadavg()
    result: dict[str, Any] = {
        "backend": "megengine", "framework_version": megengine.__version__,
        "command": "UNIFIED_AMP_BACKEND=megengine python -m benchmarks.host_cost_parts"
                   f" {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "config": {"tensors": tensors, "rounds": rounds, "optimizer": "sgd"},
        "points": {}}
    for n in tensors:
        k = max(2, min(100, 500 // n))
        times = _interleave(variants(n), rounds, k, args.warmup)
        ratios = {name: _ratios(t, times["native"]) for name, t in times.items()
                  if name != "native"}
        whole = ratios["unified"]["median"]
        result["points"][str(n)] = {
            "iterations_per_round": k,
            "seconds": {name: spread(t) for name, t in times.items()},
            "ratio": ratios,
            "share": {name[len("without "):]: whole - r["median"]
                      for name, r in ratios.items() if name.startswith("without ")},
            "per_round": times}
        print(f"{n} tensors ({rounds} rounds x {k} iterations): native"
              f" {spread(times['native'])['median'] * 1e6:.1f} us per step")
        for name, r in ratios.items():
            print(f"  {name:30} {r['median']:.4f} [{r['q1']:.4f}-{r['q3']:.4f}]")
    calls = result["python_call"] = python_call_cost(tensors[-1])
    print(f"a no-op Python call: {calls['idle_us']['median']:.3f} us with MegEngine's"
          f" worker idle, {calls['during_backward_us']['median']:.3f} us while it runs a"
          f" backward")
    result.update(runtime_s=time.time() - start, loadavg_before=load_before,
                  loadavg_after=loadavg(),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out = out / ("host-cost-parts-megengine" + ("-quick" if args.quick else "") + ".json")
    write_json(result, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
