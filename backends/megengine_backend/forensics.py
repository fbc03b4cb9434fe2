"""Overflow forensics probes: inf/NaN counts, device-side finite flags, module hooks.

Called only after a fused check found an inf/NaN, or inside a trace_forward block.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

import megengine
import megengine.functional as F

from unified_amp import capabilities

from .basics import is_low

_SPLIT = 4096


class ForensicsProbes(capabilities.ForensicsProbes):
    """What the core's forensics (unified_amp/forensics.py) reads from MegEngine."""

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

    def read_overflow(self, grads: Sequence[Any], losses: Sequence[Any],
                      flags: Sequence[Any]
                      ) -> tuple[list[tuple[int, int]], list[float], list[list[bool]]]:
        parts = []
        for t in grads:
            counts = F.stack([F.isinf(t).astype("int32").sum().reshape(1),
                              F.isnan(t).astype("int32").sum().reshape(1)]).reshape(2)
            # MegEngine has no float64: each count travels as two float32 values that
            # hold it exactly (count // 4096 and count % 4096; float32 is exact to 2**24).
            high = counts // _SPLIT
            parts.append(F.concat([high, counts - high * _SPLIT]).astype("float32"))
        parts += [loss.detach().reshape(1).astype("float32") for loss in losses]
        parts += [f.reshape(-1).astype("float32") for f in flags]
        if not parts:
            return [], [], []
        device = parts[0].device
        values = F.concat([p.to(device) for p in parts]).numpy()  # the one read
        counts_out = []
        for i in range(len(grads)):
            high, low = values[4 * i:4 * i + 2], values[4 * i + 2:4 * i + 4]
            counts_out.append((int(high[0]) * _SPLIT + int(low[0]),
                               int(high[1]) * _SPLIT + int(low[1])))
        at = 4 * len(grads)
        loss_values = [float(v) for v in values[at:at + len(losses)]]
        at += len(losses)
        finite = []
        for f in flags:
            n = math.prod(int(d) for d in f.shape)
            finite.append([bool(v) for v in np.isfinite(values[at:at + n])])
            at += n
        return counts_out, loss_values, finite

    def named_parameters(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_parameters())

    def add_forward_hook(self, module: Any, hook: Any, pre: bool = False) -> Any:
        if pre:
            return module.register_forward_pre_hook(hook)
        return module.register_forward_hook(hook)
