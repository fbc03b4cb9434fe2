"""Overflow forensics probes: inf/NaN counts, device-side finite flags, module hooks.

Called only after a fused check found an inf/NaN, or inside a trace_forward block.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


class ForensicsProbes:
    """What the core's forensics (unified_amp/forensics.py) reads from torch."""

    def nonfinite_counts(self, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        if not tensors:
            return []
        with torch.no_grad():
            counts = []
            for t in tensors:
                t = t._values() if t.is_sparse else t
                # A DTensor's own counts would be a collective: count this rank's shard.
                t = t.to_local() if hasattr(t, "to_local") else t
                counts.append(torch.stack([torch.isinf(t).sum(), torch.isnan(t).sum()]))
            target = counts[0].device
            rows = torch.stack([c.to(target) for c in counts]).tolist()  # the one read
        return [(int(n_inf), int(n_nan)) for n_inf, n_nan in rows]

    def finite_flag(self, tensor: torch.Tensor, per_row: bool = False) -> Any:
        # min and max propagate NaN and hold any +-inf: one reduction kernel, about ten
        # times cheaper than isfinite().all() (a composite of four kernels) on CPU.
        t = tensor.detach()
        if t.numel() == 0:
            zeros = torch.zeros(t.shape[0] if per_row else (), device=t.device)
            return zeros, zeros
        if not per_row:
            return torch.aminmax(t)
        return torch.aminmax(t.flatten(1) if t.dim() > 1 else t.unsqueeze(1), dim=1)

    def read_finite_flags(self, flags: Sequence[Any]) -> list[list[bool]]:
        if not flags:
            return []
        target = flags[0][0].device
        parts = [v.reshape(-1).float().to(target) for flag in flags for v in flag]
        values = torch.cat(parts).tolist()  # the one read
        out, start = [], 0
        for flag in flags:
            n = flag[0].numel()
            lows, highs = values[start:start + n], values[start + n:start + 2 * n]
            out.append([math.isfinite(lo) and math.isfinite(hi)
                        for lo, hi in zip(lows, highs)])
            start += 2 * n
        return out

    def named_modules(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def named_parameters(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        return list(model.named_parameters())

    def add_forward_hook(self, module: torch.nn.Module, hook: Any, pre: bool = False) -> Any:
        if pre:
            return module.register_forward_pre_hook(hook)
        return module.register_forward_hook(hook)
