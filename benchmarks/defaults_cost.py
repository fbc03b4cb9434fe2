"""What unified_amp's defaults cost against the framework's own AMP:
``python -m benchmarks.defaults_cost [--quick]`` (backend from UNIFIED_AMP_BACKEND).

Every figure is the median, over interleaved rounds, of the per-round ratio of a variant's
step time to the native step's (torch.autocast + torch.amp.GradScaler, or
megengine.amp.autocast + megengine.amp.GradScaler), with the inter-quartile range, beside
a control: a second native copy timed in the same rounds, whose ratio is what the
machine's noise alone makes of 1.0.

1. **The MLP step** of issue 27: 6 Linear(256, 256) layers, batch 64, one CPU thread,
   bfloat16 on torch and float16 on MegEngine (each CPU's fast low precision, and what
   ``amp.autocast()`` picks there), SGD with momentum, the native loop's form
   (torch.amp's ``scale(loss).backward(); step(opt); update()``, megengine.amp's
   ``scaler.backward(gm, loss); opt.step()``) with one piece swapped at a time: the
   scaler only; ``amp.autocast(contract=False)`` only; ``amp.autocast()`` only (the
   dtype contract on, the default); both with the contract off; both with the defaults.
   Each variant trains a model of its own, made in an order that turns from run to run.
   On torch a second, smaller table measures the floor of the contract's design:
   ``torch.autocast`` with a ``TorchFunctionMode`` that does nothing but call the
   function, beside ``amp.autocast()`` only, native and the control (what any function
   mode costs each torch call in the block; the contract's mode is one). Its own run:
   timed among the first table's variants it moved theirs by 1-2 points.
   Timed in blocks of steps between syncs, in CPU time of the Python thread (the host's
   work, which is what a launch-bound step waits on; robust to a shared machine).
2. **MegEngine's automatic and manual steps** at 10, 100 and 1000 parameter tensors of 64
   elements (``benchmarks.host_cost``'s loop: ``scaler.backward(gm, loss)``; and
   megengine.amp's manual form: ``gm.backward(loss, dy=scale_factor)``,
   ``scaler.unscale(params)``, ``scaler.update()``), unified_amp's scaler against
   megengine.amp's.
3. **The bench's conv net and transformer block** (``benchmarks.workloads``):
   unified_amp's automatic step (``benchmarks.steps.unified_step``) against the native
   AMP step, in wall time per step (``benchmarks.timing.interleaved``).
4. **Python work per step**, which no load on the machine changes: the Python bytecodes
   executed per step (``sys.settrace`` opcode events, framework code included), native
   and with unified_amp's scaler, on the MLP step and (MegEngine) the automatic step by
   tensor count.

On MegEngine the unified scalers start from megengine.amp's scale (2**4), so both skip
the same steps; the per-step work does not depend on the scale.

Writes ``<out>/defaults-cost-<backend>[-quick].json``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import unified_amp as amp

from .common import SCHEDULE, SIZES, WORKLOADS, Workload, lookup
from .host_cost import _interleave, _megengine_loop, _ratios
from .report import loadavg, machine_info, write_json
from .steps import unified_step
from .timing import interleaved, round_ratios, spread

WIDTH, DEPTH, BATCH = 256, 6, 64
TENSORS = (10, 100, 1000)
# The targets of issue 27, by the table's row names.
TARGETS = {
    "torch": {"both, the defaults": 1.02, "both, contract off": 1.01, "the scaler only": 1.01},
    "megengine": {"both, the defaults": 1.02, "automatic 10": 1.10, "automatic 100": 1.05,
                  "automatic 1000": 1.05},
}
# The MLP table's rows: (name, scaler swapped, autocast swapped, contract).
ROWS = (
    ("the scaler only", True, False, None),
    ("amp.autocast(contract=False) only", False, True, False),
    ("amp.autocast() only", False, True, True),
    ("both, contract off", True, True, False),
    ("both, the defaults", True, True, True),
)
# torch only: the mechanism's floor (see the docstring, part 1).
FLOOR_ROW = "torch.autocast + an empty function mode"
_clock = time.thread_time


def _mlp(kit: Any, seed: int) -> Workload:
    """The MLP of issue 27 on the kit's framework, with its batch."""
    kit.seed(seed)
    rng = np.random.default_rng(seed)
    model = kit.mlp([WIDTH] * (DEPTH + 1))
    x = kit.tensor(rng.standard_normal((BATCH, WIDTH), dtype=np.float32))
    y = kit.tensor(rng.standard_normal((BATCH, WIDTH), dtype=np.float32))
    params = kit.trainable(model)
    opt = kit.sgd(params, lr=1e-3, momentum=0.9)

    def loss(fp32_sensitive: bool = False) -> Any:
        return kit.mse(kit.float32(model(x)), y)

    return Workload("mlp", params, opt, loss, BATCH, {"width": WIDTH, "depth": DEPTH}, model)


def _blocks(kit: Any, step: Callable[[], Any]) -> Callable[[int], float]:
    """A block runner for host_cost's _interleave: ``k`` steps between two syncs, per
    step in CPU time of this thread (on a GPU in wall time: there the host waits for
    the device, and a launch-bound step is one the device waits for)."""
    clock = _clock if kit.device == "cpu" else time.perf_counter

    def block(k: int) -> float:
        kit.synchronize()
        t0 = clock()
        for _ in range(k):
            step()
        kit.synchronize()
        return (clock() - t0) / k if k else 0.0

    return block


def _scaler(backend: str, device: str) -> Any:
    # Each native's call form; on MegEngine megengine.amp's starting scale (see above).
    return amp.GradScaler(device) if backend == "torch" else amp.GradScaler(init_scale=2.0**4)


def _native_with_empty_mode(device: str, dtype: str) -> Callable[[], Any]:
    """A factory for ``torch.autocast`` with a function mode that only calls through: the
    cost of the mode mechanism alone, which ``amp.autocast()``'s contract mode pays on
    every torch call in the block before it does any work of its own."""
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


def mlp_table(kit: Any, backend: str, dtype: str, rounds: int, steps: int, warmup: int,
              turn: int, rows: tuple[str, ...] = tuple(r[0] for r in ROWS)
              ) -> dict[str, Any]:
    """Part 1: the MLP step with each swap in ``rows``, beside the native step and a
    control."""
    def make(name: str) -> Callable[[int], float]:
        w = _mlp(kit, seed=0)
        if name in ("native", "control"):
            return _blocks(kit, kit.native_step(w, dtype))
        if name == FLOOR_ROW:
            return _blocks(kit, kit.native_step(
                w, dtype, autocast=_native_with_empty_mode(kit.device, dtype)))
        _, scaler, autocast, contract = next(r for r in ROWS if r[0] == name)
        return _blocks(kit, kit.native_step(
            w, dtype, scaler=_scaler(backend, kit.device) if scaler else None,
            autocast=(lambda: amp.autocast(contract=contract)) if autocast else None))

    names = ["native", "control", *rows]
    turned = names[turn % len(names):] + names[:turn % len(names)]
    made = {name: make(name) for name in turned}  # a model made later can run differently
    times = _interleave({name: made[name] for name in names}, rounds, steps, warmup)
    return {"dtype": dtype, "rounds": rounds, "steps_per_round": steps,
            "native_step_s": spread(times["native"]),
            "ratios": {name: _ratios(times[name], times["native"]) for name in names[1:]},
            "per_round": times}


def megengine_steps(tensors: tuple[int, ...], rounds: int, steps: int, warmup: int
                    ) -> dict[str, Any]:
    """Part 2: MegEngine's automatic and manual steps by parameter tensors."""
    import megengine.amp

    out: dict[str, Any] = {}
    loops = {"automatic": lambda n, s: _megengine_loop(n, "sgd", s),
             "manual": lambda n, s: _megengine_loop(n, "sgd", s, manual=True)}
    for turn, (form, loop) in enumerate(loops.items()):
        out[form] = {}
        for n in tensors:
            # Blocks of about the same length at every size (a step costs about 40 us
            # per tensor here: 4000 // n steps are some 0.2 s), and every size the same
            # rounds: at 1000 tensors 5 rounds of 2 steps read 1.23 and 1.29 in two runs,
            # 15 rounds of 4 then 0.96: the spread of a sample that small.
            r = rounds
            k = max(steps, min(50, 4000 // n))
            makers = {"native": lambda: megengine.amp.GradScaler(init_scale=2.0**4),
                      "unified": lambda: amp.GradScaler(init_scale=2.0**4)}
            names = ["native", "unified", "control"]
            turned = names[(n + turn) % 3:] + names[:(n + turn) % 3]
            made = {name: loop(n, makers["unified" if name == "unified" else "native"]())
                    for name in turned}
            times = _interleave({name: made[name] for name in names}, r, k, warmup)
            out[form][str(n)] = {
                "rounds": r, "steps_per_round": k, "native_step_s": spread(times["native"]),
                "ratio": _ratios(times["unified"], times["native"]),
                "control_ratio": _ratios(times["control"], times["native"]),
                "per_round": times}
            _print_ratio(f"{form} step, {n} tensors", out[form][str(n)]["ratio"],
                         out[form][str(n)]["control_ratio"])
    return out


def workloads(kit: Any, backend: str, dtype: str, mode: str, seed: int) -> dict[str, Any]:
    """Part 3: the bench's conv net and transformer block, unified/native step."""
    sizes = lookup(SIZES, backend, kit.device, mode)
    sched = lookup(SCHEDULE, backend, kit.device, mode)
    out = {}
    for name in WORKLOADS:
        w = kit.build(name, sizes[name], seed)
        variants = {"native": kit.native_step(w, dtype),
                    "unified": unified_step(w, amp.GradManager(w.params), dtype,
                                            kit.device)[0],
                    "control": kit.native_step(w, dtype)}
        times = interleaved(variants, kit, warmup=sched["warmup"],
                            rounds=sched["overhead_rounds"], steps=sched["overhead_steps"])
        out[name] = {
            "size": sizes[name], "rounds": sched["overhead_rounds"],
            "steps_per_round": sched["overhead_steps"],
            "native_step_s": spread(times["native"]["per_round"]),
            "ratio": spread(round_ratios(times, "unified", "native")),
            "control_ratio": spread(round_ratios(times, "control", "native"))}
        _print_ratio(f"{name} step", out[name]["ratio"], out[name]["control_ratio"])
        kit.release(w)
    return out


def _opcodes(block: Callable[[int], float], steps: int) -> float:
    """Python bytecodes executed per step by ``block(steps)``."""
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    block(1)  # first-call work (caches, lazy imports) is not a step's
    sys.settrace(tracer)
    try:
        block(steps)
    finally:
        sys.settrace(None)
    return count[0] / steps


def python_work(kit: Any, backend: str, dtype: str, tensors: tuple[int, ...],
                steps: int) -> dict[str, Any]:
    """Part 4: bytecodes per step, native and with unified_amp's scaler (CPython 3.10
    and 3.11, this project's interpreters: from 3.12 on settrace's opcode events come
    through sys.monitoring and counted none of a native step's, so it is skipped)."""
    if sys.version_info >= (3, 12):
        return {}
    out: dict[str, Any] = {"mlp": {
        "native": _opcodes(_blocks(kit, kit.native_step(_mlp(kit, 0), dtype)), steps),
        "unified scaler": _opcodes(_blocks(kit, kit.native_step(
            _mlp(kit, 0), dtype, scaler=_scaler(backend, kit.device))), steps)}}
    if backend == "megengine" and kit.device == "cpu":
        import megengine.amp

        for n in tensors:
            out[f"automatic {n}"] = {
                "native": _opcodes(_megengine_loop(
                    n, "sgd", megengine.amp.GradScaler(init_scale=2.0**4)), steps),
                "unified scaler": _opcodes(_megengine_loop(
                    n, "sgd", amp.GradScaler(init_scale=2.0**4)), steps)}
    for name, v in out.items():
        print(f"  {name + ': Python bytecodes per step':42s} native {v['native']:8.0f}"
              f"  unified scaler {v['unified scaler']:8.0f}"
              f"  ({v['unified scaler'] - v['native']:+.0f})", flush=True)
    return out


def _fmt(r: dict[str, float]) -> str:
    return f"{r['median']:.3f} [{r['q1']:.2f}-{r['q3']:.2f}]"


def _print_ratio(what: str, ratio: dict[str, float], control: dict[str, float]) -> None:
    print(f"  {what:42s} {_fmt(ratio)}   control {_fmt(control)}", flush=True)


def table(result: dict[str, Any]) -> str:
    """The run's figures as text, targets beside them."""
    targets = TARGETS[result["backend"]]
    mlp = result["mlp"]
    lines = [f"{result['backend']} {result['framework_version']}: ratio to the native AMP"
             f" step, median [IQR] over interleaved rounds",
             f"MLP 6x{WIDTH}, batch {BATCH}, {mlp['dtype']}, {result['device']} (native"
             f" {mlp['native_step_s']['median'] * 1e3:.3f} ms per step):"]
    for name, ratio in mlp["ratios"].items():
        label = "nothing (a second native copy: the control)" if name == "control" else name
        target = targets.get(name)
        lines.append(f"  {label:46s} {_fmt(ratio)}"
                     + (f"   target <= {target}" if target else ""))
    floor = result.get("mode_floor")
    if floor:
        lines.append("The contract's mode against an empty function mode (a run of their own,"
                     f" native {floor['native_step_s']['median'] * 1e3:.3f} ms per step):")
        for name, ratio in floor["ratios"].items():
            label = "nothing (the control)" if name == "control" else name
            lines.append(f"  {label:46s} {_fmt(ratio)}")
    for form, by_n in result.get("megengine_steps", {}).items():
        for n, v in by_n.items():
            target = targets.get(f"{form} {n}")
            label = f"{form} step, {n} tensors"
            lines.append(f"  {label:46s} {_fmt(v['ratio'])}"
                         f"   control {_fmt(v['control_ratio'])}"
                         + (f"   target <= {target}" if target else ""))
    for name, v in result["workloads"].items():
        label = f"{name} step (unified automatic mode)"
        lines.append(f"  {label:46s} {_fmt(v['ratio'])}   control {_fmt(v['control_ratio'])}")
    for name, v in result["python_work"].items():
        label = f"{name}: bytecodes per step, unified scaler"
        lines.append(f"  {label:46s} {v['unified scaler'] - v['native']:+.0f} over native"
                     f" {v['native']:.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.defaults_cost",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None,
                   help="MLP rounds (torch 41, MegEngine 21)")
    p.add_argument("--steps", type=int, default=None, help="MLP steps per round")
    p.add_argument("--step-rounds", type=int, default=15,
                   help="rounds per point of MegEngine's automatic and manual steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 3 rounds, 10 and 100 tensors, tiny workloads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the MLP and the workloads on the GPU (wall time)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    backend = amp.get_backend().name
    kit = importlib.import_module(f".{backend}_kit", __package__).Kit(args.device)
    kit.threads(1)  # one thread: a shared machine, and a launch-bound step
    # amp.autocast()'s default: on CPU bfloat16 on torch, float16 on MegEngine
    dtype = "bfloat16" if backend == "torch" and kit.device == "cpu" else "float16"
    rounds = args.rounds or (41 if backend == "torch" else 21)
    steps = args.steps or (10 if backend == "torch" else 4)
    tensors, step_rounds, mode = TENSORS, args.step_rounds, "full"
    if args.quick:
        rounds, steps, tensors, step_rounds, mode = 3, 2, (10, 100), 3, "quick"
    started, load_before = time.time(), loadavg()
    command = (f"UNIFIED_AMP_BACKEND={backend} python -m benchmarks.defaults_cost"
               f" {' '.join(sys.argv[1:] if argv is None else argv)}").rstrip()
    print(f"{command}: {rounds} rounds x {steps} MLP steps", flush=True)
    result: dict[str, Any] = {
        "backend": backend, "framework_version": machine_info(kit)["framework_version"],
        "device": "one CPU thread" if kit.device == "cpu" else kit.device,
        "command": command, "machine": machine_info(kit),
        "config": {"mlp": {"width": WIDTH, "depth": DEPTH, "batch": BATCH, "dtype": dtype,
                           "rounds": rounds, "steps": steps, "warmup": args.warmup},
                   "tensors": tensors, "step_rounds": step_rounds, "mode": mode},
        "targets": TARGETS[backend]}
    result["mlp"] = mlp_table(kit, backend, dtype, rounds, steps, args.warmup,
                              turn=int(started))
    if backend == "torch":
        result["mode_floor"] = mlp_table(kit, backend, dtype, rounds, steps, args.warmup,
                                         turn=int(started), rows=("amp.autocast() only",
                                                                  FLOOR_ROW))
    if backend == "megengine" and kit.device == "cpu":
        result["megengine_steps"] = megengine_steps(tensors, step_rounds, 2, args.warmup)
    result["workloads"] = workloads(kit, backend, dtype, mode, seed=0)
    result["python_work"] = python_work(kit, backend, dtype, tensors, 2 if args.quick else 10)
    result.update(runtime_s=time.time() - started, loadavg_before=load_before,
                  loadavg_after=loadavg(),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    device = "" if kit.device == "cpu" else f"-{kit.device}"
    path = args.out / f"defaults-cost-{backend}{device}{'-quick' if args.quick else ''}.json"
    write_json(result, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
