"""Collectives and data-parallel hooks, for cross-rank agreement (the rules are the
core's: unified_amp/distributed.py)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from unified_amp import capabilities

# Whether this build has torch.distributed at all: a fact of the build.
_DISTRIBUTED = dist.is_available()
_DTensor: Any = None


def _dtensor_class() -> type:
    """DTensor, imported on the first distributed check (it pulls in a lot)."""
    global _DTensor
    if _DTensor is None:
        from torch.distributed.tensor import DTensor

        _DTensor = DTensor
    return _DTensor


class Collectives(capabilities.Collectives, capabilities.DataParallelHooks):
    """Process groups, the flag's MAX all-reduce, and what DDP and FSDP expose."""

    def world_group(self) -> Any:
        # Asked at every step in a single process: one call there.
        if not (_DISTRIBUTED and dist.is_initialized()):
            return None
        return dist.group.WORLD if dist.get_world_size() > 1 else None

    def check_group(self, group: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "GradScaler(process_group=...) was given a group, but torch.distributed is"
                " not initialised: call torch.distributed.init_process_group() first."
            )
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"GradScaler process_group must be a torch.distributed ProcessGroup (e.g."
                f" torch.distributed.group.WORLD or one from new_group()); got"
                f" {type(group).__name__} {group!r}."
            )

    def grad_kind(self, param: torch.Tensor) -> str:
        if isinstance(param, _dtensor_class()):
            return "dtensor"  # torch all-reduces found_inf inside its kernel's dispatch
        if getattr(param, "_fsdp_flattened", False):
            return "sharded"  # FSDP1: each rank holds its own shard of the gradient
        return "local"

    def zero_grad_like(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param)  # a DTensor for a DTensor parameter

    def clean_flag(self, params: Sequence[torch.Tensor], group: Any) -> torch.Tensor:
        device = params[0].device if params else self._group_device(group)
        return torch.zeros((), dtype=torch.float32, device=device)

    @staticmethod
    def _group_device(group: Any) -> torch.device:
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_max_async(self, flag: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
        if flag.device.type == "cpu" and dist.get_backend(group) == "nccl":
            flag = flag.to(self._group_device(group), non_blocking=True)  # CPU offload
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        return flag, work

    def grad_sync_paused(self, module: Any) -> bool:
        # DDP.no_sync() sets this to False for the window's duration.
        return getattr(module, "require_backward_grad_sync", True) is False

    def module_clip_grad_norm(self, module: Any, max_norm: float,
                              norm_type: float) -> float | None:
        clip = getattr(module, "clip_grad_norm_", None)  # FSDP1's: the global norm
        if clip is None:
            return None
        return float(clip(max_norm, norm_type))
