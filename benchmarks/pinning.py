"""What ``amp.keep_float32`` and a registered function cost: ``python -m benchmarks overhead --sections pinning``.

On the active backend (``UNIFIED_AMP_BACKEND``), a small MLP's training step under
``amp.autocast`` (the backend's CPU default: bfloat16 with torch, float16 with
MegEngine), side by side in interleaved rounds:

- ``unpinned``: no layer pinned;
- ``keep_float32``: the middle layer pinned with ``amp.keep_float32``;
- ``by_hand``: the same layer run in float32 the way a user writes it without the pin
  (``amp.autocast(enabled=False)`` around it and a cast of its input).

The figure of merit is keep_float32 / by_hand: what the pin costs over the code it
replaces. A second table times one call of a function before and after
``amp.register_float_function`` (the wrapper's host cost, on a tiny tensor where it
shows). Prints the figures and writes ``<backend>-cpu[-quick].json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

import unified_amp as amp

from .timing import interleaved, spread

_OUT = Path(__file__).resolve().parent / "results" / "pinning"


def _torch_setup(width: int, batch: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(3)]
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)
    params = [p for m in layers for p in m.parameters()]
    return dict(layers=layers, x=x, y=y, params=params,
                mse=torch.nn.functional.mse_loss, relu=torch.relu,
                to_float=lambda t: t.float(), fn=torch.sigmoid, ns=torch, name="sigmoid",
                read=lambda t: float(t.item()))


def _megengine_setup(width: int, batch: int) -> dict[str, Any]:
    import megengine as mge
    import megengine.functional as F
    import megengine.module as M

    rng = np.random.RandomState(0)
    layers = [M.Linear(width, width) for _ in range(3)]
    x = mge.tensor(rng.randn(batch, width).astype("float32"))
    y = mge.tensor(rng.randn(batch, width).astype("float32"))
    params = [p for m in layers for p in m.parameters()]
    return dict(layers=layers, x=x, y=y, params=params, mse=F.nn.square_loss,
                relu=F.relu, to_float=lambda t: t.astype("float32"), fn=F.sigmoid,
                ns=F, name="sigmoid", read=lambda t: float(t.item()))


def _steps(s: dict[str, Any]) -> dict[str, Callable[[], float]]:
    l1, l2, l3 = s["layers"]
    pinned = amp.keep_float32(copy.deepcopy(l2))  # the same weights, pinned once
    gm = amp.GradManager(s["params"] + list(pinned.parameters()))
    relu, mse, to_float = s["relu"], s["mse"], s["to_float"]

    def middle_by_hand(h: Any) -> Any:
        with amp.autocast(enabled=False):
            return l2(to_float(h))

    def make(middle: Callable[[Any], Any]) -> Callable[[], float]:
        def step() -> float:
            with gm:
                with amp.autocast():
                    loss = mse(l3(relu(middle(relu(l1(s["x"]))))), s["y"])
                gm.backward(loss)
            gm.zero_grad()
            return s["read"](loss)

        return step

    return {"unpinned": make(l2), "keep_float32": make(pinned),
            "by_hand": make(middle_by_hand)}


def _interleave(variants: dict[str, Callable[[], Any]], rounds: int, steps: int,
                warmup: int) -> dict[str, list[float]]:
    times = interleaved(variants, warmup=warmup, rounds=rounds, steps=steps)
    return {name: t["per_round"] for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead --sections pinning",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
    parser.add_argument("--out", type=Path, default=_OUT)
    args = parser.parse_args(argv)
    backend = amp.get_backend().name
    big = not args.quick and backend == "torch"
    width, batch = (512, 256) if big else (64, 16)
    rounds, steps = (3, 2) if args.quick else (15, 10)
    s = (_torch_setup if backend == "torch" else _megengine_setup)(width, batch)

    step_times = _interleave(_steps(s), rounds, steps, warmup=2)
    x_small = s["x"][:2, :4]
    fn_name = s["name"]

    def call() -> Any:
        with amp.autocast():
            return getattr(s["ns"], fn_name)(x_small)

    plain = _interleave({"call": call}, rounds, 200, warmup=10)["call"]
    amp.register_float_function(s["ns"], fn_name)
    registered = _interleave({"call": call}, rounds, 200, warmup=10)["call"]
    from unified_amp import cast_registry

    cast_registry._unregister_all()

    def ratio(a: list[float], b: list[float]) -> dict[str, float]:
        return spread([x / y for x, y in zip(a, b)])

    result = {
        "config": {"backend": backend, "device": "cpu", "width": width, "batch": batch,
                   "rounds": rounds, "steps_per_round": steps, "quick": args.quick},
        "step_time_s": {n: spread(v) for n, v in step_times.items()},
        "ratios": {"keep_float32/by_hand": ratio(step_times["keep_float32"],
                                                 step_times["by_hand"]),
                   "keep_float32/unpinned": ratio(step_times["keep_float32"],
                                                  step_times["unpinned"])},
        "registered_call_us": {"plain": spread([t * 1e6 for t in plain]),
                               "registered_float": spread([t * 1e6 for t in registered])},
    }
    print(f"{backend}, MLP {width}x3, batch {batch}, {rounds} rounds x {steps} steps")
    for name, v in result["step_time_s"].items():
        print(f"  {name:13s} {v['median'] * 1e3:8.3f} ms/step")
    for name, v in result["ratios"].items():
        print(f"  {name:24s} median {v['median']:.3f} (q1 {v['q1']:.3f}, q3 {v['q3']:.3f})")
    for name, v in result["registered_call_us"].items():
        print(f"  {fn_name} call under autocast, {name:16s} {v['median']:8.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{backend}-cpu{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0
