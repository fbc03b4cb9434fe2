"""Plant an inf/NaN in a training run and print what unified_amp's overflow forensics say.

The examples call these helpers so that any of them can show a skipped step explained::

    python -m examples.cnn_classifier --plant overflow   # the last layer overflows
    python -m examples.cnn_classifier --plant nan        # a NaN in one input sample

Framework-free: it works on numpy batches and on the scaler's plain-Python reports.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from typing import Any, Callable

import numpy as np

import unified_amp as amp

KINDS = ("overflow", "nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--plant {overflow,nan}`` and ``--plant-step N`` to an example's options."""
    parser.add_argument("--plant", choices=KINDS, default=None,
                        help="plant an inf/NaN in one AMP step and trace the forward pass:"
                             " 'overflow' feeds the last layer inf inputs, so that its"
                             " outputs overflow; 'nan' puts a NaN in one input sample"
                             " (BatchNorm's running statistics take it in too). The"
                             " tracing slows the AMP run's samples/s a little")
    parser.add_argument("--plant-step", type=int, default=None,
                        help="the step to plant it at (default: the middle step)")


class Planter:
    """Plants ``kind`` in step ``step`` of a run; a context manager around the loop.

    Args:
        kind: None (nothing planted), "overflow" (a forward pre-hook on ``layer`` turns
            its inputs to inf in that step, so its outputs overflow; the layers before
            it, BatchNorm among them, see finite values) or "nan" (that step's batch
            gets a NaN in sample 0).
        step: the step, counted from 0.
        layer: a torch or MegEngine module; both call ``hook(module, inputs)`` before
            its forward and use the inputs the hook returns.
    """

    def __init__(self, kind: str | None, step: int, layer: Any) -> None:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"plant kind must be None or one of {KINDS}; got {kind!r}.")
        self.kind, self.step, self.layer = kind, step, layer
        self._now = -1
        self._handle = None

    def __enter__(self) -> "Planter":
        if self.kind == "overflow":
            self._handle = self.layer.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: Any, inputs: tuple) -> Any:
        if self._now != self.step:
            return None
        return (inputs[0] + math.inf,) + tuple(inputs[1:])

    def batch(self, i: int, batch: np.ndarray) -> np.ndarray:
        """Step ``i``'s batch, poisoned if a NaN is planted in this step."""
        self._now = i
        if self.kind != "nan" or i != self.step:
            return batch
        poisoned = np.array(batch, dtype=np.float32, copy=True)
        poisoned[0].flat[0] = np.nan
        return poisoned


def tracing(model: Any, on: bool) -> Any:
    """``amp.trace_forward(model)`` when ``on``, else a context that does nothing."""
    return amp.trace_forward(model) if on else contextlib.nullcontext()


class SkipPrinter:
    """Prints each new overflow report of ``scaler`` as one line, as steps go by."""

    def __init__(self, scaler: amp.GradScaler, write: Callable[[str], None] = print):
        self.scaler, self.write = scaler, write
        self._seen = None

    def after_step(self) -> None:
        report = self.scaler.last_overflow()
        if report is not None and report is not self._seen:
            self._seen = report
            self.write(str(report))


def summary(stats: dict[str, Any]) -> str | None:
    """The newest overflow report line in ``scaler.stats()``, or None if none."""
    overflows = stats.get("overflows") or []
    return overflows[-1]["line"] if overflows else None
