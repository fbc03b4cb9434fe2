"""Casting the floating tensors in nested arguments (the model's forward under
initialize, registered functions, pinned modules): one leaf module that each of them
imports, so that none imports another for it."""

from __future__ import annotations

from typing import Any

from .interface import LOW_PRECISION

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _cast_tree(x: Any, dtype: str, backend: Any, only_low: bool) -> Any:
    """``x`` with its floating tensors cast to ``dtype`` (only the low-precision ones
    when ``only_low``), through lists, tuples (named too) and dicts."""
    if backend.is_tensor(x):
        name = backend.dtype_name(x.dtype)
        if name != dtype and name in (LOW_PRECISION if only_low else _FLOATS):
            return backend.cast(x, dtype)
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_cast_tree(v, dtype, backend, only_low) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_tree(v, dtype, backend, only_low) for v in x)
    if isinstance(x, dict):
        return type(x)((k, _cast_tree(v, dtype, backend, only_low)) for k, v in x.items())
    return x
