"""Wrappers wherever the process holds the functions they wrap, so that a function bound
before the wrapper existed (``from megengine.functional import softmax`` at the top of a
module, run before the first block or before ``import unified_amp``; a program's own
``attention`` that a block's rules name) calls the wrapper as a fresh lookup would.

Where no framework hook sees a call (MegEngine's autocast has none; a Python function
of the program's own is no framework op), a wrapper runs only where a name holds it.
When wrappers are installed, every reference the process holds to an original is found
in one pass over the objects the garbage collector tracks (``gc.get_referrers``, the
tool code reloaders use for the same purpose) and swapped where it is a binding: an
attribute of a module, a class or an object, a closure's cell, a function's default, a
local variable of a function waiting on the calling thread's stack (README's
``train_step(model, loss_fn, ...)``). That is what the import would have bound had it
run after the install. A reference held in the program's data -- a list, a tuple, a
dict of its own, a ``functools.partial`` -- or in another thread's running function is
left alone, and named once in an ``amp.ContractWarning``.

Modules imported later get the wrappers from the names they import; only a value copied
out of such a holder can bring an original in. ``new_modules`` looks at the modules
added to ``sys.modules`` since (when nothing was imported: a length check).

Framework-free: the adapters hand it (original, wrapper, name) triples.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
import os
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterable

from unified_amp.errors import ContractWarning

# The core's files and the adapters': their frames hold originals while they install.
_OURS = tuple(os.path.dirname(os.path.abspath(getattr(importlib.util.find_spec(m), "origin",
                                                      None) or ""))
              for m in ("unified_amp", "unified_amp.backends"))


def _attr(obj: Any, name: str) -> Any:
    """``obj.name``, or None: what the process holds may be a proxy whose attribute
    lookup raises anything (a lazy module, a context-local proxy)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 -- not ours to judge; it is no binding of ours
        return None


def _stack(frame: types.FrameType | None) -> Iterable[types.FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


class Rebinder:
    """Original function -> its wrapper, swapped into the process's bindings.

    ``shadowing``: classes whose attribute, already set to the wrapper, covers what a
    base class they inherit it from still holds (``megengine.Tensor`` over MegEngine's
    C tensor type, which takes no attribute). ``keeps``: what a call through an
    original keeps inside a block, for the warning ("megengine.amp's own rule"); None
    for no warning (a program's own function: the block's rules hold it, in tuples of
    their own, and so may the program's data, by design).
    """

    def __init__(self, wrapped: list[tuple[Callable, Callable, str]],
                 shadowing: tuple[type, ...] = (),
                 keeps: str | None = "megengine.amp's own rule") -> None:
        """``wrapped``: (original, wrapper, the original's public name for the warning,
        ``megengine.functional.softmax``) each. The caller must not keep it: what holds
        an original is what the pass looks for."""
        self._originals = [fn for fn, _, _ in wrapped]
        self._by_id = {id(fn): fn for fn, _, _ in wrapped}
        self._wrapper = {id(fn): w for fn, w, _ in wrapped}
        self._name = {id(fn): name for fn, _, name in wrapped}
        self._shadowing = shadowing
        self._keeps = keeps
        # what refers to an original because it is ours: these two, each wrapper's
        # closure (its ``fn``) and attributes (functools.wraps' ``__wrapped__``)
        self._ours = {id(self._originals), id(self._by_id)}
        for _, w, _ in wrapped:
            self._ours.add(id(w.__dict__))
            self._ours.update(id(cell) for cell in w.__closure__ or ())
        # the dicts of the shadowing classes and their bases: a C type's is found with
        # no owner (the collector does not track static types)
        self._class_dicts = {id(gc.get_referents(vars(c))[0]): c
                             for s in shadowing for c in s.__mro__}
        self._seen: weakref.WeakSet[types.ModuleType] = weakref.WeakSet()
        self._modules = 0

    def wrappers(self) -> list[tuple[str, Callable]]:
        """(public name, wrapper) of each original."""
        return [(self._name[i], w) for i, w in self._wrapper.items()]

    # -- modules ----------------------------------------------------------------------

    def _swap_in(self, namespace: dict[str, Any]) -> None:
        for key, value in list(namespace.items()):
            if self._original(value) is not None:
                namespace[key] = self._wrapper[id(value)]

    def _original(self, value: Any) -> Any:
        """``value`` if it is one of the originals, else None."""
        fn = self._by_id.get(id(value))
        return fn if fn is value else None

    def new_modules(self) -> None:
        """The modules added to ``sys.modules`` since the last look, swapped."""
        if len(sys.modules) == self._modules:
            return
        self._modules = len(sys.modules)
        for module in list(sys.modules.values()):
            try:
                if module in self._seen:
                    continue
                self._seen.add(module)
            except Exception:  # noqa: BLE001 -- a stand-in that takes no weak reference
                pass
            namespace = _attr(module, "__dict__")
            if type(namespace) is dict:
                self._swap_in(namespace)

    # -- everything else --------------------------------------------------------------

    def everywhere(self) -> None:
        """Every binding the process holds of an original, swapped; a holder that is no
        binding named in one ``ContractWarning`` each."""
        held = self._pass()
        if self._keeps is None:
            return self._note_modules()
        if held:
            # A holder may be garbage not yet collected (a cycle): collect, and look again.
            gc.collect()
            held = self._pass()
        for holder, (filename, lineno), names, later in held:
            one = len(names) == 1
            warnings.warn_explicit(
                f"amp.autocast: {', '.join(names)} {'is' if one else 'are'} held in"
                f" {holder}, where unified_amp cannot replace {'it' if one else 'them'}"
                f" with the dtype contract's function, so calls through"
                f" {'it' if one else 'them'} keep {self._keeps} inside"
                f" amp.autocast blocks (docs/DTYPE_CONTRACT.md, 'How it was imported')."
                f" Look the function up where it is called ({names[0]}(...)), or {later}"
                f" after the first amp.autocast block that needs it, when the modules"
                f" already hold unified_amp's function.",
                ContractWarning, filename, lineno)
        self._note_modules()

    def _note_modules(self) -> None:
        # the pass swapped every module's bindings: the next look starts from here
        self._modules = len(sys.modules)
        for module in list(sys.modules.values()):
            try:
                self._seen.add(module)
            except Exception:  # noqa: BLE001 -- as in new_modules
                pass

    def _pass(self) -> list[tuple[str, tuple[str, int], list[str], str]]:
        """One look: swaps what it can, returns (holder, its file and line, the names of
        the originals it holds, what to do after the first block) for the rest. Holds
        no original itself (a list of them would be a holder)."""
        # Running frames first: reading a function's locals makes the dict that holds a
        # copy of them, which would be found as a holder of its own. A module's or a
        # class body's frame runs in a namespace: its names are swapped as bindings. The
        # functions waiting on this thread's stack for this call to return are swapped
        # too (``_set_locals``); another thread's may run between the read and the write.
        frames, here = [], sys._getframe()
        for thread, top in sys._current_frames().items():
            for frame in _stack(here if thread == threading.get_ident() else top):
                if frame.f_code.co_filename.startswith(_OURS):
                    continue
                if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
                    self._swap_in(frame.f_locals)  # a script's globals, a class body's
                elif thread != threading.get_ident() or not self._set_locals(frame):
                    frames.append(frame)
        del here
        held = [h for h in map(self._locals_held, frames) if h]
        referrers = gc.get_referrers(*self._originals)
        suspended = [r for r in referrers if isinstance(r, types.FrameType)
                     and r.f_code.co_flags & inspect.CO_OPTIMIZED
                     and not r.f_code.co_filename.startswith(_OURS)
                     and all(r is not f for f in frames)]  # a generator's
        held += [h for h in map(self._locals_held, suspended) if h]
        skip = self._ours | {id(f.f_locals) for f in frames + suspended}
        referrers = [r for r in referrers if id(r) not in skip
                     and not isinstance(r, types.FrameType) and not self._is_argument_tuple(r)]
        modules = {id(namespace): namespace for namespace in
                   (_attr(m, "__dict__") for m in list(sys.modules.values()))
                   if type(namespace) is dict}
        others = []
        for r in referrers:
            if isinstance(r, types.CellType):
                r.cell_contents = self._wrapper[id(r.cell_contents)]
            elif id(r) in modules:
                self._swap_in(r)
            elif id(r) in self._class_dicts:
                self._swap_class(self._class_dicts[id(r)], r)
            elif not self._metadata_only(r):
                others.append(r)
        owners = self._owners(others)  # one more pass, where something is left
        for obj in others:
            if self._swapped(obj, owners.get(id(obj), [])):
                continue
            names = self._held(obj)
            if names:
                holder = self._describe(obj, owners.get(id(obj), []))
                held.append((holder, self._location(obj, owners.get(id(obj), [])), names,
                             f"build {holder.partition(' bound to ')[2] or 'it'}"))
        return held

    def _set_locals(self, frame: types.FrameType) -> bool:
        """Swaps the originals among ``frame``'s local variables, as a debugger sets a
        variable (pdb's ``!name = value``: the locals' dict written back into the frame);
        whether it could. Only for a frame that cannot run meanwhile: one waiting on
        this thread's stack."""
        names = {k: self._wrapper[id(v)] for k, v in frame.f_locals.items()
                 if self._original(v) is not None}
        if not names:
            return True
        try:
            if sys.version_info >= (3, 13):  # PEP 667: f_locals writes through
                for key, value in names.items():
                    frame.f_locals[key] = value
                return True
            import ctypes

            frame.f_locals.update(names)
            ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
        except Exception:  # noqa: BLE001 -- no CPython C API here: said instead
            return False
        return all(self._original(frame.f_locals[k]) is None for k in names)

    def _locals_held(self, frame: types.FrameType) -> Any:
        names = sorted(k for k, v in frame.f_locals.items() if self._original(v) is not None)
        if not names:
            return None
        code = frame.f_code
        return (f"the local variable{'s' * (len(names) > 1)} {', '.join(map(repr, names))}"
                f" of {code.co_name}() ({code.co_filename}:{frame.f_lineno})",
                (code.co_filename, frame.f_lineno), self._held(frame.f_locals),
                f"assign {', '.join(map(repr, names))}")

    def _metadata_only(self, obj: Any) -> bool:
        """A function's attributes holding an original as its ``__wrapped__`` only
        (functools.wraps: what ``inspect.signature`` reads, which no call goes through)."""
        return type(obj) is dict and all(
            key == "__wrapped__" for key, value in obj.items()
            if self._original(value) is not None)

    def _is_argument_tuple(self, obj: Any) -> bool:
        """The tuple ``gc.get_referrers(*originals)`` was called with."""
        return type(obj) is tuple and len(obj) == len(self._originals) and all(
            a is b for a, b in zip(obj, self._originals))

    def _held(self, obj: Any) -> list[str]:
        """The names of the originals ``obj`` holds."""
        if isinstance(obj, dict):
            values: Iterable[Any] = obj.values()
        elif isinstance(obj, functools.partial):
            values = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            values = obj
        else:
            values = gc.get_referents(obj)
        return sorted({self._name[id(v)] for v in values if self._original(v) is not None})

    def _owners(self, objs: list[Any]) -> dict[int, list[Any]]:
        """id(obj) -> what refers to it, for each of ``objs`` (one more pass)."""
        if not objs:
            return {}
        wanted = {id(o) for o in objs}
        out: dict[int, list[Any]] = {}
        for owner in gc.get_referrers(*objs):
            if isinstance(owner, types.FrameType) or id(owner) in self._ours:
                continue
            for child in gc.get_referents(owner):
                if id(child) in wanted:
                    out.setdefault(id(child), []).append(owner)
        return out

    def _swapped(self, obj: Any, owners: list[Any]) -> bool:
        """Swaps ``obj``'s references if it is a namespace or a function's defaults;
        whether it was one."""
        if type(obj) is dict:
            namespace: dict[str, Any] = obj
            for owner in owners:
                if isinstance(owner, type) and gc.get_referents(vars(owner))[0] is namespace:
                    return self._swap_class(owner, namespace)
                if _attr(owner, "__dict__") is namespace or \
                        _attr(owner, "__kwdefaults__") is namespace:
                    self._swap_in(namespace)  # a module's, an object's, keyword defaults
                    return True
            return False
        if type(obj) is tuple:
            for owner in owners:
                if isinstance(owner, types.FunctionType) and owner.__defaults__ is obj:
                    owner.__defaults__ = tuple(
                        self._wrapper[id(v)] if self._original(v) is not None else v
                        for v in obj)
                    return True
        return False

    def _swap_class(self, cls: type, namespace: dict[str, Any]) -> bool:
        for key, value in list(namespace.items()):
            w = self._wrapper.get(id(value))
            if w is None or self._original(value) is None:
                continue
            try:
                setattr(cls, key, w)
            except (TypeError, AttributeError):  # a C type's: covered if a subclass's
                # attribute shadows it
                if not any(cls in s.__mro__ and getattr(s, key, None) is w
                           for s in self._shadowing):
                    return False
        return True

    def _describe(self, obj: Any, owners: list[Any]) -> str:
        kind = ("a functools.partial" if isinstance(obj, functools.partial)
                else f"a {type(obj).__name__}")
        for owner in owners:
            namespace = _attr(owner, "__dict__")
            if isinstance(owner, types.ModuleType) or isinstance(namespace, dict):
                continue
            if type(owner) is dict:
                keys = [k for k, v in owner.items() if v is obj]
                module = self._module_of(owner)
                if keys and module:
                    return f"{kind} bound to {module}.{keys[0]}"
                if keys:
                    return f"{kind} held under {keys[0]!r}"
        return kind

    def _module_of(self, namespace: dict) -> str | None:
        for name, module in list(sys.modules.items()):
            if _attr(module, "__dict__") is namespace:
                return name
        return None

    def _location(self, obj: Any, owners: list[Any]) -> tuple[str, int]:
        for owner in owners:
            module = self._module_of(owner) if type(owner) is dict else None
            if module:
                return _attr(sys.modules[module], "__file__") or module, 1
        return "<unknown>", 0
