"""Cross-rank agreement: in a multi-process job, every rank takes every GradScaler
decision (skip or step, back off or grow) the same way.

The scaler calls this module at each fused check; the adapters supply only primitives
(a MAX all-reduce of a device flag, what kind of gradient a parameter carries, whether
a module sits in a ``no_sync()`` window). The rules, by kind of gradient:

- **Identical on every rank already** (DDP averages before the scaler unscales;
  MegEngine's ``make_allreduce_cb`` does so inside ``gm.backward``): each rank's own
  check gives the same answer, so no collective is added.
- **DTensor** (FSDP2's ``fully_shard``): torch agrees the flag by itself, inside its
  dispatch of the fused check kernel (a MAX all-reduce over the mesh). So that every
  rank issues the same kernel calls -- and so the same collectives -- every DTensor
  parameter takes part in the check, with a zero stand-in where this rank holds no
  gradient for it.
- **Different on every rank, with no agreement of their own** (FSDP1's flattened
  parameters, or any parameters when ``GradScaler(process_group=...)`` is given): one
  MAX all-reduce of the device flag, started asynchronously right after the check and
  waited for only where the flag is first used. A rank with nothing to check takes part
  with a clean flag.

Every decision is taken on every rank at the same call: a check that involves a
collective covers all the target's parameters, those without a gradient included, so
that the scaler's bookkeeping (which parameters are still to be unscaled) is the same
on every rank even when one rank received no gradient at all.

The collective works on the device flag, so the one host read per step is unchanged and
reads the agreed flag.
"""

from __future__ import annotations

import weakref
from typing import Any

from .capabilities import Collectives, DataParallelHooks, capability

__all__: list[str] = []

# Kinds of gradient an adapter's grad_kind() reports.
LOCAL = "local"  # the same on every rank, or single-process
DTENSOR = "dtensor"  # the framework agrees a check over its own mesh
SHARDED = "sharded"  # a per-rank shard with no agreement of its own (FSDP1)


def supported(backend: Any) -> bool:
    """Whether the adapter provides the distributed primitives."""
    return capability(backend, Collectives) is not None


def check_group(backend: Any, group: Any) -> None:
    """Raises if ``group`` cannot be agreed over on this backend."""
    if not supported(backend):
        raise ValueError(
            f"GradScaler(process_group=...) needs collectives, which the"
            f" {backend.name!r} backend does not provide; leave process_group=None."
        )
    backend.check_group(group)


class Agreement:
    """How the ranks agree on one check: the group of our all-reduce (None: the
    framework agrees by itself) and the zero stand-ins that make every rank take part."""

    __slots__ = ("backend", "group", "standins")

    def __init__(self, backend: Any, group: Any, standins: list[Any]) -> None:
        self.backend = backend
        self.group = group
        self.standins = standins

    def reduce(self, flag: Any, params: list[Any]) -> tuple[Any, Any]:
        """The agreed flag for ``flag`` (None: this rank had nothing to check) and the
        handle of the all-reduce still running on it (None: nothing to wait for), for
        the scaler's Check; nothing is read on the host."""
        if self.group is None:
            return flag, None
        if flag is None:
            flag = self.backend.clean_flag(params, self.group)
        return self.backend.all_reduce_max_async(flag, self.group)


def plan(backend: Any, params: list[Any], idle: list[Any], group: Any) -> Agreement | None:
    """The agreement a check over ``params`` (with gradients) and ``idle`` (without)
    needs, or None where each rank's own check already agrees (single process, DDP).

    Depends on the parameters only, never on which of them hold a gradient here, so
    that every rank reaches the same answer.
    """
    if group is None and not active(backend, None):
        return None  # single process: nothing to agree with
    kind = backend.grad_kind
    kinds = set()
    standins = []
    for p in params:
        kinds.add(kind(p))
    for p in idle:
        k = kind(p)
        kinds.add(k)
        if k == DTENSOR:
            standins.append(backend.zero_grad_like(p))
    if group is None and SHARDED in kinds:
        group = backend.world_group()
    if group is None and DTENSOR not in kinds:
        return None
    return Agreement(backend, group, standins)


def active(backend: Any, group: Any) -> bool:
    """Whether agreement may be needed at all: a group was given, or this is one rank
    of several. Cheap; the same on every rank."""
    if group is not None:
        return True
    collectives = capability(backend, Collectives)
    return collectives is not None and collectives.world_group() is not None


# -- modules the user showed us, for the no_sync() check -----------------------------------
# Modules passed as a target (amp.GradManager(model), clip_grad_norm(model),
# scaler.unscale_(model)), held weakly: DDP keeps its "inside no_sync()" state on the
# module, and nothing on a parameter leads back to it. This is a fact about modules, not
# any scaler's state: every scaler that unscales a noted module's parameters must refuse
# inside its no_sync() window, whichever object showed the module (the loop in
# tests/native/torch_dist_scenarios.py shows it to a GradManager and unscales the
# optimizer). The three callers note the module explicitly.
_modules: "weakref.WeakSet[Any]" = weakref.WeakSet()


def note_module(backend: Any, target: Any) -> None:
    """Remembers ``target``, weakly, if it is a module of ``backend``'s framework (a
    GradManager, optimizer or iterable of parameters is not)."""
    if not backend.is_module(target):
        return
    try:
        _modules.add(target)
    except TypeError:  # not weak-referenceable: then we cannot watch it
        pass


def require_synced(backend: Any, params: list[Any], what: str) -> None:
    """Raises if ``params`` belong to a watched module inside its ``no_sync()`` window:
    their gradients are this rank's alone, so ranks would check different gradients and
    could take different decisions."""
    if not _modules or not params or not active(backend, None):
        return  # DDP needs a process group: nothing to check in a single process
    hooks = capability(backend, DataParallelHooks)
    if hooks is None:
        return
    for module in list(_modules):
        if not hooks.grad_sync_paused(module):
            continue
        ids = {id(p) for p in params}
        if any(id(p) in ids for p in module.parameters()):
            raise RuntimeError(
                f"{what} was called inside {type(module).__name__}.no_sync(): these"
                f" gradients are not synchronised across ranks yet, so the ranks would"
                f" check different gradients and could disagree (one steps, another"
                f" skips, and the weights drift apart). Unscale after the synchronising"
                f" micro-batch: run the last micro-batch's forward and backward outside"
                f" no_sync(), then unscale, clip and step."
            )


def sharded_params(backend: Any, params: list[Any]) -> bool:
    """Whether some of ``params`` are per-rank shards with no agreement of their own."""
    if not active(backend, None):
        return False
    return any(backend.grad_kind(p) == SHARDED for p in params)
