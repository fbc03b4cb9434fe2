"""Collectives, for cross-rank agreement (the rules are the core's:
unified_amp/distributed.py)."""

from __future__ import annotations

from typing import Any, Sequence

import megengine
import megengine.functional as F
from megengine import distributed as dist  # (import megengine loads it already)

from unified_amp import capabilities


class Collectives(capabilities.Collectives):
    """Process groups and the flag's MAX all-reduce.

    MegEngine's collectives run on GPUs with NCCL only (megengine.distributed rejects
    "cpu"). Its data-parallel gradients are identical on every rank after
    make_allreduce_cb, so these serve GradScaler(process_group=...) alone: there are
    no data-parallel hooks (``grad_sync_paused``, ``module_clip_grad_norm``), and every
    gradient is "local".
    """

    def world_group(self) -> Any:
        # Asked at every check: no import statement here.
        if not dist.is_distributed() or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD

    def check_group(self, group: Any) -> None:
        if not dist.is_distributed():
            raise RuntimeError(
                "GradScaler(process_group=...) was given a group, but megengine.distributed"
                " is not initialised (it runs on GPUs with NCCL only): launch the workers"
                " with megengine.distributed.launcher or init_process_group() first."
            )
        if not isinstance(group, dist.group.Group):
            raise TypeError(
                f"GradScaler process_group must be a megengine.distributed Group (e.g."
                f" megengine.distributed.group.WORLD or one from new_group()); got"
                f" {type(group).__name__} {group!r}."
            )

    def grad_kind(self, param: Any) -> str:
        return "local"

    def zero_grad_like(self, param: Any) -> Any:
        return F.zeros_like(param)

    def clean_flag(self, params: Sequence[Any], group: Any) -> Any:
        device = params[0].device if params else None
        return [megengine.tensor(0, dtype="int32", device=device)]

    def all_reduce_max_async(self, flag: Any, group: Any) -> tuple[Any, Any]:
        from megengine.distributed.functional import all_reduce_max

        # One value per device from the fused kernel; MegEngine queues ops
        # asynchronously, so there is no handle to wait for.
        total = flag[0]
        for f in flag[1:]:
            total = total + f.to(total.device)
        return [all_reduce_max(total, group)], None
