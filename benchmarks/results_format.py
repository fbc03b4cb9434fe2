"""The one result format every named benchmark writes, and how a section's own figures
become its rows.

A result file (``benchmarks/results/<benchmark>-<section>-<backend>-<device>[-quick].json``)::

    {"format": FORMAT, "benchmark": "overhead", "section": "step", "backend": "torch",
     "device": "cpu", "versions": {"python": ..., "unified_amp": ..., "torch": ...},
     "command": "python -m benchmarks overhead --sections step", "date": "...Z",
     "quick": false, "machine": {"cpus": 2, "cpu": "...", "load_average": [...], ...},
     "rows": [{"name": "mlp / ratios / both, the defaults", "median": 1.05, "q1": ...,
               "q3": ..., "n": 61}, {"name": "... / samples_per_s", "value": 812.0}, ...],
     "raw": {...}}

``rows`` holds every summary figure of the section: each statistic (a dict with a
``median``) and each named scalar (samples/s, bytes, accuracy), by its path in ``raw``,
the section's own detailed JSON (per-round times and all), which is kept as it was.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Iterator

FORMAT = "unified_amp-benchmark/1"
# Scalars worth a row of their own (everything else that is a figure is a statistic).
SCALARS = ("samples_per_s", "peak_memory_bytes", "peak_memory_vs_fp32", "bytes_vs_O0",
           "accuracy", "final_loss", "weights_identical_to_native", "torch_calls_per_forward",
           "unified_amp_calls_per_forward", "native_bytecodes", "unified_bytecodes")
FRAMEWORKS = {"torch": "torch", "megengine": "MegEngine"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def versions(backend: str) -> dict[str, str]:
    """Python's, unified_amp's and the backend framework's versions."""
    out = {"python": platform.python_version()}
    for key, dist in (("unified_amp", "unified_amp"), (backend, FRAMEWORKS.get(backend, backend))):
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = "not installed"
    return out


def machine(device_name: str | None = None) -> dict[str, Any]:
    """The CPU (model, count, the flags that decide low-precision speed), the device's
    name where it is not the CPU, and the load average: a shared machine is noisy."""
    out: dict[str, Any] = {"cpus": os.cpu_count(), "cpu": platform.processor() or "unknown"}
    try:
        with open("/proc/cpuinfo") as f:  # the first processor's entry
            first = f.read().split("\n\n")[0]
        info = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in
                                                      first.splitlines())}
        out["cpu"] = info.get("model name", out["cpu"])
        out["cpu_flags"] = [f for f in CPU_FLAGS if f in info.get("flags", "").split()]
    except OSError:
        pass
    if device_name:
        out["device_name"] = device_name
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    out["load_average"] = [round(x, 2) for x in load]
    return out


def rows(raw: Any, path: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """The summary figures in ``raw``, in its order, each named by its path."""
    if isinstance(raw, dict):
        if "median" in raw and isinstance(raw["median"], (int, float)):
            yield {"name": " / ".join(path), **{k: raw[k] for k in ("median", "q1", "q3", "n")
                                                  if k in raw}}
            return
        for key, value in raw.items():
            if key in SCALARS and isinstance(value, (int, float)) and value is not None:
                yield {"name": " / ".join((*path, str(key))), "value": value}
            else:
                yield from rows(value, (*path, str(key)))
    elif isinstance(raw, list):  # lists of records (per-pass figures); number lists are raw
        for i, value in enumerate(raw):
            if isinstance(value, dict):
                yield from rows(value, (*path, str(i)))


def record(benchmark: str, section: str, backend: str, device: str, command: str,
           quick: bool, raw: dict[str, Any], device_name: str | None = None
           ) -> dict[str, Any]:
    """The result of one section's run, in the one format."""
    return {"format": FORMAT, "benchmark": benchmark, "section": section,
            "backend": backend, "device": device, "versions": versions(backend),
            "command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "quick": quick, "machine": machine(device_name),
            "rows": list(rows(raw)), "raw": raw}


def file_name(result: dict[str, Any]) -> str:
    quick = "-quick" if result["quick"] else ""
    return (f"{result['benchmark']}-{result['section']}-{result['backend']}"
            f"-{result['device']}{quick}.json")


def write(result: dict[str, Any], folder: Path) -> Path:
    """Saves ``result`` under ``folder`` (non-finite numbers as null) and returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(result)
    path.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")
    return path


def load(path: Path) -> dict[str, Any] | None:
    """A result in the one format, or None for any other JSON (older results)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
