"""What AMP gives over fp32: ``python -m benchmarks throughput``.

- ``precisions``: the unified_amp step (``workloads.unified_step``) of the conv net and
  the transformer block in float32 (autocast and scaler off), float16 and bfloat16,
  interleaved: samples/s, the speed-up over fp32 (per round), peak memory where the
  framework reports one. A precision the backend cannot compute is skipped with the
  library's reason; ``--tf32 both`` repeats it with TF32 off and on (torch on CUDA).
- ``opt-levels``: apex's O0-O3 (``amp.initialize`` + ``amp.scale_loss``), each level on
  its own copy of the model, interleaved: step time and the bytes of weights, float32
  master weights and optimizer state, as ratios to O0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import unified_amp as amp

from .timing import interleave, ratios, spread
from .workloads import SIZES, apex_step, lookup, precision_supported, unified_step

PRECISIONS = (None, "float16", "bfloat16")  # None: the float32 baseline
OPT_LEVELS = ("O0", "O1", "O2", "O3")
MEMORY_STEPS = 2
FULL, QUICK = dict(warmup=3, rounds=7, steps=3), dict(warmup=1, rounds=2, steps=2)
CUDA = dict(warmup=10, rounds=10, steps=10)


def low_dtype(backend: str, device: str) -> str:
    """What each framework computes fastest in low precision on the device."""
    return "bfloat16" if backend == "torch" and device == "cpu" else "float16"


def _first_steps(blocks: dict[str, Any]) -> dict[str, Any]:
    """Runs each variant once; drops (and returns) those that fail, with the reason."""
    failures = {}
    for name in list(blocks):
        try:
            blocks[name](1)
        except Exception as exc:  # a kernel the device lacks: record it, keep going
            failures[name] = {"skipped": True,
                              "reason": f"failed: {type(exc).__name__}: {exc}"}
            del blocks[name]
    return failures


def _peak(kit: Any, step: Callable[[], Any]) -> int | None:
    kit.reset_peak_memory()
    for _ in range(MEMORY_STEPS):
        kit.read(step())
    return kit.peak_memory()[0]


def _one_pass(kit: Any, w: Any, gm: Any, tf32: bool | None, sched: dict[str, int],
              memory: bool) -> dict[str, Any]:
    blocks, scalers, records = {}, {}, {}
    for dtype in PRECISIONS:
        key = dtype or "float32"
        reason = precision_supported(dtype, kit.device) if dtype else None
        if reason:
            records[key] = {"skipped": True, "reason": reason}
            continue
        step, scalers[key] = unified_step(w, gm, dtype, kit.device)
        blocks[key] = kit.block(step)
    records.update(_first_steps(blocks))
    times = interleave(blocks, **sched)
    for key, block in blocks.items():
        s = spread(times[key])
        records[key] = {
            "dtype": key, "step_time_s": s, "per_round_step_time_s": times[key],
            "samples_per_s": w.batch / s["median"],
            "speedup_vs_fp32": (ratios(times["float32"], times[key])
                                if "float32" in times else None),
            "final_loss": block.last, "scaler": scalers[key].stats(),
            "peak_memory_bytes": _peak(kit, block.step) if memory else None}
    base = records.get("float32", {}).get("peak_memory_bytes")
    for rec in records.values():
        if not rec.get("skipped"):
            mem = rec["peak_memory_bytes"]
            rec["peak_memory_vs_fp32"] = mem / base if mem and base else None
    return {"tf32": tf32, "variants": {k: records[k] for k in ("float32", "float16",
                                                               "bfloat16") if k in records}}


def precisions(run: Any) -> dict[str, Any]:
    kit = run.kit
    sched = run.schedule(FULL, QUICK, CUDA)
    sizes = lookup(SIZES, run.backend, kit.device, run.mode)
    passes: list[bool | None] = [None]
    notes = []
    if run.backend == "torch" and kit.device == "cuda":
        passes = {"off": [False], "on": [True], "both": [False, True]}[run.opts.tf32 or "off"]
    elif run.opts.tf32:
        notes.append("--tf32 sets torch's CUDA matmul and cuDNN flags: it does not apply"
                     f" to {run.backend} on {kit.device}.")
    memory, source = kit.peak_memory()
    if memory is None:
        notes.append(f"peak memory is null: {source}.")
    out = {}
    for name in run.workloads():
        w = kit.build(name, sizes[name], run.opts.seed or 0)
        gm = amp.GradManager(w.params)
        results = []
        for tf32 in passes:
            if tf32 is not None:
                kit.tf32(tf32)
            results.append(_one_pass(kit, w, gm, tf32, sched, memory is not None))
        out[name] = {"size": w.size, "batch": w.batch, "throughput": results}
        del gm
        kit.release(w)
    return {"schedule": sched, "workloads": out, "notes": notes}


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


def _levels(kit: Any, name: str, size: dict[str, int], seed: int, dtype: str,
            sched: dict[str, int], memory: bool) -> dict[str, Any]:
    built = {level: _initialized(kit, name, size, seed, level, dtype) for level in OPT_LEVELS}
    blocks = {level: kit.block(b[1]) for level, b in built.items()}
    records: dict[str, Any] = _first_steps(blocks)
    times = interleave(blocks, **sched)
    for level in blocks:
        w, _, scaler, props = built[level]
        records[level] = {
            "properties": props, "step_time_s": spread(times[level]),
            "per_round_step_time_s": times[level],
            "step_time_vs_O0": ratios(times[level], times["O0"]) if "O0" in times else None,
            "bytes": _state_bytes(kit, w), "final_loss": blocks[level].last,
            "scaler": scaler.stats()}
    ran = list(blocks)
    blocks.clear()  # the steps hold their GradManagers, and those the weights
    for w, *_ in built.values():
        kit.release(w)
    built.clear()
    if memory:  # one workload alive at a time, so each peak is its own
        for level in ran:
            w, step, _, _ = _initialized(kit, name, size, seed, level, dtype)
            records[level]["peak_memory_bytes"] = _peak(kit, step)
            del step
            kit.release(w)
    base = records.get("O0", {})
    for rec in records.values():
        if not rec.get("skipped") and base.get("bytes"):
            rec["bytes_vs_O0"] = rec["bytes"]["total"] / base["bytes"]["total"]
            mem, base_mem = rec.get("peak_memory_bytes"), base.get("peak_memory_bytes")
            rec["peak_memory_vs_O0"] = mem / base_mem if mem and base_mem else None
    return {"levels": {lvl: records[lvl] for lvl in OPT_LEVELS if lvl in records}}


def opt_levels(run: Any) -> dict[str, Any]:
    kit = run.kit
    sched = run.schedule(FULL, QUICK, CUDA)
    sizes = lookup(SIZES, run.backend, kit.device, run.mode)
    dtype = low_dtype(run.backend, kit.device)
    reason = precision_supported(dtype, kit.device)
    if reason:
        return {"skipped": True, "reason": reason}
    memory = kit.peak_memory()[0] is not None
    return {"low_dtype": dtype, "schedule": sched, "optimizer": "SGD, momentum 0.9",
            "step": "amp.initialize(model, optimizer, opt_level=...); per step:"
                    " amp.scale_loss(loss, optimizer) + gm.backward(scaled_loss);"
                    " optimizer.step(); gm.zero_grad()",
            "workloads": {name: {"opt_levels": _levels(kit, name, sizes[name],
                                                       run.opts.seed or 0, dtype, sched,
                                                       memory)}
                          for name in run.workloads()}}
