"""Loss scaling: scaling outputs and cotangents, and torch's fused check-and-unscale."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from unified_amp import interface

# device -> (a float, that float as a float32 0-dim tensor on the device)
_Cache = dict[torch.device, tuple[float, torch.Tensor]]
_device_of = operator.attrgetter("device")
_dtype_of = operator.attrgetter("dtype")
_is_sparse = operator.attrgetter("is_sparse")


def check_and_unscale_per_device(grads: Sequence[torch.Tensor], inv_scale: Any,
                                 cache: _Cache | None = None, allow_float16: bool = True
                                 ) -> dict[torch.device, torch.Tensor]:
    """torch's fused kernel over grads of any devices/dtypes (it takes one of each per
    call); ``inv_scale`` is a float or a float32 0-dim tensor. Returns a found_inf flag
    (float32) per device. No host sync. ``cache``: where the float's tensor per device
    is kept between calls (the kernel only reads it). ``allow_float16`` False: a
    float16 gradient raises ValueError before any kernel runs."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    devices, dtypes = set(map(_device_of, grads)), set(map(_dtype_of, grads))
    if len(devices) == 1 and len(dtypes) == 1 and not any(map(_is_sparse, grads)):
        # The usual case, one kernel call: found without a Python step per gradient.
        groups[(devices.pop(), dtypes.pop())] = list(grads)
    for g in grads if not groups else ():
        if g.is_sparse:
            g = g._values()
        key = (g.device, g.dtype)
        same = groups.get(key)
        if same is None:
            groups[key] = [g]
        else:
            same.append(g)
    if not allow_float16 and any(dtype == torch.float16 for _, dtype in groups):
        raise ValueError("Attempting to unscale FP16 gradients.")
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), same in groups.items():
            found_inf = found.get(device)
            if found_inf is None:
                found_inf = found[device] = torch.zeros((), dtype=torch.float32,
                                                        device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                same, found_inf, _inv_tensor(inv_scale, device, cache))
    return found


def _inv_tensor(inv_scale: Any, device: torch.device, cache: _Cache | None
                ) -> torch.Tensor:
    if isinstance(inv_scale, torch.Tensor):
        return inv_scale.to(device, non_blocking=True)
    return _float32_scalar(inv_scale, device, cache)


def _float32_scalar(value: float, device: torch.device, cache: _Cache | None
                    ) -> torch.Tensor:
    """``value`` as a float32 0-dim tensor on ``device``, kept in ``cache`` until the
    value changes. Filled in float64 and cast, so that the reciprocal of a scale that
    has underflowed (after ~144 overflows in a row) becomes inf, as in torch.amp,
    instead of failing to convert; a float32 number casts to itself."""
    cached = None if cache is None else cache.get(device)
    if cached is None or cached[0] != value:
        cached = (value, torch.full((), value, dtype=torch.float64, device=device).float())
        if cache is not None:
            cache[device] = cached
    return cached[1]


def check_and_unscale(grads: Sequence[torch.Tensor], inv_scale: Any,
                      found_on: torch.device | None = None,
                      cache: _Cache | None = None, allow_float16: bool = True
                      ) -> torch.Tensor:
    """The same, as one flag on ``found_on`` (default: the first gradient's device)."""
    found = list(check_and_unscale_per_device(grads, inv_scale, cache,
                                              allow_float16).values())
    if found_on is None and len(found) == 1:
        return found[0]  # the usual case: one device, no copy to make
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


    _scale_cache: _Cache
    _inv_cache: _Cache

    def _scale_tensor(self, scale: float, device: torch.device) -> torch.Tensor:
        # A float32 0-dim tensor, as torch.amp keeps its scale: y * tensor gives the same
        # bits as torch.amp.GradScaler.scale(y). Cached until the scale changes.
        return _float32_scalar(scale, device, self._scale_cache)

    def scale(self, y: torch.Tensor, scale: float) -> torch.Tensor:
        cached = self._scale_cache.get(y.device)  # (once per step: the cache inline)
        if cached is not None and cached[0] == scale:
            return y * cached[1]
        return y * self._scale_tensor(scale, y.device)

    def scaled_cotangents(self, ys: Sequence[torch.Tensor], dys: Sequence[Any] | None,
                          scale: float) -> list[torch.Tensor]:
        if dys is None:
            return [torch.full_like(y, scale) for y in ys]
        return [dy * self._scale_tensor(scale, dy.device) for dy in dys]

    def unscale_and_check(self, grads: Sequence[torch.Tensor], inv_scale: float,
                          allow_float16: bool = False) -> Any:
        # The grouping by dtype reads every dtype already: float16 is refused there.
        return check_and_unscale(grads, inv_scale, cache=self._inv_cache,
                                 allow_float16=allow_float16)

    def flag_is_set(self, flag: torch.Tensor) -> bool:
        return bool(flag.item())
