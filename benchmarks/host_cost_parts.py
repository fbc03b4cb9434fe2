"""Where unified_amp's host time goes, part by part:
``python -m benchmarks.host_cost_parts`` (backend from UNIFIED_AMP_BACKEND).

A loop of ``benchmarks.host_cost`` runs with the framework's own scaler ("native"),
unified_amp's, a second native one (the control), and unified_amp's with one part of
its work taken out at a time, then with all of them out:

- MegEngine: the automatic step (``scaler.backward(gm, loss)``,
  ``opt.step().clear_grad()``, SGD on 10 and 100 parameter tensors, timed in blocks
  between syncs). Parts: ``float32/device guard`` (reading each gradient's dtype and
  device before MegEngine's fused check, which would abort the process on a
  non-float32 gradient or a mix of devices; the check itself stays), ``ledger`` (the
  record of which gradients a check unscaled: the double-unscale and accumulation
  errors, and rescaling held gradients before an accumulating backward), ``forensics``
  (the overflow report's loss, hook and skipped-run counter), ``trace checks`` (asking
  whether a ``megengine.jit.trace`` is running). The device copy of the scale that a
  traced step starts from is written only right before a trace starts, so an eager
  step has no part for it.
- torch: the whole training step of the 6 x Linear(256, 256) MLP. Parts: ``backward
  watch`` (the scaled loss's autograd node kept, and asked once per step whether a
  backward pass freed it: behind the "backward on the unscaled loss" error),
  ``ledger``, ``forensics``.

On MegEngine two more variants bound what any design of these parts could reach:
``straight line`` replaces ``scaler.backward`` with megengine.amp's own steps written
out on the scaler's state (cotangents, backward, the fused check, the read, the drop,
the scale rule) and nothing else; ``straight line + <part>`` adds one part to it, and
``straight line + all`` the four, each written inline (the adapter's guarded check,
the ledger's held/forget/record, the forensics hook, the trace-mode question). Neither
is a scaler: no stages, distributed or error checks.

The parts are taken out of one scaler object each (its own adapter copy where the part
is the adapter's), so the variants share a process and interleave round by round, in
thread CPU time. A scaler without these parts is not a correct scaler: this is a
measurement only. Each part's share is the unified ratio minus the ratio without it.

Writes ``<out>/host-cost-parts-<backend>.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any, Callable

import unified_amp as amp

from .host_cost import CONFIG, _interleave, _megengine_loop, _ratios, _torch_mlp
from .report import loadavg, write_json
from .timing import spread


def _machine(scaler: Any) -> Any:
    return scaler._m  # the scaler's state machine (unified_amp/_scaler_machine.py)


def _unguarded_check(grads: Any, inv_scale: float, allow_float16: bool = False) -> list[Any]:
    """MegEngine's fused check and unscale as the adapter calls it, without reading
    the gradients' dtypes and devices first."""
    from megengine.functional.math import _check_non_finite

    return [_check_non_finite(list(grads), inv_scale)]


def _own_caps(scaler: Any) -> Any:
    """The scaler's capabilities on a copy of its adapter, for a part to change."""
    m = _machine(scaler)
    caps = m._caps()
    caps.backend = m.backend = copy.copy(caps.backend)
    return caps


def _without_guard(scaler: Any) -> None:
    _own_caps(scaler).backend.unscale_and_check = _unguarded_check


def _without_ledger(scaler: Any) -> None:
    ledger = _machine(scaler).ledger
    ledger.record = lambda *args, **kwargs: None
    ledger.forget = lambda params: None
    ledger.held = lambda params, version: []
    ledger.begin_backward = lambda params, version: []


def _without_forensics(scaler: Any) -> None:
    forensics = _machine(scaler).forensics
    forensics.saw_loss = lambda outputs: None
    forensics.hook = lambda *args: None
    forensics.counted = lambda *args: None
    forensics.end_iteration = lambda: None


def _without_watch(scaler: Any) -> None:
    _own_caps(scaler).probes = None  # scale() then hands the scale out unwatched


def _without_trace_checks(scaler: Any) -> None:
    _own_caps(scaler).tracer = None


def _straight_line(scaler: Any, parts: tuple[str, ...]) -> None:
    """Replaces ``scaler.backward`` with megengine.amp's steps on the scaler's state,
    with ``parts`` (PARTS' MegEngine names) inline (see the module docstring)."""
    import megengine.functional as F

    from unified_amp.scaler._machine import Check
    from unified_amp.scaler._scale_rule import next_scale

    m = _machine(scaler)
    backend, version = m.be(), m._caps().version
    guard, ledger, forensics, trace_checks = (name in parts for name in PARTS["megengine"])

    def backward(gm: Any, y: Any) -> None:
        s = m.s
        if trace_checks:
            m._caps().tracer.trace_mode()
        params = gm.attached_tensors()
        if ledger:
            m.ledger.begin_backward(params, version)
        gm.backward([y], [F.full_like(y, s.value)])
        grads = [p.grad for p in params]
        unscale = backend.unscale_and_check if guard else _unguarded_check
        check = Check(unscale(grads, s.inv()), None)
        if forensics:
            check.on_overflow = m.forensics.hook(params, backend, s.steps + 1)
        found = check.verdict(backend.flag_is_set)
        if found:
            backend.drop_grads(params)
        if ledger:
            m.ledger.record(params, [None] * len(params) if found else grads, check)
        s.value, s.tracker = next_scale(s.value, s.tracker, found, s.growth_factor,
                                        s.backoff_factor, s.growth_interval)
        s.steps += 1
        s.skipped_steps += found

    scaler.backward = backward


PARTS: dict[str, dict[str, Callable[[Any], None]]] = {
    "megengine": {
        "float32/device guard": _without_guard,
        "ledger": _without_ledger,
        "forensics": _without_forensics,
        "trace checks": _without_trace_checks,
    },
    "torch": {
        "backward watch": _without_watch,
        "ledger": _without_ledger,
        "forensics": _without_forensics,
    },
}


def variants(backend: str, n: int) -> dict[str, Callable[[int], float]]:
    """The loops, by variant name; ``n``: MegEngine's parameter tensors. The scalers
    are benchmarks.host_cost's, made the same way."""
    parts = PARTS[backend]
    native, make_unified = CONFIG[backend]["scalers"]()

    def unified(*names: str) -> Any:
        scaler = make_unified()
        for name in names:
            parts[name](scaler)
        return scaler

    def loop(scaler: Any) -> Callable[[int], float]:
        return _torch_mlp(scaler) if backend == "torch" else _megengine_loop(n, "sgd",
                                                                            scaler)

    made = {"native": native(), "unified": unified(), "control": native()}
    made.update({f"without {p}": unified(p) for p in parts})
    made["without all"] = unified(*parts)
    if backend == "megengine":
        lines = {"straight line": (), **{f"straight line + {p}": (p,) for p in parts},
                 "straight line + all": tuple(parts)}
        for name, inline in lines.items():
            made[name] = make_unified()
            _straight_line(made[name], inline)
    return {name: loop(scaler) for name, scaler in made.items()}


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
    p.add_argument("--tensors", default="10,100", help="MegEngine's parameter tensors")
    p.add_argument("--rounds", type=int, default=None, help="MegEngine 40, torch 81")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: one point, 3 rounds")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    backend = amp.get_backend().name
    if backend == "torch":
        import torch

        torch.set_num_threads(1)  # as benchmarks.host_cost
        version = torch.__version__
        points = {"mlp_6x256": 0}
    else:
        import megengine

        version = megengine.__version__
        tensors = (10,) if args.quick else tuple(int(t) for t in args.tensors.split(","))
        points = {str(n): n for n in tensors}
    rounds = 3 if args.quick else args.rounds or (81 if backend == "torch" else 40)
    start, load_before = time.time(), loadavg()
    result: dict[str, Any] = {
        "backend": backend, "framework_version": version,
        "command": f"UNIFIED_AMP_BACKEND={backend} python -m benchmarks.host_cost_parts"
                   f" {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "config": {"points": list(points), "rounds": rounds},
        "points": {}}
    for point, n in points.items():
        k = 25 if backend == "torch" else max(2, min(100, 500 // n))
        times = _interleave(variants(backend, n), rounds, k, args.warmup)
        ratios = {name: _ratios(t, times["native"]) for name, t in times.items()
                  if name != "native"}
        whole = ratios["unified"]["median"]
        result["points"][point] = {
            "iterations_per_round": k,
            "seconds": {name: spread(t) for name, t in times.items()},
            "ratio": ratios,
            "share": {name[len("without "):]: whole - r["median"]
                      for name, r in ratios.items() if name.startswith("without ")},
            "per_round": times}
        print(f"{point} ({rounds} rounds x {k} iterations): native"
              f" {spread(times['native'])['median'] * 1e6:.1f} us per step")
        for name, r in ratios.items():
            print(f"  {name:38} {r['median']:.4f} [{r['q1']:.4f}-{r['q3']:.4f}]")
    if backend == "megengine":
        calls = result["python_call"] = python_call_cost(max(points.values()))
        print(f"a no-op Python call: {calls['idle_us']['median']:.3f} us with MegEngine's"
              f" worker idle, {calls['during_backward_us']['median']:.3f} us while it runs"
              f" a backward")
    result.update(runtime_s=time.time() - start, loadavg_before=load_before,
                  loadavg_after=loadavg(),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out = out / (f"host-cost-parts-{backend}" + ("-quick" if args.quick else "") + ".json")
    write_json(result, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
