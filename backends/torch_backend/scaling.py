"""Loss scaling: scaling outputs and cotangents, and torch's fused check-and-unscale."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch

from unified_amp import interface


def check_and_unscale_per_device(grads: Sequence[torch.Tensor], inv_scale: Any
                                 ) -> dict[torch.device, torch.Tensor]:
    """torch's fused kernel over grads of any devices/dtypes (it takes one of each per
    call); ``inv_scale`` is a float or a float32 0-dim tensor. Returns a found_inf flag
    (float32) per device. No host sync."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list))
    for g in grads:
        if g.is_sparse:
            g = g._values()
        groups[g.device][g.dtype].append(g)
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, by_dtype in groups.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            if isinstance(inv_scale, torch.Tensor):
                inv = inv_scale.to(device, non_blocking=True)
            else:
                # Filled in float64 and cast, so that the reciprocal of a scale that
                # has underflowed (after ~144 overflows in a row) becomes inf, as in
                # torch.amp, instead of failing to convert.
                inv = torch.full((), inv_scale, dtype=torch.float64,
                                 device=device).float()
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv)
            found[device] = found_inf
    return found


def check_and_unscale(grads: Sequence[torch.Tensor], inv_scale: Any,
                      found_on: torch.device | None = None) -> torch.Tensor:
    """The same, as one flag on ``found_on`` (default: the first gradient's device)."""
    found = list(check_and_unscale_per_device(grads, inv_scale).values())
    target = found_on or found[0].device
    total = found[0].to(target, non_blocking=True)
    for f in found[1:]:
        total = total + f.to(target, non_blocking=True)
    return total


def by_device(flags: Sequence[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    per_device: dict[torch.device, torch.Tensor] = {}
    for flag in flags:
        per_device[flag.device] = per_device[flag.device] + flag \
            if flag.device in per_device else flag
    return per_device


class LossScaling(interface.LossScaling):
    """Multiplying by the scale as torch.amp does, and the fused check of the gradients."""

    scale_key_aliases: tuple[str, ...] = ()

    _scale_cache: dict[torch.device, tuple[float, torch.Tensor]]

    def _scale_tensor(self, scale: float, device: torch.device) -> torch.Tensor:
        # A float32 0-dim tensor, as torch.amp keeps its scale: y * tensor gives the same
        # bits as torch.amp.GradScaler.scale(y). Cached until the scale changes.
        cached = self._scale_cache.get(device)
        if cached is None or cached[0] != scale:
            cached = (scale, torch.full((), scale, dtype=torch.float32, device=device))
            self._scale_cache[device] = cached
        return cached[1]

    def scale(self, y: torch.Tensor, scale: float) -> torch.Tensor:
        return y * self._scale_tensor(scale, y.device)

    def scaled_cotangents(self, ys: Sequence[torch.Tensor], dys: Sequence[Any] | None,
                          scale: float) -> list[torch.Tensor]:
        if dys is None:
            return [torch.full_like(y, scale) for y in ys]
        return [dy * self._scale_tensor(scale, dy.device) for dy in dys]

    def unscale_and_check(self, grads: Sequence[torch.Tensor], inv_scale: float) -> Any:
        return check_and_unscale(grads, inv_scale)

    def flag_is_set(self, flag: torch.Tensor) -> bool:
        return bool(flag.item())
