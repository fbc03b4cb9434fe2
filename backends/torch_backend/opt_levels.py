"""Opt-level casting (amp.initialize): module casts, master weights, gradient copies.

The policy (which level casts what, when masters are stepped) is the core's
(unified_amp/apex/opt_levels.py); these are its primitives on torch's kernels.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from unified_amp import capabilities

from .basics import ALL_DTYPES, default_dtype

_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm  # BatchNorm1d/2d/3d, SyncBatchNorm


class OptLevelCasting(capabilities.OptLevelCasting):
    """Casting modules and tensors, master copies, and moving gradients between them."""

    def default_low_dtype(self, device: str) -> str:
        return default_dtype(device)

    def cast_module(self, module: torch.nn.Module, dtype: str,
                    keep_batchnorm_fp32: bool, skip: Sequence[Any] = ()) -> None:
        target = ALL_DTYPES[dtype]
        left = {id(m) for s in skip for m in s.modules()}  # amp.keep_float32's modules
        with torch.no_grad():
            for sub in module.modules():
                if id(sub) in left or (keep_batchnorm_fp32 and isinstance(sub, _BATCH_NORM)):
                    continue
                # Through .data, as Module.to() does: each Parameter object stays the
                # same, so the optimizers that hold it need no change.
                for p in sub.parameters(recurse=False):
                    if p.is_floating_point():
                        p.data = p.data.to(target)
                for name, buf in sub.named_buffers(recurse=False):
                    if buf is not None and buf.is_floating_point():
                        setattr(sub, name, buf.to(target))

    def low_precision_batch_norm(self, dtype: str) -> bool:
        return True

    def steps_low_precision(self, optimizer: Any) -> bool:
        return True

    def master_copy(self, param: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(param.detach().to(torch.float32, copy=True))

    def optimizer_state(self, optimizer: Any) -> Any:
        return optimizer.state

    def take_grads(self, params: Sequence[torch.Tensor]) -> list[Any]:
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    def restore_grads(self, params: Sequence[torch.Tensor], grads: Sequence[Any]) -> None:
        into, add = [], []
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                into.append(p.grad)
                add.append(g)
        if into:
            with torch.no_grad():
                torch._foreach_add_(into, add)

    def grads_to_masters(self, params: Sequence[torch.Tensor],
                         masters: Sequence[torch.Tensor]) -> None:
        pairs = [(p, m) for p, m in zip(params, masters) if p.grad is not None]
        if not pairs:
            return
        bufs = [torch.empty_like(m) for _, m in pairs]
        grads = [g for p, _ in pairs if (g := p.grad) is not None]  # all, as above
        with torch.no_grad():
            torch._foreach_copy_(bufs, grads)  # cast, fused
        for (p, m), buf in zip(pairs, bufs):
            m.grad = buf
            p.grad = None

    def copy_params(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(list(dst), list(src))

    def skipped_step_result(self, optimizer: Any) -> None:
        return None
