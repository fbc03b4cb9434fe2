"""Turning "a GradManager, an optimizer, a module, or an iterable of parameters" into
parameters.

Both frameworks spell these the same way (``gm.attached_tensors()``,
``optimizer.param_groups[i]["params"]``, ``module.parameters()``), so this is written
once here.
"""

from __future__ import annotations

from typing import Any

from ._foreign import _short, hint


def is_optimizer(obj: Any) -> bool:
    return hasattr(obj, "param_groups") and hasattr(obj, "step")


def params_of(target: Any, backend: Any, what: str) -> list[Any]:
    """The parameters behind ``target``, each once, in order.

    Args:
        what: the calling function's name, for the error message.

    Raises:
        TypeError: ``target`` is none of the accepted kinds.
    """
    if hasattr(target, "attached_tensors"):  # amp.GradManager or MegEngine's own
        # MegEngine's holds tensors weakly: a freed one comes back as None.
        params = [p for p in target.attached_tensors() if p is not None]
    elif is_optimizer(target):
        params = [p for group in target.param_groups for p in group["params"]]
    elif backend.is_tensor(target):
        params = [target]
    elif backend.is_module(target):
        params = list(target.parameters())
    else:
        try:
            params = list(target)
        except TypeError:
            params = [target]  # not iterable: rejected below, as a non-tensor
        if not all(backend.is_tensor(p) for p in params):
            odd = next(p for p in params if not backend.is_tensor(p))
            raise TypeError(
                f"{what} expects a GradManager, an optimizer, a module, or an iterable of"
                f" {backend.name} parameters; got {type(target).__name__}"
                f" {_short(target)}.{hint(target, backend.name) or hint(odd, backend.name)}"
            )
    if len(set(map(id, params))) == len(params):
        return params  # the usual case, checked at C speed
    seen: set[int] = set()
    unique = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique
