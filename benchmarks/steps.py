"""The training step written once against unified_amp, for both frameworks."""

from __future__ import annotations

from typing import Any, Callable

import unified_amp as amp

from .common import Workload


def unified_step(w: Workload, gm: amp.GradManager, dtype: str | None,
                 device: str) -> tuple[Callable[[], Any], amp.GradScaler]:
    """One training step of ``w`` in unified_amp's automatic mode.

    ``dtype`` None is the float32 baseline: the same code with autocast and the scaler
    disabled, so fp32 and AMP differ only in those two switches.

    Returns:
        (step, scaler): ``step()`` trains once and returns the loss tensor.
    """
    enabled = dtype is not None
    scaler = amp.GradScaler(enabled=enabled)
    opt = w.optimizer

    def step() -> Any:
        with gm:
            with amp.autocast(enabled=enabled, dtype=dtype, device=device):
                loss = w.loss()
            scaler.backward(gm, loss)  # scaled backward, unscale + inf check, update
        opt.step()  # after an overflow the scaler dropped the grads: nothing moves
        gm.zero_grad()
        return loss

    return step, scaler


def forensics_step(w: Workload, gm: amp.GradManager, dtype: str, device: str, *,
                   trace: bool) -> Callable[[], Any]:
    """The unified step with overflow forensics on: a scaler that watches the model.

    ``trace=True`` traces each step's forward pass (``amp.trace_forward``), installing
    and removing the hooks inside the step, so the figure includes that too (an upper
    bound for a trace held across steps). ``trace=False`` starts and stops a trace once
    beforehand: what tracing leaves behind when off -- no hook -- costs nothing.
    """
    step, scaler = unified_step(w, gm, dtype, device)
    scaler.watch(w.model)
    tracer = amp.trace_forward(w.model)
    if not trace:
        tracer.start().stop()
        return step

    def traced_step() -> Any:
        with tracer:
            return step()

    return traced_step


def apex_step(w: Workload, gm: amp.GradManager) -> Callable[[], Any]:
    """One apex-style step of ``w`` after ``amp.initialize``: forward, loss,
    ``scale_loss`` + ``gm.backward``, the optimizer's step (skipped on overflow)."""
    opt = w.optimizer

    def step() -> Any:
        with gm:
            loss = w.loss()
            with amp.scale_loss(loss, opt) as scaled_loss:
                gm.backward(scaled_loss)
        opt.step()
        gm.zero_grad()
        return loss

    return step


def precision_supported(dtype: str, device: str) -> str | None:
    """None if the backend computes ``dtype`` on ``device``, else the library's reason."""
    try:
        with amp.autocast(dtype=dtype, device=device):
            pass
    except amp.UnsupportedPrecisionError as exc:
        return str(exc)
    return None
