"""Turning "a GradManager, an optimizer, a module, or an iterable of parameters" into
parameters.

Both frameworks spell these the same way (``gm.attached_tensors()``,
``optimizer.param_groups[i]["params"]``, ``module.parameters()``), so this is written
once here.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, Callable

from .. import _foreign
from .._foreign import _short, hint

_is_not_none = functools.partial(operator.is_not, None)


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
        # Each tensor once; MegEngine's holds them weakly: a freed one comes back as None.
        return list(filter(_is_not_none, target.attached_tensors()))
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


class OptimizerParams:
    """An optimizer's parameters, cached per optimizer (weakly) while its param_groups
    stay the same lists of the same lengths: rebuilding them is a pass over every
    parameter, and a step asks every time."""

    def __init__(self) -> None:
        # id(optimizer) -> (a weak reference to it, its groups' shape, its parameters)
        self._cache: dict[int, tuple[Any, list, list[Any]]] = {}

    def __call__(self, optimizer: Any, backend: Any) -> list[Any]:
        shape = [(id(g["params"]), len(g["params"])) for g in optimizer.param_groups]
        cached = self._cache.get(id(optimizer))
        if cached is not None and cached[0]() is optimizer and cached[1] == shape:
            return cached[2]
        params = params_of(optimizer, backend, "GradScaler.step()")
        key = id(optimizer)
        try:  # (the entry goes with the optimizer)
            ref = weakref.ref(optimizer, lambda _: self._cache.pop(key, None))
        except TypeError:  # not weak-referenceable: no cache
            return params
        self._cache[key] = (ref, shape, params)
        return params


def each_tensor(val: Any, where: str, one: Callable[[Any, str], Any], backend: Any) -> Any:
    """``one(tensor, where)`` of ``val`` (a tensor, or a list/tuple or other iterable of
    them, nested), in the same structure: what ``scale()`` accepts.

    Raises:
        TensorTypeError: something in ``val`` is no tensor of ``backend`` (a NumPy
            array, another framework's tensor, ...).
    """
    if backend.is_tensor(val):
        return one(val, where)
    if isinstance(val, (list, tuple)):
        return type(val)(each_tensor(v, f"{where}[{i}]", one, backend)
                         for i, v in enumerate(val))
    if _foreign.scalable(val, backend.name):
        return map(lambda v: each_tensor(v, f"{where}[...]", one, backend), val)
    raise _foreign.not_a_tensor("GradScaler.scale()", backend.name, where, val,
                                "Scale only the loss (or outputs) you call backward on.")
