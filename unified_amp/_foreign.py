"""Naming a value that is not the active backend's: another framework's tensor or
module, a NumPy array, or anything else, for the errors of the calls that got it.

With both frameworks installed and nothing selected, torch is the backend; a MegEngine
model then reaches a torch scaler, and the fix is a setting, not the code. The core
imports no framework, so a value's framework is read from the module names of its
type and base classes (a user's subclass of ``torch.nn.Module`` counts as torch's).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from . import _registry
from ._registry import _BUILTIN, ENV_VAR
from .errors import TensorTypeError

_SHOWN = {"torch": "PyTorch", "megengine": "MegEngine"}


def _roots(obj: Any) -> set[str]:
    return {str(cls.__module__).partition(".")[0] for cls in type(obj).__mro__}


def framework_of(obj: Any) -> str | None:
    """The built-in backend whose framework defines ``obj``'s type, or None."""
    roots = _roots(obj)
    for name, (_, module, _) in _BUILTIN.items():
        if module in roots:
            return name
    return None


def is_foreign(obj: Any, active: str) -> bool:
    """Whether ``obj`` belongs to another framework than ``active``'s, or to NumPy."""
    other = framework_of(obj)
    return (other is not None and other != active) or "numpy" in _roots(obj)


def hint(obj: Any, active: str) -> str:
    """A sentence saying where ``obj`` comes from and what to do, or "" if from
    nowhere in particular."""
    other = framework_of(obj)
    if other is not None and other != active:
        shown = _SHOWN.get(other, other)
        return (
            f" It is a {shown} {type(obj).__name__}, and unified_amp's active backend is"
            f" {active!r} ({_how_chosen()}). To train with {shown}, select its backend:"
            f" {ENV_VAR}={other} in the environment, or amp.set_backend({other!r}) before"
            f" making the GradScaler and GradManager."
        )
    if "numpy" in _roots(obj):
        shape = getattr(obj, "shape", None)
        what = "array" if shape else "scalar"
        return (
            f" It is a NumPy {what}{f' of shape {tuple(shape)}' if shape else ''}, which"
            f" no backward pass can reach: pass the {_SHOWN.get(active, active)} tensor"
            f" your model or loss function returned (a tensor made from it, such as"
            f" {'torch.from_numpy(a)' if active == 'torch' else 'megengine.tensor(a)'},"
            f" has no gradient history either)."
        )
    return ""


def _how_chosen() -> str:
    if _registry._chosen is not None:
        return "chosen by amp.set_backend()"
    if os.environ.get(ENV_VAR, "").strip():
        return f"from the {ENV_VAR} environment variable"
    return ("chosen automatically: with both frameworks installed and none selected,"
            " torch comes first")


def scalable(val: Any, active: str) -> bool:
    """Whether ``GradScaler.scale()`` maps over ``val`` lazily (as torch.amp does for an
    iterable that is no list or tuple): not for a string, a mapping, or another
    framework's tensor or a NumPy array, which iterate but hold no tensors of ``active``."""
    return (isinstance(val, Iterable) and not isinstance(val, (str, bytes, Mapping))
            and not is_foreign(val, active))


def not_a_tensor(what: str, active: str, where: str, val: Any, fix: str) -> TensorTypeError:
    """The error for ``val``, found at ``where`` in the arguments of ``what``."""
    return TensorTypeError(
        f"{what} expects a {active} tensor or a list/tuple of them; {where} is"
        f" {type(val).__name__} {_short(val)}.{hint(val, active) or ' ' + fix}"
    )


def require_tensors(backend: Any, ys: list[Any], what: str, fix: str) -> None:
    """Raises ``TensorTypeError`` for the first of ``ys`` that is no tensor of ``backend``."""
    for i, y in enumerate(ys):
        if not backend.is_tensor(y):
            raise not_a_tensor(what, backend.name, f"y[{i}]" if len(ys) > 1 else "y", y, fix)


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."
