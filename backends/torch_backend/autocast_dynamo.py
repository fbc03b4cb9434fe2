"""What dynamo is told about ``amp.autocast`` objects that it does not find out itself.

A block object made *outside* the compiled function (``CTX = amp.autocast(...)`` at
module level, or ``ctx = nullcontext() if cpu else amp.autocast(...)`` before the
compiled step) reaches dynamo as an existing object. dynamo enters an existing object
in a ``with`` statement only if it is one of the context managers it knows
(``torch.autocast`` objects, grad modes, torch function modes, ...); torch 2.7-2.13
wrap any other object as a plain user object, which it refuses to enter ("Unsupported
context manager": a graph break, and an error under ``fullgraph=True``). torch 2.14
wraps an existing object with ``__enter__`` and ``__exit__`` as it wraps one made inside
the compiled function: its ``__enter__`` and ``__exit__`` are traced (inlined).

``install()`` gives dynamo that rule for ``amp.autocast`` objects on every torch, through
the table of exact types dynamo's ``VariableBuilder`` consults first: an existing block
object is wrapped as a ``GenericContextWrappingVariable``, the variable dynamo makes for a
block made inside the compiled function, so both compile to the same graph. The
object's identity is guarded (another block object is another graph), and its token
stack, pushed on entry and popped on exit, is tracked as any mutated attribute is.
Private API: ``tests/native/test_torch_compile_first_use.py`` fails loudly when a torch
release moves it (docs/COMPILE.md, "dynamo internals the adapter relies on").

``release_dead_guards()`` lets go of the guards of compiled code that no longer exists
(see there).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from typing import Any, Callable


def _wrap_existing_block(builder: Any, value: Any) -> Any:
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.ctx_manager import GenericContextWrappingVariable

    builder.install_guards(GuardBuilder.ID_MATCH)
    var = GenericContextWrappingVariable(value, source=builder.source)
    return builder.tx.output.side_effects.track_object_existing(value, var)


def install(block_class: type) -> bool:
    """Has dynamo wrap existing ``block_class`` objects as context managers it traces.

    Returns whether it could (False where dynamo's table is not where it was: then a
    block made outside a compiled function breaks the graph at its ``with``, as it did
    before, and ``fullgraph=True`` raises dynamo's ``Unsupported``)."""
    try:
        from torch._dynamo.variables.builder import VariableBuilder

        tables = [VariableBuilder._type_dispatch_impl(trace_numpy)
                  for trace_numpy in (False, True)]
    except Exception:
        return False
    for table in tables:
        if not isinstance(table, dict):
            return False
        table[block_class] = _wrap_existing_block
    return True


def never_a_frame_of_its_own(*functions: Any) -> None:
    """Makes dynamo run these functions, and all they call, as they are whenever they are
    called from code that runs eagerly inside a compiled call (a frame dynamo gave up on
    after a graph break inside a block); compiled code still inlines them.

    Compiled as frames of their own, a block's entry would switch autocast on inside a
    graph of its own, whose switches AOTAutograd drops, and its exit would meet
    torch.autocast objects made eagerly, which dynamo cannot leave (torch 2.14), or a
    traced block it cannot rebuild (torch 2.7-2.10). Not skipped (torch 2.7-2.8), the
    block sees such a compile (autocast.py's `_block_is_its_own_frame`) and enters and
    leaves eagerly.
    """
    from torch._C._dynamo import eval_frame

    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP,
                                         eval_frame._FrameAction.SKIP)
    for fn in functions:
        eval_frame.set_code_exec_strategy(fn.__code__, skip)


# -- the guards of compiled code that is gone ------------------------------------------------

_PACKAGE = __name__.split(".")[0]
# The core's directory and the adapters' (installed as unified_amp.backends, they may
# lie elsewhere).
_SOURCES = tuple(os.path.dirname(os.path.abspath(sys.modules[name].__file__ or "")) + os.sep
                 for name in (_PACKAGE, __name__.rsplit(".", 2)[0]))
_dead_once: "weakref.WeakSet[Any]" = weakref.WeakSet()  # compiles seen once without code


def _nothing() -> None:
    return None


_last_swept: Callable[[], Any] = _nothing  # the compile that swept last (a weak reference)


def _is_ours(obj: Any) -> bool:
    """Whether ``obj`` is one of the library's module-level objects: a module, a class, or
    the code of a function (these live as long as the process)."""
    if isinstance(obj, type(os)):
        return obj.__name__.split(".")[0] == _PACKAGE
    if isinstance(obj, type):
        return str(getattr(obj, "__module__", "")).split(".")[0] == _PACKAGE
    if isinstance(obj, type(_is_ours.__code__)):
        return obj.co_filename.startswith(_SOURCES)
    return False


def _guard_manager_of(info: Any) -> Any:
    """The guards' manager (dynamo's ``CheckFunctionManager``) a finalizer would tell
    that its object died, or None for a finalizer that is not dynamo's."""
    func = info.func
    if isinstance(func, functools.partial) and getattr(func.func, "__name__", "") == "invalidate":
        return getattr(func.func, "__self__", None)
    return None


def _compiled_our_frame(manager: Any) -> bool:
    """Whether the frame the guards were made for is the library's (its globals are one
    of the library's modules): a block's entry and exit on torch 2.7-2.8, which dynamo
    compiles on their own in a frame it gave up on (the contract's mode carries a skip
    strategy on every torch: dtype_contract.py)."""
    scope = getattr(getattr(manager, "guard_manager", None), "global_scope", None)
    frame_globals = scope.get("G") if isinstance(scope, dict) else None
    name = frame_globals.get("__name__") if isinstance(frame_globals, dict) else None
    return isinstance(name, str) and name.split(".")[0] == _PACKAGE


def _has_no_compiled_code(manager: Any) -> bool:
    """Whether no compiled code is guarded by ``manager`` any more (dynamo's cache entry
    is gone: a reset, or its function was dropped). False where dynamo keeps it elsewhere."""
    guards = getattr(manager, "guard_manager", None)
    return guards is not None and hasattr(guards, "cache_entry") and guards.cache_entry is None


def release_dead_guards() -> None:
    """Lets go of the guards of compiled code that is gone, where the library is what
    kept them.

    dynamo hangs a ``weakref.finalize`` on each object an ID_MATCH guard names (to drop
    the compiled code if that object dies); the finalizer holds the guards' manager, with
    every guard and the stack each was made on. The objects a block's entry and exit
    meet while traced (the library's modules, classes, and its functions' code) live as
    long as the process, so their finalizers kept every compile that traced a block
    after ``torch._dynamo.reset()`` or after its function was dropped: about 50
    finalizers and 600 objects a compile, where a ``torch.autocast`` block keeps 3
    (tools/compile_leak.py). Once the compiled code is gone, its finalizers can do
    nothing (there is nothing left to drop), so those of a compile that guarded one of
    the library's objects, or compiled one of its frames, are detached, and its guards
    go with them. Compiles that never met the library are left as dynamo keeps them.

    Called while a block is traced, once a compile. A compile is released the second
    time it is seen without code: between the making of its guards and dynamo's cache
    entry taking them, another thread may trace (the compile lock is released by
    then). Where dynamo's internals are not as expected, nothing is released.
    """
    global _last_swept
    try:
        from torch._guards import CompileContext

        compiling = CompileContext.try_get()
    except Exception:
        compiling = None
    if compiling is not None and _last_swept() is compiling:
        return  # a second block of the same compile: nothing has died since
    _last_swept = weakref.ref(compiling) if compiling is not None else _nothing
    registry = getattr(weakref.finalize, "_registry", None)
    if not isinstance(registry, dict):
        return
    dead: dict[int, tuple[Any, list[Any]]] = {}  # id -> (manager, its finalizers)
    ours: set[int] = set()
    live: set[int] = set()
    for finalizer, info in list(registry.items()):
        manager = _guard_manager_of(info)
        key = id(manager)
        if manager is None or key in live:
            continue
        if key not in dead:
            if not _has_no_compiled_code(manager):
                live.add(key)
                _dead_once.discard(manager)
                continue
            dead[key] = manager, []
            if _compiled_our_frame(manager):
                ours.add(key)
        dead[key][1].append(finalizer)
        if key not in ours and _is_ours(info.weakref()):
            ours.add(key)
    for key in ours:
        manager, finalizers = dead[key]
        if manager not in _dead_once:
            _dead_once.add(manager)
            continue
        for finalizer in finalizers:
            finalizer.detach()


# Run as it is while dynamo traces (the marker torch.compiler.assume_constant_result
# sets), never traced: it is called from a block's traced entry.
release_dead_guards._dynamo_marked_constant = True  # type: ignore[attr-defined]
