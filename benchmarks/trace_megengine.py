"""Eager vs ``megengine.jit.trace`` step time, unified_amp vs megengine.amp, in one run.

``UNIFIED_AMP_BACKEND=megengine python -m benchmarks.trace_megengine [--quick]
[--symbolic 0|1] [--out DIR]``

On the benchmark's conv net and transformer block (MegEngine's CPU sizes, float16
autocast), interleaved round by round on the same model and data (benchmarks/timing.py):

- ``native``: megengine.amp's step: its autocast, ``GradScaler.backward(gm, loss)``,
  ``opt.step().clear_grad()``; ``native_fwd_traced``: the same with the forward and loss
  traced (megengine.amp's documented use of trace; its whole step cannot be traced:
  docs/COMPILE.md);
- ``unified`` and ``unified_fwd_traced``: the same two with unified_amp's autocast and
  GradScaler;
- ``unified_step`` and ``unified_step_traced``: unified_amp's manual loop
  (``gm.backward(scaler.scale(loss))``, ``scaler.step(opt)``, ``scaler.update()``)
  eagerly and with the whole step traced, where the check, the skip and the scale
  update run on the device.

Each block of steps is timed twice: wall-clock, and the process's CPU time (all its
threads, MegEngine's kernel worker included). On a shared machine the CPU time is far
less sensitive to what other processes do, since MegEngine's CPU kernels run on one
thread; both are saved, and the CPU-time ratios are printed first.

Prints per-round ratio medians and writes ``trace-megengine-<device>[-quick].json``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("UNIFIED_AMP_BACKEND", "megengine")

import megengine  # noqa: E402
import megengine.amp  # noqa: E402
from megengine.autodiff import GradManager  # noqa: E402
from megengine.jit import trace  # noqa: E402

import unified_amp as amp  # noqa: E402

from . import report  # noqa: E402
from .common import SIZES, WORKLOADS, lookup  # noqa: E402
from .megengine_kit import Kit  # noqa: E402
from .timing import spread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPE = "float16"  # MegEngine's CPU build computes no bfloat16
RATIOS = (
    ("native_fwd_traced", "native", "traced/eager, megengine.amp (forward traced)"),
    ("unified_fwd_traced", "unified", "traced/eager, unified_amp (forward traced)"),
    ("unified", "native", "unified/native, eager"),
    ("unified_fwd_traced", "native_fwd_traced", "unified/native, forward traced"),
    ("unified_step_traced", "unified_step", "traced/eager, unified_amp (whole step)"),
    ("unified_step_traced", "native", "unified whole step traced / megengine.amp eager"),
)


def _native_autocast() -> Any:
    return megengine.amp.autocast(enabled=True, low_prec_dtype=DTYPE)


def _unified_autocast() -> Any:
    return amp.autocast(dtype=DTYPE)


def automatic_step(w: Any, autocast: Callable[[], Any], scaler: Any,
                   symbolic: bool | None) -> Callable[[], Any]:
    """megengine.amp's automatic mode; the forward and loss traced unless symbolic is
    None."""
    gm = GradManager().attach(w.params)

    def forward() -> Any:
        with autocast():
            return w.loss()

    fwd = forward if symbolic is None else trace(forward, symbolic=symbolic)

    def step() -> Any:
        with gm:
            loss = fwd()
            scaler.backward(gm, loss)
        w.optimizer.step().clear_grad()
        return loss

    return step


def manual_step(w: Any, symbolic: bool | None) -> Callable[[], Any]:
    """unified_amp's manual loop; the whole step traced unless symbolic is None."""
    gm = GradManager().attach(w.params)
    scaler = amp.GradScaler()

    def step() -> Any:
        with gm:
            with _unified_autocast():
                loss = w.loss()
            gm.backward(scaler.scale(loss))
        scaler.step(w.optimizer)
        scaler.update()
        w.optimizer.clear_grad()
        return loss

    return step if symbolic is None else trace(step, symbolic=symbolic)


def variants(w: Any, symbolic: bool) -> dict[str, Callable[[], Any]]:
    return {
        "native": automatic_step(w, _native_autocast, megengine.amp.GradScaler(), None),
        "native_fwd_traced": automatic_step(w, _native_autocast,
                                            megengine.amp.GradScaler(), symbolic),
        "unified": automatic_step(w, _unified_autocast, amp.GradScaler(), None),
        "unified_fwd_traced": automatic_step(w, _unified_autocast, amp.GradScaler(),
                                             symbolic),
        "unified_step": manual_step(w, None),
        "unified_step_traced": manual_step(w, symbolic),
    }


def timed_rounds(variants: dict[str, Callable[[], Any]], kit: Kit, *, warmup: int,
                 rounds: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """benchmarks/timing.py's interleaving (the order rotates each round), timing each
    block by wall clock and by this process's CPU time. Seconds per step."""
    names = list(variants)
    out = {n: {"wall": [], "cpu": []} for n in names}
    for name in names:
        for _ in range(warmup):
            kit.read(variants[name]())
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = variants[name]
            kit.synchronize()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                kit.read(step())
            kit.synchronize()
            out[name]["wall"].append((time.perf_counter() - w0) / steps)
            out[name]["cpu"].append((time.process_time() - c0) / steps)
    return out


def _python() -> str:
    """The interpreter, relative to the checkout when it lives there (a venv)."""
    rel = os.path.relpath(sys.executable)
    return "python" if rel.startswith("..") else rel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trace_megengine")
    p.add_argument("--quick", action="store_true", help="tiny models, few rounds")
    p.add_argument("--symbolic", type=int, choices=(0, 1), default=1,
                   help="trace(symbolic=...) for the traced variants (default 1)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if amp.get_backend().name != "megengine":
        raise SystemExit("run with UNIFIED_AMP_BACKEND=megengine")
    kit = Kit("cpu")
    mode = "quick" if args.quick else "full"
    rounds = args.rounds or (2 if args.quick else 9)
    steps = args.steps or (2 if args.quick else 3)
    symbolic = bool(args.symbolic)
    result: dict[str, Any] = {
        "command": (f"UNIFIED_AMP_BACKEND=megengine {_python()} -m"
                    f" benchmarks.trace_megengine {shlex.join(sys.argv[1:] if argv is None else argv)}").rstrip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "framework": kit.info(), "dtype": DTYPE, "symbolic": symbolic,
        "rounds": rounds, "steps_per_round": steps, "loadavg_before": report.loadavg(),
        "workloads": {},
    }
    print(f"MegEngine {megengine.__version__} CPU, {DTYPE}, trace(symbolic={symbolic}),"
          f" {rounds} rounds x {steps} steps; per-round ratio medians [IQR]")
    for name in WORKLOADS:
        size = lookup(SIZES, "megengine", "cpu", mode)[name]
        w = kit.build(name, size, seed=0)
        times = timed_rounds(variants(w, symbolic), kit, warmup=3, rounds=rounds,
                             steps=steps)
        entry: dict[str, Any] = {"size": size}
        print(f"\n{name} {size}")
        print(f"  {'':50s} {'CPU time':>22s} {'wall clock':>22s}")
        for clock in ("cpu", "wall"):
            entry[f"ms_per_step_{clock}"] = {
                v: {k: (x * 1e3 if k != "n" else x) for k, x in spread(t[clock]).items()}
                for v, t in times.items()}
        for v in times:
            cpu, wall = (entry[f"ms_per_step_{c}"][v]["median"] for c in ("cpu", "wall"))
            print(f"  {v + ' (ms/step)':50s} {cpu:22.2f} {wall:22.2f}")
        for clock in ("cpu", "wall"):
            entry[f"ratios_{clock}"] = {
                f"{num}/{den}": spread([a / b for a, b in zip(times[num][clock],
                                                              times[den][clock])])
                for num, den, _ in RATIOS}
        for num, den, label in RATIOS:
            cells = []
            for clock in ("cpu", "wall"):
                r = entry[f"ratios_{clock}"][f"{num}/{den}"]
                cells.append(f"{r['median']:.3f} [{r['q1']:.3f}-{r['q3']:.3f}]")
            print(f"  {label:50s} {cells[0]:>22s} {cells[1]:>22s}")
        result["workloads"][name] = entry
        kit.release(w)
    result["loadavg_after"] = report.loadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace-megengine-cpu{'-quick' if args.quick else ''}.json"
    report.write_json(result, path)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
