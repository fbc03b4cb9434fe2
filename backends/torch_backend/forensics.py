"""Overflow forensics probes: inf/NaN counts, device-side finite flags, module hooks.

Called only after a fused check found an inf/NaN, or inside a trace_forward block.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from unified_amp import capabilities


class ForensicsProbes(capabilities.ForensicsProbes):
    """What the core's forensics (unified_amp/forensics.py) reads from torch."""

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

    def read_overflow(self, grads: Sequence[torch.Tensor], losses: Sequence[torch.Tensor],
                      flags: Sequence[Any]
                      ) -> tuple[list[tuple[int, int]], list[float], list[list[bool]]]:
        parts = []
        with torch.no_grad():
            for t in grads:
                t = t._values() if t.is_sparse else t
                # A DTensor's own counts would be a collective: count this rank's shard.
                t = t.to_local() if hasattr(t, "to_local") else t
                parts.append(torch.stack([torch.isinf(t).sum(), torch.isnan(t).sum()]))
            for loss in losses:
                loss = loss.to_local() if hasattr(loss, "to_local") else loss  # this rank's
                parts.append(loss.detach().reshape(1))
            parts += [v.reshape(-1) for flag in flags for v in flag]  # (min, max) pairs
            if not parts:
                return [], [], []
            # float64 holds every count exactly and keeps inf/NaN; one copy to the host
            # (tolist() of a device tensor would read element by element elsewhere).
            target = parts[0].device
            values = torch.cat([p.to(target, torch.float64) for p in parts]).cpu().tolist()
        counts = [(int(values[i]), int(values[i + 1])) for i in range(0, 2 * len(grads), 2)]
        at = 2 * len(grads)
        loss_values, at = values[at:at + len(losses)], at + len(losses)
        finite = []
        for flag in flags:
            n = flag[0].numel()
            lows, highs = values[at:at + n], values[at + n:at + 2 * n]
            finite.append([math.isfinite(lo) and math.isfinite(hi)
                           for lo, hi in zip(lows, highs)])
            at += 2 * n
        return counts, loss_values, finite

    def named_parameters(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        return list(model.named_parameters())

    def add_forward_hook(self, module: torch.nn.Module, hook: Any, pre: bool = False) -> Any:
        if pre:
            return module.register_forward_pre_hook(hook)
        return module.register_forward_hook(hook)
