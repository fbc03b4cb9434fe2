"""What the torch dtype contract costs per torch call: ``python -m benchmarks.mode_cost``.

The contract is a ``TorchFunctionMode`` (backends/torch_backend/autocast.py): every torch
call inside an ``amp.autocast`` block passes through its Python ``__torch_function__``.
Where kernels are tiny and the step is bound by the host launching them (small models on
a GPU), that per-call cost is what a user sees. This times a loop of three tiny calls
(linear, relu, add on 8x8 float32 tensors; one CPU thread) in four variants, interleaved
round by round, and reports microseconds per call and ratios:

- ``torch.autocast``: torch's own, no Python on the call path;
- ``+ empty mode``: torch.autocast plus a ``TorchFunctionMode`` that only calls through,
  the floor of any Python mode;
- ``amp.autocast``: unified_amp's block with the contract;
- ``amp.autocast(contract=False)``: unified_amp's block without it (no mode).

Writes ``<out>/mode-cost-torch.json``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import unified_amp as amp

from .report import loadavg, write_json
from .timing import spread

CALLS_PER_ITERATION = 3


def _variants() -> dict[str, Callable[[], Any]]:
    import torch
    from torch.overrides import TorchFunctionMode

    class EmptyMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    def native() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    class NativeWithEmptyMode:
        def __enter__(self) -> None:
            self.ctx, self.mode = native(), EmptyMode()
            self.ctx.__enter__()
            self.mode.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.mode.__exit__(*exc)
            self.ctx.__exit__(*exc)

    return {
        "torch.autocast": native,
        "+ empty mode": NativeWithEmptyMode,
        "amp.autocast": lambda: amp.autocast(dtype="bfloat16", device="cpu"),
        "amp.autocast(contract=False)": lambda: amp.autocast(dtype="bfloat16", device="cpu",
                                                             contract=False),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mode_cost", description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iterations", type=int, default=5000, help="loop iterations per round")
    p.add_argument("--quick", action="store_true", help="3 rounds of 500 iterations")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if amp.get_backend().name != "torch":
        p.error("the contract's function mode is torch's; set UNIFIED_AMP_BACKEND=torch")
    if args.quick:
        args.rounds, args.iterations = 3, 500
    import torch

    torch.set_num_threads(1)
    x, w = torch.randn(8, 8), torch.randn(8, 8)

    def loop(n: int) -> float:
        t0 = time.thread_time()  # the host's own work; robust to a shared machine
        for _ in range(n):
            y = torch.nn.functional.linear(x, w)
            y = torch.relu(y)
            y = y + 1
        return (time.thread_time() - t0) / (n * CALLS_PER_ITERATION)

    variants = _variants()
    names = list(variants)
    per_call: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        with variants[name]():
            loop(200)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with variants[name]():
                per_call[name].append(loop(args.iterations))
    base = "torch.autocast"
    result = {
        "command": "python -m benchmarks.mode_cost " + " ".join(argv or sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "loadavg": loadavg(), "rounds": args.rounds, "iterations": args.iterations,
        "us_per_call": {n: spread([v * 1e6 for v in per_call[n]]) for n in names},
        "ratio_to_torch_autocast": {
            n: spread([a / b for a, b in zip(per_call[n], per_call[base])]) for n in names},
        "extra_us_per_call": {
            n: spread([(a - b) * 1e6 for a, b in zip(per_call[n], per_call[base])])
            for n in names},
    }
    print(f"per torch call (8x8 linear/relu/add, 1 thread, {args.rounds} rounds;"
          f" median [IQR]):")
    for n in names:
        us, extra = result["us_per_call"][n], result["extra_us_per_call"][n]
        ratio = result["ratio_to_torch_autocast"][n]
        print(f"  {n:30s} {us['median']:6.2f} us   +{extra['median']:5.2f} us"
              f" [{extra['q1']:.2f}, {extra['q3']:.2f}]   x{ratio['median']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "mode-cost-torch.json"
    write_json(result, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
