"""Where the unified step's extra time goes: ``python -m benchmarks.profile_overhead``.

Runs the overhead variants of ``benchmarks.bench`` (native, unified, scaler_only,
autocast_only, native_contract) under cProfile and prints, per step, the Python
self-time spent in unified_amp's own code (``unified_amp/``, adapters included) and in the
framework's AMP modules, with the heaviest unified_amp functions. The native step is
profiled twice: once before the unified_amp adapter is loaded (pristine) and once after,
since loading the adapter changes what the framework's own autocast dispatches to.

cProfile slows Python code, so these are attributions, not step times; the step times
printed alongside come from un-profiled, interleaved rounds. Self-times are thread CPU
time: on MegEngine, kernels run on its worker thread and are not in them.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import os
import pstats
import sys
import time
from typing import Any, Callable

import unified_amp as amp

from .common import SCHEDULE, SIZES, WORKLOADS, lookup
from .timing import interleaved, round_ratios, spread

# Python source that counts as unified_amp's (the package and its adapters), and as
# each framework's own AMP.
# The adapters are unified_amp.backends: inside the package when installed from a wheel,
# the checkout's top-level backends/ in an editable install.
_UNIFIED = tuple(dict.fromkeys(
    os.path.abspath(path) + os.sep
    for name in ("unified_amp", "unified_amp.backends")
    for path in importlib.util.find_spec(name).submodule_search_locations or ()))
_NATIVE_AMP = {"torch": (f"torch{os.sep}amp{os.sep}",),
               "megengine": (f"megengine{os.sep}amp{os.sep}",
                             f"megengine{os.sep}autodiff{os.sep}")}

# Setting every .grad to None frees the gradient tensors; that deallocation shows up as
# the self-time of whichever Python function does it (gm.zero_grad's drop_grads, or the
# optimizer's zero_grad / clear_grad), so it is counted apart, in every variant.
_RELEASE = ("drop_grads", "zero_grad", "clear_grad")


class _Silent:
    def update(self, n: int) -> None:
        pass


def _profile(step: Callable[[], Any], kit: Any, steps: int,
             native_amp: tuple[str, ...]) -> dict[str, Any]:
    # Thread CPU time, not wall time: time the thread spent descheduled (a shared
    # machine) would otherwise land on whatever function happened to be running.
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(steps):
        kit.read(step())
    prof.disable()
    ours, theirs, release, rows = 0.0, 0.0, 0.0, []
    for (path, line, func), (_, calls, self_s, _, _) in pstats.Stats(prof).stats.items():
        if func in _RELEASE:
            release += self_s
        elif path.startswith(_UNIFIED):
            ours += self_s
            short = path[path.rfind(os.sep, 0, path.rfind(os.sep)) + 1:]
            rows.append((self_s / steps, calls / steps, f"{short}:{line}({func})"))
        elif any(p in path for p in native_amp):
            theirs += self_s
    rows.sort(reverse=True)
    return {"unified_us": ours / steps * 1e6, "native_amp_us": theirs / steps * 1e6,
            "release_us": release / steps * 1e6, "top": rows[:8]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=WORKLOADS, default="transformer")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--quick", action="store_true", help="the --quick sizes of bench")
    p.add_argument("--threads", type=int, default=1, help="as bench's --threads")
    p.add_argument("--steps", type=int, default=40, help="profiled steps per variant")
    p.add_argument("--rounds", type=int, default=15, help="un-profiled timing rounds")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    # The backend's name without loading its adapter, so that the first native profile
    # runs on the framework exactly as it is without unified_amp.
    backend = (os.environ.get("UNIFIED_AMP_BACKEND", "").strip().lower()
               or amp.available_backends()[0])
    kit = importlib.import_module(f".{backend}_kit", __package__).Kit(args.device)
    kit.threads(args.threads)
    mode = "quick" if args.quick else "full"
    w = kit.build(args.workload, lookup(SIZES, backend, kit.device, mode)[args.workload], 0)
    dtype = "bfloat16" if (backend, kit.device) == ("torch", "cpu") else "float16"
    native_amp = _NATIVE_AMP[backend]

    native = kit.native_step(w, dtype)
    for _ in range(3):
        kit.read(native())
    pristine = _profile(native, kit, args.steps, native_amp)

    from .steps import unified_step  # from here on the adapter is loaded

    gm = amp.GradManager(w.params)
    scaler_args = (kit.device,) if backend == "torch" else ()
    variants = {
        "native": native,
        "unified": unified_step(w, gm, dtype, kit.device)[0],
        "scaler_only": kit.native_step(w, dtype, scaler=amp.GradScaler(*scaler_args)),
        "autocast_only": kit.native_step(
            w, dtype, autocast=lambda: amp.autocast(dtype=dtype, device=kit.device)),
        "native_contract": kit.native_step(w, dtype, fp32_sensitive=True),
    }
    warmup = lookup(SCHEDULE, backend, kit.device, mode)["warmup"]
    times = interleaved(variants, kit, warmup=warmup, rounds=args.rounds, steps=5,
                        progress=_Silent())
    profiles = {"native (pristine)": pristine}
    profiles.update({name: _profile(step, kit, args.steps, native_amp)
                     for name, step in variants.items()})

    print(f"{backend} {kit.info()['framework_version']} on {kit.device}, {args.workload}"
          f" {w.size}, {dtype}; {args.rounds} interleaved rounds x 5 steps, then"
          f" {args.steps} profiled steps"
          " per variant")
    print("Python self-time per step, in us: unified_amp's code (package and adapter), the"
          " framework's AMP modules, and freeing the gradients (all variants free them)")
    print(f"{'variant':18} {'step ms':>8} {'vs native':>22} {'unified_amp':>11}"
          f" {'native amp':>10} {'grad free':>9}")
    for name, prof in profiles.items():
        key = name.split()[0]
        if name == "native (pristine)":
            timing = f"{'(profiled only)':>31}"
        else:
            s = spread(times[key]["per_round"])
            r = spread(round_ratios(times, key, "native"))
            timing = (f"{s['median'] * 1e3:8.2f} {r['median']:7.4f}"
                      f" [{r['q1']:.4f}-{r['q3']:.4f}]")
        print(f"{name:18} {timing} {prof['unified_us']:11.1f} {prof['native_amp_us']:10.1f}"
              f" {prof['release_us']:9.1f}")
    for name, prof in profiles.items():
        if prof["top"]:
            print(f"\n{name}: heaviest unified_amp functions (self time per step)")
            for us, calls, where in prof["top"]:
                print(f"  {us * 1e6:8.1f} us  {calls:6.1f} calls  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
