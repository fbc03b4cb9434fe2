"""Eager vs ``torch.compile`` (inductor), unified_amp vs torch's own AMP, in one run:
``python -m benchmarks.compile [--quick] [--rounds N] [--steps N] [--threads N]``.

For the conv net and the transformer block of the other benchmarks (torch, CPU sizes
"full" or "quick"), each variant trains on its own copy of the model, seeded alike, with
torch.amp's loop: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``.

- native:  ``torch.autocast`` + ``torch.amp.GradScaler``;
- unified: ``amp.autocast`` (the dtype contract on) + ``amp.GradScaler``;
- unified, contract off: ``amp.autocast(contract=False)``, torch's own op dtypes;
- native + contract's casts: torch.autocast with the contract's float32 casts written
  into the model by hand (the models' ``fp32_sensitive``), the native twin of "unified".

Each runs eagerly and compiled: the forward and loss, autocast block included, in one
``torch.compile(..., fullgraph=True)`` (inductor; on a torch whose dynamo cannot trace
autocast's switches, such as 2.7, without ``fullgraph``: the unified block's entry and
exit then run eagerly, docs/COMPILE.md); backward and the scaler stay eager,
as in a compiled model. All variants run in every round, in rotated order; ratios are
taken within a round and summarised by their median. Writes
``benchmarks/results/torch-<device>-compile[-quick].json``.

First it measures what the contract's function mode adds to each torch call made inside
an eager block, and how many such calls a forward of each model makes.

Then the whole step compiled: one ``torch.compile`` (inductor, graph breaks allowed)
around the forward in its autocast block, ``scaler.scale(loss).backward()``,
``scaler.step(opt)`` with a foreach SGD, ``scaler.update()`` and ``zero_grad`` -- so
whatever dynamo compiles of the optimizer's step through the scaler counts. Variants:
native, a second native copy (the control), unified with the contract off and unified
with its defaults; ratios to native, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

import unified_amp as amp

from .common import SIZES, TARGET, WORKLOADS, lookup
from .timing import interleaved, round_ratios, spread
from .torch_kit import Kit

RESULTS = Path(__file__).resolve().parent / "results"
DTYPE = "bfloat16"  # CPU: torch computes bfloat16 fast there; float16 it emulates
SIDES = {  # name -> (autocast factory, scaler factory, fp32_sensitive)
    "native": (lambda dev: torch.autocast(dev, dtype=torch.bfloat16),
               lambda dev: torch.amp.GradScaler(dev), False),
    "unified": (lambda dev: amp.autocast(dtype=DTYPE, device=dev),
                lambda dev: amp.GradScaler(dev), False),
    "unified, contract off": (lambda dev: amp.autocast(dtype=DTYPE, device=dev,
                                                       contract=False),
                              lambda dev: amp.GradScaler(dev), False),
    "native + contract's casts": (lambda dev: torch.autocast(dev, dtype=torch.bfloat16),
                                  lambda dev: torch.amp.GradScaler(dev), True),
}


def make_step(kit: Kit, name: str, size: dict[str, int], seed: int, side: str,
              compiled: bool) -> Callable[[], torch.Tensor]:
    """One training step of a fresh copy of workload ``name`` on ``side``."""
    autocast, scaler_of, fp32_sensitive = SIDES[side]
    w = kit.build(name, size, seed)
    scaler, opt = scaler_of(kit.device), w.optimizer

    def forward() -> torch.Tensor:
        with autocast(kit.device):
            return w.loss(fp32_sensitive)

    if compiled:
        forward = torch.compile(forward, fullgraph=True)

    def step() -> torch.Tensor:
        loss = forward()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


WHOLE_STEP_SIDES = {  # name -> (autocast factory, scaler factory)
    "native": (SIDES["native"][0], SIDES["native"][1]),
    "control (native again)": (SIDES["native"][0], SIDES["native"][1]),
    "unified, contract off": (SIDES["unified, contract off"][0], SIDES["unified"][1]),
    "unified": (SIDES["unified"][0], SIDES["unified"][1]),
}


def make_whole_step(kit: Kit, name: str, size: dict[str, int], seed: int, side: str
                    ) -> Callable[[], torch.Tensor]:
    """The whole training step of a fresh copy of ``name``, compiled, on ``side``."""
    autocast, scaler_of = WHOLE_STEP_SIDES[side]
    w = kit.build(name, size, seed)
    scaler = scaler_of(kit.device)
    opt = torch.optim.SGD(w.params, lr=0.01, momentum=0.9, foreach=True)

    @torch.compile
    def step() -> torch.Tensor:
        with autocast(kit.device):
            loss = w.loss(False)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_whole_step(kit: Kit, name: str, size: dict[str, int], args: argparse.Namespace
                   ) -> dict[str, Any]:
    variants: dict[str, Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    # dynamo compiles opt.step once per optimizer object (it guards on self), and the
    # optimizers of earlier sections count against its recompile limit of 8: past it
    # the later variants' optimizer steps would run eagerly. A clean slate per workload.
    torch._dynamo.reset()
    for side in WHOLE_STEP_SIDES:
        variants[side] = make_whole_step(kit, name, size, args.seed, side)
        t0 = time.perf_counter()
        kit.read(variants[side]())
        compile_s[side] = round(time.perf_counter() - t0, 2)

    class _Quiet:
        def update(self, n: int) -> None:
            pass

    times = interleaved(variants, kit, warmup=args.warmup, rounds=args.rounds,
                        steps=args.steps, progress=_Quiet())
    return {"size": size, "optimizer": "SGD(momentum=0.9, foreach=True)",
            "step_ms_median": {k: round(1e3 * spread(v["per_round"])["median"], 3)
                               for k, v in times.items()},
            "first_call_s (compiles)": compile_s,
            "ratios": {f"{side} / native": summary(round_ratios(times, side, "native"))
                       for side in WHOLE_STEP_SIDES if side != "native"},
            "per_round_s": {k: v["per_round"] for k, v in times.items()}}


def summary(values: list[float]) -> dict[str, float]:
    s = spread(values)
    return {k: round(v, 4) for k, v in s.items() if k != "n"} | {"n": s["n"]}


def run_workload(kit: Kit, name: str, size: dict[str, int], args: argparse.Namespace
                 ) -> dict[str, Any]:
    variants: dict[str, Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    for side in SIDES:
        for compiled in (False, True):
            key = f"{side}, {'compiled' if compiled else 'eager'}"
            variants[key] = make_step(kit, name, size, args.seed, side, compiled)
            if compiled:  # the first call compiles: time it apart from the rounds
                t0 = time.perf_counter()
                kit.read(variants[key]())
                compile_s[key] = round(time.perf_counter() - t0, 2)

    class _Quiet:
        def update(self, n: int) -> None:
            pass

    times = interleaved(variants, kit, warmup=args.warmup, rounds=args.rounds,
                        steps=args.steps, progress=_Quiet())
    ms = {k: round(1e3 * spread(v["per_round"])["median"], 3) for k, v in times.items()}
    ratios = {}
    for mode in ("eager", "compiled"):
        for side in ("unified", "unified, contract off"):
            ratios[f"{side} / native, {mode}"] = summary(
                round_ratios(times, f"{side}, {mode}", f"native, {mode}"))
        ratios[f"unified / native + contract's casts, {mode}"] = summary(round_ratios(
            times, f"unified, {mode}", f"native + contract's casts, {mode}"))
    speedup = {side: summary(round_ratios(times, f"{side}, eager", f"{side}, compiled"))
               for side in SIDES}
    # unified's compiled/eager speedup over native's, round by round
    same_round = [a / b for a, b in zip(round_ratios(times, "unified, eager", "unified, compiled"),
                                        round_ratios(times, "native, eager", "native, compiled"))]
    return {"size": size, "step_ms_median": ms, "first_call_s (compiles)": compile_s,
            "ratios": ratios, "compiled_speedup (eager / compiled)": speedup,
            "unified speedup / native speedup": summary(same_round),
            "per_round_s": {k: v["per_round"] for k, v in times.items()}}


def mode_cost(kit: Kit, args: argparse.Namespace) -> dict[str, Any]:
    """What the contract's function mode adds to each torch call in an eager block: a
    cheap op timed with and without the mode on the stack, both under torch.autocast,
    and how many torch calls a forward of each workload makes."""
    from unified_amp.backends.torch_backend.autocast import CONTRACT
    from torch.overrides import TorchFunctionMode

    x = torch.randn(4)

    def calls() -> None:
        for _ in range(1000):
            x.add(1)

    def best(n: int = 31) -> float:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            calls()
            out.append(time.perf_counter() - t0)
        return min(out) / 1000

    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = best()
        torch._C._push_on_torch_function_stack(CONTRACT)
        try:
            moded = best()
        finally:
            torch._C._pop_torch_function_stack()

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func: Any, types: Any, a: Any = (), kw: Any = None
                               ) -> Any:
            Count.n += 1
            return func(*a, **(kw or {}))

    per_forward = {}
    mode = "quick" if args.quick else "full"
    for name in args.workloads.split(","):
        w = kit.build(name, lookup(SIZES, "torch", kit.device, mode)[name], args.seed)
        Count.n = 0
        with torch.autocast(kit.device, dtype=torch.bfloat16), Count():
            w.loss()
        per_forward[name] = Count.n
    return {"us_per_call_plain": round(plain * 1e6, 3),
            "us_per_call_with_mode": round(moded * 1e6, 3),
            "us_added_per_call": round((moded - plain) * 1e6, 3),
            "torch_calls_per_forward": per_forward}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny models, few rounds")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--sections", default="mode,workloads,whole-step",
                   help="which parts to run, comma-separated (default: all three)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections or sections - {"mode", "workloads", "whole-step"}:
        raise SystemExit(f"--sections takes mode, workloads and whole-step; got {args.sections!r}")
    if os.environ.get("UNIFIED_AMP_BACKEND", "torch") != "torch":
        raise SystemExit("benchmarks.compile measures torch.compile: run it with"
                         " UNIFIED_AMP_BACKEND=torch.")
    amp.set_backend("torch")
    kit = Kit(args.device)
    note = kit.threads(args.threads)
    mode = "quick" if args.quick else "full"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 15)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 2)
    out: dict[str, Any] = {
        "command": "python -m benchmarks.compile " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "device": kit.device, "threads_note": note,
        "dtype": DTYPE, "target_unified_over_native": TARGET, "fullgraph": True,
        "schedule": {"warmup": args.warmup, "rounds": args.rounds, "steps": args.steps},
        "workloads": {}}
    if "mode" in sections:
        report_mode_cost(out, kit, args)
    if "workloads" in sections:
        report_workloads(out, kit, args, mode)
    if "whole-step" in sections:
        report_whole_step(out, kit, args, mode)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if sections == {"mode", "workloads", "whole-step"} else "-" + "-".join(
        sorted(sections))
    path = args.out / f"torch-{kit.device}-compile{'-quick' if args.quick else ''}{suffix}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path}")
    return 0


def report_mode_cost(out: dict[str, Any], kit: Kit, args: argparse.Namespace) -> None:
    cost = out["contract_mode_cost"] = mode_cost(kit, args)
    print(f"contract mode: {cost['us_added_per_call']:.3f} us added per torch call"
          f" ({cost['us_per_call_plain']:.3f} -> {cost['us_per_call_with_mode']:.3f} us for"
          f" a 4-element add); torch calls per forward: {cost['torch_calls_per_forward']}")


def report_workloads(out: dict[str, Any], kit: Kit, args: argparse.Namespace, mode: str
                     ) -> None:
    for name in args.workloads.split(","):
        size = lookup(SIZES, "torch", kit.device, mode)[name]
        res = run_workload(kit, name, size, args)
        out["workloads"][name] = res
        print(f"\n{name} {size}")
        for k, v in res["step_ms_median"].items():
            print(f"  {k:40s} {v:10.3f} ms/step (median)")
        for k, v in res["ratios"].items():
            print(f"  {k:48s} median {v['median']:.4f}  [q1 {v['q1']:.4f}, q3 {v['q3']:.4f}]")
        for k, v in res["compiled_speedup (eager / compiled)"].items():
            print(f"  speedup of compiling, {k:28s} median {v['median']:.4f}")
        v = res["unified speedup / native speedup"]
        print(f"  unified speedup / native speedup             median {v['median']:.4f}"
              f"  [q1 {v['q1']:.4f}, q3 {v['q3']:.4f}]")


def report_whole_step(out: dict[str, Any], kit: Kit, args: argparse.Namespace, mode: str
                      ) -> None:
    out["whole_step_compiled"] = {}
    for name in args.workloads.split(","):
        size = lookup(SIZES, "torch", kit.device, mode)[name]
        res = run_whole_step(kit, name, size, args)
        out["whole_step_compiled"][name] = res
        print(f"\n{name}: the whole step compiled ({res['optimizer']})")
        for k, v in res["step_ms_median"].items():
            print(f"  {k:40s} {v:10.3f} ms/step (median)")
        for k, v in res["ratios"].items():
            print(f"  {k:48s} median {v['median']:.4f}  [q1 {v['q1']:.4f}, q3 {v['q3']:.4f}]")


if __name__ == "__main__":
    raise SystemExit(main())
