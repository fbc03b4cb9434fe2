"""Loss scaling: scaling outputs and cotangents, and MegEngine's fused
check-and-unscale (``_check_non_finite``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

import megengine.functional as F
from megengine.functional.math import _check_non_finite

from unified_amp import interface

from .basics import dtype_name


def require_float32(grads: Sequence[Any]) -> None:
    """Raises ValueError for a gradient MegEngine's fused ``_check_non_finite`` cannot
    take: it checks and unscales float32 gradients only."""
    for g in grads:
        if g.dtype != np.float32:
            raise ValueError(
                f"MegEngine's fused _check_non_finite checks float32 gradients only; got a"
                f" {dtype_name(g.dtype)} gradient of shape {tuple(g.shape)}. Keep"
                f" parameters in float32 and let autocast cast the compute."
            )


class LossScaling(interface.LossScaling):
    """Multiplying by the scale as megengine.amp does, and the fused check."""

    scale_key_aliases: tuple[str, ...] = ("scale_factor",)

    def scale(self, y: Any, scale: float) -> Any:
        return y * scale

    def scaled_cotangents(self, ys: Sequence[Any], dys: Sequence[Any] | None,
                          scale: float) -> list[Any]:
        # Exactly megengine.amp.GradScaler.backward's, so the bits match it.
        if dys is None:
            return [F.full_like(y, scale) for y in ys]
        return [dy * scale for dy in dys]

    def unscale_and_check(self, grads: Sequence[Any], inv_scale: float) -> Any:
        require_float32(grads)
        by_device: dict[Any, list[Any]] = defaultdict(list)  # CompNode -> gradients
        for g in grads:
            by_device[g.device].append(g)
        # One fused kernel per device; it unscales in place and returns an int32 flag.
        flags = [_check_non_finite(same, inv_scale) for same in by_device.values()]
        return flags

    def flag_is_set(self, flag: Any) -> bool:
        return any(bool(f.item()) for f in flag)
