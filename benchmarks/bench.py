"""The benchmark CLI: ``python -m benchmarks.bench [--quick] [--tf32 both] [--sections ...]
[--out DIR]``.

For a ResNet-style conv net and a transformer block, on the backend named by
``UNIFIED_AMP_BACKEND`` and the device present (CUDA if the framework sees one):

1. training throughput of the unified_amp step in float32, float16 and bfloat16 (a
   precision the backend cannot compute is skipped, with the library's reason);
2. peak memory of each, where the framework reports one;
3. overhead ratios, interleaved round by round on the same model and data: unified_amp's
   AMP step against the framework's own; only the GradScaler class swapped (the
   drop-in); only the autocast swapped; the native step with the float32 casts of
   unified_amp's dtype contract written by hand, which separates the cost of those
   casts from unified_amp's own; and the unified step with overflow forensics, with
   forward tracing on and off;
4. apex's opt levels O0-O3 (``amp.initialize`` + ``amp.scale_loss``), interleaved, each
   on its own copy of the model: step time, the bytes of weights + master weights +
   optimizer state, and peak memory where the framework reports one, as ratios to O0.

Writes ``<backend>-<device>[-quick].json`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import unified_amp as amp

from . import report
from .common import SCHEDULE, SIZES, TARGET, WORKLOADS, lookup
from .steps import apex_step, forensics_step, precision_supported, unified_step
from .timing import interleaved, round_ratios, spread

PRECISIONS = (None, "float16", "bfloat16")  # None: the float32 baseline
OPT_LEVELS = ("O0", "O1", "O2", "O3")
SECTIONS = ("throughput", "overhead", "opt-levels")
MEMORY_STEPS = 2
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="AMP throughput, peak memory and unified-vs-native overhead on the"
                    " backend named by UNIFIED_AMP_BACKEND.")
    p.add_argument("--quick", action="store_true",
                   help="tiny models and few steps: a smoke run of every code path")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA if the framework sees a GPU, else CPU")
    p.add_argument("--tf32", choices=("off", "on", "both"), default="off",
                   help="TF32 for float32 matmuls/convs (torch on CUDA only); 'both' repeats"
                        " the throughput section for each setting")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1; 0 keeps torch's default). On a"
                        " shared machine, torch's multi-threaded kernels slow down many-fold"
                        " whenever another process holds a core; MegEngine's default CPU"
                        " device runs one thread anyway. Ignored on CUDA")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}; a subset writes"
                        " <backend>-<device>[-quick]-<sections>.json, so it never"
                        " overwrites a full run")
    p.add_argument("--warmup", type=int, help="untimed steps per variant before timing")
    p.add_argument("--rounds", type=int, help="throughput rounds")
    p.add_argument("--steps", type=int, help="steps per variant per throughput round")
    p.add_argument("--overhead-rounds", type=int, help="overhead rounds")
    p.add_argument("--overhead-steps", type=int, help="steps per variant per overhead round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS,
                   help=f"directory for the JSON and PNG (default {RESULTS})")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        p.error(f"--workloads: unknown {bad}; choose from {', '.join(WORKLOADS)}")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad or not args.sections:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    for name in ("threads", "warmup", "rounds", "steps", "overhead_rounds", "overhead_steps"):
        value, least = getattr(args, name), 0 if name in ("threads", "warmup") else 1
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}")
    return args


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    # disable=None: a bar on a terminal, silence in logs and CI.
    return tqdm(total=total, unit="step", disable=None, file=sys.stderr)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _overhead_dtype(backend: str, device: str) -> str:
    """The device's AMP dtype, the same in native and unified: what each framework
    computes fastest in low precision there."""
    if device == "cpu":
        return "bfloat16" if backend == "torch" else "float16"
    return "float16"


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"skipped": True, "reason": f"failed: {type(exc).__name__}: {exc}"}


def _first_steps(variants: dict[str, Any], kit: Any, progress: Any) -> dict[str, Any]:
    """Runs each variant once; drops (and returns) those that fail, with the reason."""
    failures = {}
    for name in list(variants):
        try:
            kit.read(variants[name]())
        except Exception as exc:  # a kernel the device lacks: record it, keep going
            failures[name] = _failed(exc)
            del variants[name]
        progress.update(1)
    return failures


def throughput(kit: Any, w: Any, gm: Any, tf32: bool | None, sched: dict[str, int],
               measure_memory: bool, progress: Any) -> dict[str, Any]:
    """fp32 vs float16 vs bfloat16 unified_amp steps on ``w``, interleaved."""
    variants, scalers, records = {}, {}, {}
    for dtype in PRECISIONS:
        key = dtype or "float32"
        reason = precision_supported(dtype, kit.device) if dtype else None
        if reason:
            records[key] = {"skipped": True, "reason": reason}
            continue
        variants[key], scalers[key] = unified_step(w, gm, dtype, kit.device)
    records.update(_first_steps(variants, kit, progress))
    times = interleaved(variants, kit, warmup=max(sched["warmup"] - 1, 0),
                        rounds=sched["rounds"], steps=sched["steps"], progress=progress)
    for key, step in variants.items():
        t = times[key]
        s = spread(t["per_round"])
        base = round_ratios(times, "float32", key) if "float32" in times else None
        rec = {
            "dtype": key,
            "step_time_s": s,
            "per_round_step_time_s": t["per_round"],
            "samples_per_s": w.batch / s["median"],
            "samples_per_s_iqr": [w.batch / s["q3"], w.batch / s["q1"]],
            "speedup_vs_fp32": spread(base) if base else None,
            "final_loss": t["losses"][-1],
            "scaler": scalers[key].stats(),
        }
        if measure_memory:
            kit.reset_peak_memory()
            for _ in range(MEMORY_STEPS):
                kit.read(step())
            progress.update(MEMORY_STEPS)
        rec["peak_memory_bytes"], rec["peak_memory_source"] = kit.peak_memory()
        records[key] = rec
    base_mem = records.get("float32", {}).get("peak_memory_bytes")
    for rec in records.values():
        if not rec.get("skipped"):
            mem = rec["peak_memory_bytes"]
            rec["peak_memory_vs_fp32"] = mem / base_mem if mem and base_mem else None
    order = ["float32", "float16", "bfloat16"]
    return {"tf32": tf32, "variants": {k: records[k] for k in order if k in records}}


# (name, numerator, denominator) of the overhead ratios, from the per-round step times.
RATIOS = (
    ("unified", "unified", "native"),
    ("scaler_only", "scaler_only", "native"),
    ("autocast_only", "autocast_only", "native"),
    ("contract_cost", "native_contract", "native"),
    ("unified_same_dtypes", "unified", "native_contract"),
    ("trace_on", "traced", "unified"),
    ("trace_off", "watched", "unified"),
)


def overhead(kit: Any, w: Any, gm: Any, dtype: str, sched: dict[str, int],
             progress: Any) -> dict[str, Any]:
    """unified_amp's step vs the native AMP step, the one-class swaps, and the native step
    computing the dtype contract's float32 ops by hand; interleaved."""
    def unified_autocast() -> amp.autocast:
        return amp.autocast(dtype=dtype, device=kit.device)

    reason = precision_supported(dtype, kit.device)
    if reason:
        return {"skipped": True, "reason": reason}
    scaler_args = (kit.device,) if kit.name == "torch" else ()  # each native's call form
    variants = {
        "native": kit.native_step(w, dtype),
        "unified": unified_step(w, gm, dtype, kit.device)[0],
        "scaler_only": kit.native_step(w, dtype, scaler=amp.GradScaler(*scaler_args)),
        "autocast_only": kit.native_step(w, dtype, autocast=unified_autocast),
        "native_contract": kit.native_step(w, dtype, fp32_sensitive=True),
        "traced": forensics_step(w, gm, dtype, kit.device, trace=True),
        "watched": forensics_step(w, gm, dtype, kit.device, trace=False),
    }
    descriptions = {
        "native": kit.native_description,
        "unified": "amp.autocast inside amp.GradManager; amp.GradScaler.backward(gm, loss)"
                   " (automatic mode); opt.step(); gm.zero_grad()",
        "scaler_only": "the native step with amp.GradScaler in place of the native"
                       " GradScaler",
        "autocast_only": "the native step with amp.autocast in place of the native"
                         " autocast",
        "native_contract": "the native step, with the model casting to float32 by hand"
                           " where unified_amp's dtype contract does (the softmax input;"
                           " the global-pooling input)",
        "traced": "the unified step with scaler.watch(model), inside"
                  " `with amp.trace_forward(model):` (hooks installed and removed in each"
                  " step)",
        "watched": "the unified step with scaler.watch(model), after a trace of the model"
                   " was started and stopped: forensics with tracing off",
    }
    failures = _first_steps(variants, kit, progress)
    if "native" in failures:
        return failures["native"]
    times = interleaved(variants, kit, warmup=max(sched["warmup"] - 1, 0),
                        rounds=sched["overhead_rounds"], steps=sched["overhead_steps"],
                        progress=progress)
    ratios = {}
    for name, num, den in RATIOS:
        if num in times and den in times:
            per_round = round_ratios(times, num, den)
            ratios[name] = dict(spread(per_round), numerator=num, denominator=den,
                                per_round=per_round)
    return {
        "dtype": dtype,
        "rounds": sched["overhead_rounds"],
        "steps_per_round": sched["overhead_steps"],
        "target": TARGET,
        "variants": {
            name: {"description": descriptions[name],
                   "step_time_s": spread(times[name]["per_round"]),
                   "per_round_step_time_s": times[name]["per_round"],
                   "final_loss": times[name]["losses"][-1]}
            for name in variants
        },
        "failed": failures,
        "ratios": ratios,
    }


def _initialized(kit: Any, name: str, size: dict[str, int], seed: int, level: str,
                 dtype: str) -> tuple[Any, Any, amp.GradScaler, dict[str, Any]]:
    """A fresh workload through ``amp.initialize`` at ``level``: (workload, its apex
    step, its loss scaler, the resolved opt-level properties)."""
    w = kit.build(name, size, seed)
    w.model, w.optimizer = amp.initialize(w.model, w.optimizer, opt_level=level,
                                          low_dtype=dtype)
    return (w, apex_step(w, amp.GradManager(w.params)), amp.loss_scaler(),
            dataclasses.asdict(amp.opt_properties()))


def _state_bytes(kit: Any, w: Any) -> dict[str, int]:
    """Bytes of the weights, the master weights and the optimizer state of ``w``."""
    ids = {id(p) for p in w.params}
    masters = [m for m in amp.master_params(w.optimizer) if id(m) not in ids]
    out = {"weights": kit.tensor_bytes(w.params),
           "master_weights": kit.tensor_bytes(masters),
           "optimizer_state": kit.tensor_bytes(kit.optimizer_tensors(w.optimizer))}
    out["total"] = sum(out.values())
    return out


def opt_levels(kit: Any, name: str, size: dict[str, int], seed: int, dtype: str,
               sched: dict[str, int], measure_memory: bool, progress: Any
               ) -> dict[str, Any]:
    """O0-O3 through amp.initialize on copies of one workload, interleaved; ratios to O0."""
    reason = precision_supported(dtype, kit.device)
    if reason:
        return {"skipped": True, "reason": reason}
    workloads, variants, scalers, props = {}, {}, {}, {}
    for level in OPT_LEVELS:
        workloads[level], variants[level], scalers[level], props[level] = _initialized(
            kit, name, size, seed, level, dtype)
    failures = _first_steps(variants, kit, progress)
    times = interleaved(variants, kit, warmup=max(sched["warmup"] - 1, 0),
                        rounds=sched["rounds"], steps=sched["steps"], progress=progress)
    records: dict[str, Any] = dict(failures)
    for level in variants:
        w = workloads[level]
        rec = {
            "properties": props[level],
            "step_time_s": spread(times[level]["per_round"]),
            "per_round_step_time_s": times[level]["per_round"],
            "step_time_vs_O0": (spread(round_ratios(times, level, "O0"))
                                if "O0" in times else None),
            "bytes": _state_bytes(kit, w),
            "final_loss": times[level]["losses"][-1],
            "scaler": scalers[level].stats(),
        }
        records[level] = rec
    ran = list(variants)
    variants.clear()  # the steps hold their GradManagers, and those the weights
    for w in workloads.values():
        kit.release(w)
    if measure_memory:  # one workload alive at a time, so each peak is its own
        for level in ran:
            w, step, _, _ = _initialized(kit, name, size, seed, level, dtype)
            kit.reset_peak_memory()
            for _ in range(MEMORY_STEPS):
                kit.read(step())
            progress.update(MEMORY_STEPS)
            records[level]["peak_memory_bytes"], source = kit.peak_memory()
            records[level]["peak_memory_source"] = source
            del step
            kit.release(w)
    base = records.get("O0", {})
    for level, rec in records.items():
        if rec.get("skipped"):
            continue
        rec["bytes_vs_O0"] = (rec["bytes"]["total"] / base["bytes"]["total"]
                              if base.get("bytes") else None)
        mem, base_mem = rec.get("peak_memory_bytes"), base.get("peak_memory_bytes")
        rec["peak_memory_vs_O0"] = mem / base_mem if mem and base_mem else None
    return {"low_dtype": dtype, "rounds": sched["rounds"], "steps_per_round": sched["steps"],
            "optimizer": "SGD, momentum 0.9",
            "step": "amp.initialize(model, optimizer, opt_level=...); per step:"
                    " amp.scale_loss(loss, optimizer) + gm.backward(scaled_loss);"
                    " optimizer.step(); gm.zero_grad()",
            "levels": {lvl: records[lvl] for lvl in OPT_LEVELS if lvl in records}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()
    backend = amp.get_backend().name
    kit = importlib.import_module(f".{backend}_kit", __package__).Kit(args.device)
    threads_note = kit.threads(args.threads)
    mode = "quick" if args.quick else "full"
    sizes = lookup(SIZES, backend, kit.device, mode)
    sched = dict(lookup(SCHEDULE, backend, kit.device, mode))
    sched.update({k: getattr(args, k) for k in sched if getattr(args, k) is not None})
    notes = [threads_note] if threads_note else []
    tf32_passes: list[bool | None] = {"off": [False], "on": [True], "both": [False, True]}[
        args.tf32]
    tf32_note = kit.tf32(tf32_passes[0])
    if tf32_note:
        notes.append(tf32_note)
        tf32_passes = [None]
    memory, memory_source = kit.peak_memory()
    measure_memory = memory is not None
    if not measure_memory:
        notes.append(f"peak memory is null: {memory_source}.")
    odtype = _overhead_dtype(backend, kit.device)
    machine = report.machine_info(kit)
    load_before = report.loadavg()

    supported = 1 + sum(precision_supported(d, kit.device) is None for d in PRECISIONS[1:])
    per_pass = supported * (sched["warmup"] + sched["rounds"] * sched["steps"]
                            + (MEMORY_STEPS if measure_memory else 0))
    per_overhead = 7 * (sched["warmup"] + sched["overhead_rounds"] * sched["overhead_steps"])
    per_levels = len(OPT_LEVELS) * (sched["warmup"] + sched["rounds"] * sched["steps"]
                                    + (MEMORY_STEPS if measure_memory else 0))
    sections = args.sections
    per_workload = (len(tf32_passes) * per_pass * ("throughput" in sections)
                    + per_overhead * ("overhead" in sections)
                    + per_levels * ("opt-levels" in sections))
    progress = _progress(len(args.workloads) * per_workload)

    workloads = {}
    for name in args.workloads:
        w = kit.build(name, sizes[name], args.seed)
        gm = amp.GradManager(w.params)
        passes = []
        if "throughput" in sections:
            for tf32 in tf32_passes:
                kit.tf32(tf32)
                passes.append(throughput(kit, w, gm, tf32, sched, measure_memory, progress))
        # The overhead runs under the first TF32 setting; it compares low-precision steps.
        kit.tf32(tf32_passes[0])
        workloads[name] = {"size": w.size, "batch": w.batch, "throughput": passes,
                           "overhead": (overhead(kit, w, gm, odtype, sched, progress)
                                        if "overhead" in sections else None),
                           "overhead_tf32": tf32_passes[0]}
        del gm
        kit.release(w)
        if "opt-levels" in sections:
            workloads[name]["opt_levels"] = opt_levels(
                kit, name, sizes[name], args.seed, odtype, sched, measure_memory, progress)
    progress.close()

    result = {
        "schema": 1,
        "config": {
            "backend": backend,
            "device": kit.device,
            "mode": mode,
            "tf32": args.tf32,
            "seed": args.seed,
            "schedule": sched,
            "workloads": args.workloads,
            "sections": sections,
            "overhead_dtype": odtype,
            "overhead_target": TARGET,
            "threads": args.threads,
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_"))},
            "command": report.command_line(argv),
            "argv": argv,
            # relative to the checkout: where in it the command ran, not whose machine
            "cwd": os.path.relpath(Path.cwd(), Path(__file__).resolve().parents[1]),
        },
        "machine": machine,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": load_before,
        "loadavg_after": report.loadavg(),
        "runtime_s": time.perf_counter() - started,
        "workloads": workloads,
        "notes": notes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{backend}-{kit.device}" + ("-quick" if args.quick else "")
    if list(sections) != list(SECTIONS):
        stem += "-" + "-".join(sections)
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    report.write_json(result, json_path)
    report.plot(result, png_path)
    print(report.table(result))
    print(f"\nwrote {json_path}\nwrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
