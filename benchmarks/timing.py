"""Interleaved timing: every variant runs in every round, so the load of a shared machine
hits all of them alike, and a ratio is taken within a round."""

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


def ratios(num: list[float], den: list[float]) -> dict[str, Any]:
    """The per-round ratios of two variants timed in the same rounds, summarised."""
    per_round = [a / b for a, b in zip(num, den)]
    return dict(spread(per_round), per_round=per_round)


class Block:
    """Runs ``k`` steps of one variant between two syncs and returns seconds per step.

    Args:
        step: one training step; returns the loss (read after every step, which surfaces
            a framework's asynchronous kernel errors) or, with ``read=None``, anything.
        sync: waits for the device (None: nothing to wait for).
        read: a loss as a float (None: the step's value is kept as it is).
        clock: what a block is timed by; on a CPU ``time.process_time`` (the process's
            own work, all its threads: robust to other processes on a shared machine),
            on a GPU wall time.
    """

    def __init__(self, step: Callable[[], Any], *, sync: Callable[[], None] | None = None,
                 read: Callable[[Any], Any] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.step, self.sync, self.read, self.clock = step, sync, read, clock
        self.last: Any = None

    def __call__(self, k: int) -> float:
        if self.sync:
            self.sync()
        t0 = self.clock()
        for _ in range(k):
            value = self.step()
            self.last = self.read(value) if self.read else value
        if self.sync:
            self.sync()
        return (self.clock() - t0) / k if k else 0.0


def interleave(blocks: dict[str, Callable[[int], float]], *, rounds: int, steps: int,
               warmup: int) -> dict[str, list[float]]:
    """Each variant's seconds per step in each round.

    ``blocks[name](k)`` runs ``k`` steps and returns their seconds per step (a ``Block``,
    or a loop that times only its own part). After ``warmup`` steps of each, every round
    runs every variant for ``steps`` steps, in an order turned by one each round, so that
    no variant is always first (after the others' memory traffic) or last.
    """
    names = list(blocks)
    for name in names:
        blocks[name](warmup)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(blocks[name](steps))
    return out


def made_in_turn(names: list[str], make: Callable[[str], Any], turn: int) -> dict[str, Any]:
    """``make(name)`` for each name, made in an order turned by ``turn`` (a model made
    later can run faster or slower for reasons of memory alone), listed in ``names``'
    order."""
    turned = names[turn % len(names):] + names[:turn % len(names)]
    made = {name: make(name) for name in turned}
    return {name: made[name] for name in names}
