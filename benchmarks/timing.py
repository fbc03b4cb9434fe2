"""Interleaved timing: every variant runs in every round, so machine noise hits all alike."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values``."""
    a = np.asarray(values, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def interleaved(variants: dict[str, Callable[[], Any]], kit: Any = None, *, warmup: int,
                rounds: int, steps: int, progress: Any = None) -> dict[str, dict[str, Any]]:
    """Times each variant for ``steps`` steps per round, over ``rounds`` rounds.

    The order within a round is rotated by one each round, so that no variant always
    runs first (after the others' memory traffic) or last. Each step reads its loss,
    which synchronises the device and surfaces asynchronous kernel errors. Without a
    ``kit`` (host-side work only) steps are neither read nor synchronised.

    Returns:
        name -> {"per_round": seconds per step in each round, "losses": the loss read at
        the end of each round}.
    """
    read = kit.read if kit is not None else (lambda value: value)
    sync = kit.synchronize if kit is not None else (lambda: None)
    tick = progress.update if progress is not None else (lambda n: None)
    names = list(variants)
    out = {n: {"per_round": [], "losses": []} for n in names}
    for name in names:
        for _ in range(warmup):
            read(variants[name]())
        tick(warmup)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            step = variants[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                value = read(step())
            sync()
            out[name]["per_round"].append((time.perf_counter() - t0) / steps)
            out[name]["losses"].append(value)
            tick(steps)
    return out


def round_ratios(times: dict[str, dict[str, Any]], num: str, den: str) -> list[float]:
    """Per-round ratio of two variants' step times (they ran in the same round)."""
    return [a / b for a, b in zip(times[num]["per_round"], times[den]["per_round"])]
