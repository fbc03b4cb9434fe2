"""The framework's own AMP step, for running beside unified_amp's in the CIFAR experiment.

torch: ``torch.autocast`` + ``torch.amp.GradScaler`` in torch.amp's call forms
(``scale(loss).backward()``, ``step``, ``update``). MegEngine: ``megengine.amp.autocast`` +
``megengine.amp.GradScaler`` with MegEngine's own ``GradManager`` (``scaler.backward(gm,
loss)``), at unified_amp's initial scale (2**16; megengine.amp's default is 2**4) so the
two loops start alike. Neither imports unified_amp: this is the loop a user has before
the swap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class NativeAMP:
    """One model's native AMP step, the block evaluation runs in, and the scaler's figures."""

    step: Callable[[Any, Any], float]
    precision: Any
    stats: Callable[[], dict[str, Any]]
    label: str


def default_dtype(fw: Any) -> str:
    """The dtype unified_amp's ``autocast(dtype=None)`` picks on this device (SPEC: float16
    on CUDA and on MegEngine's CPU, bfloat16 on torch's CPU)."""
    return "float16" if fw.has_cuda() or fw.name == "megengine" else "bfloat16"


def native_amp(fw: Any, model: Any, optimizer: Any, loss_fn: Callable[[Any, Any], Any],
               dtype: str | None) -> NativeAMP:
    """The native AMP step for ``model`` (``dtype`` None: the device's, as unified_amp's)."""
    dtype = dtype or default_dtype(fw)
    counts = {"steps": 0, "skipped_steps": 0}
    if fw.name == "torch":
        torch = fw.torch
        device = "cuda" if fw.has_cuda() else "cpu"
        scaler = torch.amp.GradScaler(device)
        precision = torch.autocast(device, dtype=getattr(torch, dtype))

        def step(images: Any, labels: Any) -> float:
            with precision:
                loss = loss_fn(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            before = scaler.get_scale()
            scaler.update()
            _count(counts, before, scaler.get_scale())
            optimizer.zero_grad()
            return loss.item()

        scale, label = scaler.get_scale, f"torch.amp, {dtype}"
    else:
        import megengine.amp as mge_amp
        from megengine.autodiff import GradManager

        gm = GradManager().attach(model.parameters())
        scaler = mge_amp.GradScaler(init_scale=2.0**16)
        precision = mge_amp.autocast(enabled=True, low_prec_dtype=dtype)

        def step(images: Any, labels: Any) -> float:
            before = scaler.scale_factor
            with gm:
                with precision:
                    loss = loss_fn(model(images), labels)
                scaler.backward(gm, loss)  # unscale, drop inf/NaN gradients, update
            _count(counts, before, scaler.scale_factor)
            optimizer.step()
            optimizer.clear_grad()
            return loss.item()

        def scale() -> float:
            return float(scaler.scale_factor)

        label = f"megengine.amp, {dtype}"
    return NativeAMP(step=step, precision=precision, label=label,
                     stats=lambda: {"enabled": True, "scale": float(scale()), **counts})


def _count(counts: dict[str, int], before: float, after: float) -> None:
    # Neither native scaler reports skipped steps; a scale that went down was a skip.
    counts["steps"] += 1
    counts["skipped_steps"] += after < before
