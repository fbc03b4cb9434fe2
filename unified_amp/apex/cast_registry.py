"""apex's function registries -- ``register_float_function``, ``register_half_function``,
``register_promote_function`` -- on both frameworks.

    amp.register_float_function(torch, "sigmoid")          # before amp.initialize
    amp.register_half_function(megengine.functional, "sigmoid")

apex patched the registered functions inside ``amp.initialize`` (O1). Here the function
is replaced at registration by a wrapper that does nothing while autocast is off and,
while it is on (``amp.autocast``, the framework's own, or ``amp.initialize``'s O1/O2),
casts the floating-point tensors among its arguments -- to float32 ("float"), to the
autocast dtype ("half"), or to the widest among them ("promote") -- and runs the
original with autocast off, so that the result keeps that dtype.

The wrapper replaces ``namespace.name`` and every other binding of the same function
object in the same framework's modules (MegEngine's modules import functions by name:
``megengine.module.Sigmoid`` calls the ``sigmoid`` it imported). Code that imported the
function itself before the registration keeps the original, as under apex.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import sys
import types
from typing import Any, Callable

from .. import _latest_initialize
from .._casting import _cast_tree
from ..interface import LOW_PRECISION
from .._registry import get_backend
from ..autocast import autocast

__all__ = ["register_float_function", "register_half_function",
           "register_promote_function"]

_KINDS = ("float", "half", "promote")
_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


class _Entry:
    """One registered function: what it casts to, the original, and where the wrapper
    was put in its place (to take it off again in tests)."""

    def __init__(self, kind: str, original: Callable[..., Any]) -> None:
        self.kind = kind
        self.original = original
        self.bound: list[tuple[Any, str]] = []  # (namespace, attribute) holding the wrapper
        self.wrapper: Callable[..., Any] | None = None


# What is registered, by id of the original function: the process's functions are
# process-global, so the registry is too (as apex's). No scaler or initialize state.
_entries: dict[int, _Entry] = {}


def _floating(tree: Any, backend: Any, out: list[Any]) -> list[Any]:
    if backend.is_tensor(tree):
        if backend.dtype_name(tree.dtype) in _RANK:
            out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _floating(item, backend, out)
    elif isinstance(tree, dict):
        for item in tree.values():
            _floating(item, backend, out)
    return out


def _target_dtype(kind: str, tensors: list[Any], backend: Any) -> str | None:
    """The dtype ``kind`` casts the floating arguments to, or None for no cast."""
    if kind == "float":
        return "float32"
    if kind == "half":
        return backend.autocast_low_dtype(backend.device_type(tensors[0]))
    names = {backend.dtype_name(t.dtype) for t in tensors}
    if len(names) == 1:
        return None
    widest = max(names, key=lambda n: _RANK[n])
    # float16 with bfloat16: float32 is the narrowest type that holds both.
    return "float32" if widest in LOW_PRECISION else widest


def _make_wrapper(entry: _Entry) -> Callable[..., Any]:
    original = entry.original

    @functools.wraps(original)
    def registered(*args: Any, **kwargs: Any) -> Any:
        backend = get_backend()
        if not backend.is_autocast_enabled():
            return original(*args, **kwargs)
        tensors = _floating((args, kwargs), backend, [])
        if not tensors:
            return original(*args, **kwargs)
        dtype = _target_dtype(entry.kind, tensors, backend)
        if dtype is not None:
            # float: the low ones up (float64 stays); half: float32 down; promote: all.
            only_low = entry.kind == "float"
            if entry.kind == "half":
                args, kwargs = _cast_float32((args, kwargs), dtype, backend)
            else:
                args = _cast_tree(args, dtype, backend, only_low=only_low)
                kwargs = _cast_tree(kwargs, dtype, backend, only_low=only_low)
        with autocast(enabled=False):  # fresh per call: a shared one is not thread-safe
            return original(*args, **kwargs)

    return registered


def _cast_float32(tree: Any, dtype: str, backend: Any) -> Any:
    """``tree`` with its float32 tensors cast to ``dtype`` (apex's half cast, which
    leaves float64 alone here, as autocast does)."""
    if backend.is_tensor(tree):
        return backend.cast(tree, dtype) if backend.dtype_name(tree.dtype) == "float32" \
            else tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_cast_float32(v, dtype, backend) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cast_float32(v, dtype, backend) for v in tree)
    if isinstance(tree, dict):
        return type(tree)((k, _cast_float32(v, dtype, backend)) for k, v in tree.items())
    return tree


def _resolve(namespace: Any, name: Any, caller: str) -> tuple[Any, Callable[..., Any]]:
    """The namespace object and the function it holds under ``name``; clear errors."""
    call = f"amp.{caller}({namespace!r}, {name!r})"
    if isinstance(namespace, str):
        try:
            namespace = importlib.import_module(namespace)
        except ImportError as exc:
            raise ValueError(f"{call}: cannot import the namespace {namespace!r} ({exc})."
                             f" Pass a module such as torch.nn.functional or"
                             f" megengine.functional, or its dotted name.") from None
    elif not isinstance(namespace, (types.ModuleType, type)):
        raise TypeError(f"{call}: the namespace must be a module or a class (such as"
                        f" torch.nn.functional, torch or megengine.functional) or its"
                        f" dotted name; got a {type(namespace).__name__}.")
    where = getattr(namespace, "__name__", repr(namespace))
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"{call}: the name must be a function's name as a str, such as"
                        f" 'sigmoid'; got {name!r}.")
    if not hasattr(namespace, name):
        public = [n for n in dir(namespace) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"{call}: no function named {name!r} in {where}.{hint}")
    fn = getattr(namespace, name)
    if inspect.isclass(fn):
        raise TypeError(f"{call}: {where}.{name} is a class, not a function; to run a"
                        f" module in float32 use amp.keep_float32(module).")
    if not callable(fn):
        raise TypeError(f"{call}: {where}.{name} is a {type(fn).__name__}, not a"
                        f" function.")
    return namespace, fn


def _check_not_initialized(caller: str, namespace: Any, name: str) -> None:
    state = _latest_initialize.latest()
    if state is not None and state.props is not None:
        raise RuntimeError(
            f"amp.{caller}({getattr(namespace, '__name__', namespace)!r}, {name!r}) was"
            f" called after amp.initialize(). apex applies its function registry inside"
            f" initialize and ignores later registrations, so code written for apex"
            f" never had this function cast; register functions before"
            f" amp.initialize(), as apex requires.")


def _bindings(namespace: Any, name: str, fn: Any) -> list[tuple[Any, str]]:
    """``namespace.name`` and every other module attribute of the same framework that
    holds the same function object under the same name."""
    found = [(namespace, name)]
    if not isinstance(namespace, types.ModuleType):
        return found
    top = namespace.__name__.partition(".")[0]
    for mod_name, mod in list(sys.modules.items()):
        parts = mod_name.split(".")
        # Public modules only: the framework's internals (torch._C._nn, ...) keep
        # calling the original.
        if mod is None or mod is namespace or parts[0] != top or \
                any(p.startswith("_") for p in parts):
            continue
        if vars(mod).get(name) is fn:
            found.append((mod, name))
    return found


def _register(kind: str, caller: str, namespace: Any, name: str) -> None:
    namespace, fn = _resolve(namespace, name, caller)
    _check_not_initialized(caller, namespace, name)
    existing = next((e for e in _entries.values() if e.wrapper is fn), None)
    if existing is not None:  # registered already: the last registration decides
        existing.kind = kind
        return
    # The adapter may replace some framework functions with its own (the dtype
    # contract, on the first enabled autocast block); that happens now, so that the
    # registered wrapper goes around them and is not overwritten later.
    with autocast():
        pass
    fn = getattr(namespace, name)
    existing = next((e for e in _entries.values() if e.wrapper is fn), None)
    if existing is not None:
        existing.kind = kind
        return
    entry = _Entry(kind, fn)
    entry.wrapper = _make_wrapper(entry)
    entry.bound = _bindings(namespace, name, fn)
    for holder, attr in entry.bound:
        setattr(holder, attr, entry.wrapper)
    _entries[id(fn)] = entry


def register_float_function(namespace: Any, name: str) -> None:
    """Runs ``namespace.name`` in float32 under autocast, as apex's function of that name.

    While autocast is on, its low-precision floating arguments are cast to float32 and
    it runs with autocast off; while it is off, the function runs unchanged. Call it
    before ``amp.initialize``.

    Args:
        namespace: a module or class (``torch``, ``torch.nn.functional``,
            ``megengine.functional``), or its dotted name.
        name: the function's name in it, such as ``"sigmoid"``.

    Raises:
        TypeError: ``namespace`` is no module or class; ``name`` names a class (use
            ``amp.keep_float32`` for modules) or something not callable.
        ValueError: no such function there (close names are suggested); a dotted name
            that does not import.
        RuntimeError: called after ``amp.initialize``.
    """
    _register("float", "register_float_function", namespace, name)


def register_half_function(namespace: Any, name: str) -> None:
    """Runs ``namespace.name`` in autocast's low precision (float16 or bfloat16), as
    apex's function of that name: its float32 arguments are cast to autocast's dtype on
    their device and it runs with autocast off. Arguments and errors as
    :func:`register_float_function`."""
    _register("half", "register_half_function", namespace, name)


def register_promote_function(namespace: Any, name: str) -> None:
    """Runs ``namespace.name`` in the widest floating dtype among its tensor arguments
    under autocast, as apex's function of that name (float16 with float32 runs in
    float32; float16 with bfloat16 in float32). Arguments and errors as
    :func:`register_float_function`."""
    _register("promote", "register_promote_function", namespace, name)


def _unregister_all() -> None:
    """Puts every registered function back (for tests: registrations are for the
    process's lifetime otherwise, as in apex)."""
    for entry in list(_entries.values()):
        for holder, attr in entry.bound:
            if getattr(holder, attr, None) is entry.wrapper:
                setattr(holder, attr, entry.original)
    _entries.clear()
