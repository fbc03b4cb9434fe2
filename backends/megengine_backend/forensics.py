"""Overflow forensics probes: inf/NaN counts, device-side finite flags, module hooks.

Called only after a fused check found an inf/NaN, or inside a trace_forward block.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

import megengine
import megengine.functional as F

from .basics import is_low


class ForensicsProbes:
    """What the core's forensics (unified_amp/forensics.py) reads from MegEngine."""

    def nonfinite_counts(self, tensors: Sequence[Any]) -> list[tuple[int, int]]:
        if not tensors:
            return []
        counts = [F.stack([F.isinf(t).astype("int32").sum().reshape(1),
                           F.isnan(t).astype("int32").sum().reshape(1)]).reshape(2)
                  for t in tensors]
        rows = F.stack(counts).numpy()  # the one read
        return [(int(n_inf), int(n_nan)) for n_inf, n_nan in rows.reshape(-1, 2)]

    def finite_flag(self, tensor: Any, per_row: bool = False) -> Any:
        t = tensor.detach()
        rows = int(t.shape[0]) if per_row else 1
        if math.prod(int(d) for d in t.shape) == 0:  # MegEngine cannot reduce these
            return megengine.tensor(np.zeros(rows, np.float32), device=t.device)
        if is_low(t.dtype):
            # MegEngine's float16 kernels are several times slower than float32 ones
            # on CPU; the cast keeps inf and NaN as they are.
            t = t.astype("float32")
        # 0 * x is 0 for every finite x and NaN for inf and NaN: the sum is NaN exactly
        # when some element is not finite (a plain sum could overflow by itself).
        zeros = t * 0
        return zeros.reshape(rows, -1).sum(axis=1) if per_row else zeros.sum()

    def read_finite_flags(self, flags: Sequence[Any]) -> list[list[bool]]:
        if not flags:
            return []
        values = F.concat([f.reshape(-1) for f in flags]).numpy()  # the one read
        out, start = [], 0
        for f in flags:
            n = math.prod(int(d) for d in f.shape)
            out.append([bool(v) for v in np.isfinite(values[start:start + n])])
            start += n
        return out

    def named_modules(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def named_parameters(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_parameters())

    def add_forward_hook(self, module: Any, hook: Any, pre: bool = False) -> Any:
        if pre:
            return module.register_forward_pre_hook(hook)
        return module.register_forward_hook(hook)
