"""Loss scaling: scaling outputs and cotangents, and MegEngine's fused
check-and-unscale (``_check_non_finite``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

import megengine.functional as F
from megengine.core._imperative_rt.core2 import Tensor as RawTensor
from megengine.core._imperative_rt.core2 import get_device
from megengine.functional.math import _check_non_finite

from unified_amp import interface

from .basics import dtype_name


# The C++ getters behind Tensor.dtype / Tensor.device, without the Python property's
# frame: a step reads them for every gradient.
_dtype_of = RawTensor.dtype.__get__
_FLOAT32 = np.dtype("float32")


def require_float32(grads: Sequence[Any]) -> None:
    """Raises ValueError, before anything runs, for a gradient MegEngine's fused
    ``_check_non_finite`` cannot take: it checks and unscales float32 gradients only
    (anything else fails later, on its worker thread)."""
    if all(d is _FLOAT32 or d == _FLOAT32 for d in set(map(_dtype_of, grads))):
        return
    for g in grads:
        if g.dtype != np.float32:
            raise ValueError(
                f"MegEngine's fused _check_non_finite checks float32 gradients only; got a"
                f" {dtype_name(g.dtype)} gradient of shape {tuple(g.shape)}. Keep"
                f" parameters in float32 and let autocast cast the compute."
            )


def by_device(grads: Sequence[Any]) -> list[list[Any]]:
    """``grads`` grouped by device, in first-seen order (one kernel call per device)."""
    try:
        get_device(*grads)  # one C++ pass; raises where the devices differ
        return [list(grads)]
    except ValueError:
        pass
    groups: dict[Any, list[Any]] = defaultdict(list)  # CompNode -> gradients
    for g in grads:
        groups[g.device].append(g)
    return list(groups.values())


class LossScaling(interface.LossScaling):
    """Multiplying by the scale as megengine.amp does, and the fused check."""


    def scale(self, y: Any, scale: float) -> Any:
        return y * scale

    def scaled_cotangents(self, ys: Sequence[Any], dys: Sequence[Any] | None,
                          scale: float) -> list[Any]:
        # Exactly megengine.amp.GradScaler.backward's, so the bits match it.
        if dys is None:
            return [F.full_like(y, scale) for y in ys]
        return [dy * scale for dy in dys]

    def unscale_and_check(self, grads: Sequence[Any], inv_scale: float,
                          allow_float16: bool = False) -> Any:
        # The kernel takes float32 only, whatever allow_float16 says: anything else is
        # refused here (ValueError, before any kernel runs), not on its worker thread.
        dtypes = set(map(_dtype_of, grads))
        if len(dtypes) != 1 or _FLOAT32 not in dtypes:
            require_float32(grads)
        # One fused kernel per device; it unscales in place and returns an int32 flag.
        try:
            get_device(*grads)  # one C++ pass; raises where the devices differ
        except ValueError:
            return [_check_non_finite(same, inv_scale) for same in by_device(grads)]
        return [_check_non_finite(list(grads), inv_scale)]

    def flag_is_set(self, flag: Any) -> bool:
        for f in flag:  # one per device, usually one
            # numpy(), not item(): item() computes the size through numpy first.
            if f.numpy():
                return True
        return False
