"""The dtype contract on MegEngine (unified_amp/dtype_contract/), and MegEngine's
autocast state as a block switches it.

MegEngine decides its autocast dtypes in C++ (``dtype_promote.cpp``) and in a few Python
functions (``amp._enabled``), where no hook reaches. So the adapter wraps the Python
entry points of the rows where MegEngine's own autocast differs from the contract (or
computes wrongly: its float16 pooling on the CPU), one generic wrapper per rule, set
on ``megengine.Tensor`` for its methods and operators and swapped into every binding the
process holds of the others (unified_amp/rebinding.py: MegEngine's modules, and a program's
``from megengine.functional import softmax`` run before the first block). A wrapper
is inert unless the innermost unified block asks for the contract, and runs the op with
MegEngine's autocast off, as torch's Autocast kernels run theirs with autocast
excluded: the casts are the wrapper's.

Inside an ``amp.autocast(enabled=False)`` block nested in an enabled one, the wrappers
of the contract's cast ops (every row but the "input" ones) cast mixed floating inputs
to the widest of them, as MegEngine's own promotion does for the others (its layer
norm, given a float16 input and float32 weights without autocast, ends the process);
the "input" rows hand a low-precision input's result back in its dtype (MegEngine's
mean is float32 even without autocast).
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

import megengine
import megengine.functional as F
from megengine.core import _config
from megengine.core._imperative_rt.core2 import (
    _get_amp_high_prec_dtype,
    _get_amp_low_prec_dtype,
    _set_amp_dtype_autocast,
    _set_amp_high_prec_dtype,
    _set_amp_low_prec_dtype,
)
from megengine.core.tensor import amp as _amp_state

from unified_amp import rules as _rules
from unified_amp import dtype_contract as table

from .basics import dtype_name, on_cpu
from unified_amp.rebinding import Rebinder

# -- MegEngine's autocast state ---------------------------------------------------------------

def set_autocast(enabled: bool, low: str = "float16") -> tuple:
    """Sets MegEngine's autocast state the way megengine.amp.autocast does, returning
    what it replaced."""
    saved = (_amp_state._enabled, _get_amp_low_prec_dtype(), _get_amp_high_prec_dtype())
    _amp_state._enabled = enabled
    _set_amp_dtype_autocast(enabled)
    if enabled:
        _set_amp_high_prec_dtype("float32")
        _set_amp_low_prec_dtype(low)
    # megengine.amp.autocast sets compute_mode="float32" (float16 matmuls accumulate in
    # float32). MegEngine asserts -- asynchronously -- if a float32 matmul runs in that
    # mode, so a disabled block nested in an enabled one must put "default" back.
    configs = _config._reset_execution_config(
        compute_mode="float32" if enabled else "default")
    return saved + (configs,)


def restore_autocast(saved: tuple) -> None:
    enabled, low, high, configs = saved
    _amp_state._enabled = enabled
    _set_amp_dtype_autocast(enabled)
    _set_amp_low_prec_dtype(low)
    _set_amp_high_prec_dtype(high)
    _config._reset_execution_config(*configs)


# MegEngine's autocast state is process-global (unlike torch's, which is per thread), so
# this stack is too: what the innermost unified block asks of the wrappers.
CONTRACT, PROMOTE = "contract", "promote"
policy_stack: list[str | None] = []


def policy() -> str | None:
    return policy_stack[-1] if policy_stack else None


class _ThreadRules(threading.local):
    """The rules of the calling thread's innermost block (original function -> kind),
    per thread: a block's rules are its own, while MegEngine's autocast is the process's."""

    rules: dict[Any, str] = {}
    stack: list[dict[Any, str]]

    def __init__(self) -> None:
        self.stack = []


thread_rules = _ThreadRules()


# -- the wrappers ---------------------------------------------------------------------------------

def handled(row: table.Row) -> bool:
    """Whether MegEngine's own autocast does not keep ``row`` by itself."""
    return row.native("megengine") != row.rule or row.refuse_low or any(
        place.startswith("megengine") for place in row.adapt.float32_compute + row.adapt.wrapped)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, megengine.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return value


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    _map(out.append, (args, list(kwargs.values())))
    return out


def _floating(t: Any) -> bool:
    return dtype_name(t.dtype) in ("float16", "bfloat16", "float32")


def _name(t: Any) -> str:
    return dtype_name(t.dtype) or str(t.dtype)


def _cast(args: Any, kwargs: dict[str, Any], to: str,
          only: tuple[str, ...] = ("float16", "bfloat16", "float32")) -> tuple[Any, dict]:
    def cast(t: Any) -> Any:
        name = dtype_name(t.dtype)
        return t.astype(to) if name in only and name != to else t

    return _map(cast, args), {k: _map(cast, v) for k, v in kwargs.items()}


def _returned_as(out: Any, want: str) -> Any:
    return _map(lambda t: t.astype(want) if _floating(t) and dtype_name(t.dtype) != want
                else t, out)


def _widest(dtypes: set[str]) -> str:
    return "float32" if "float32" in dtypes else next(iter(sorted(dtypes)))


def _without_autocast(fn: Callable, args: Any, kwargs: dict[str, Any]) -> Any:
    saved = set_autocast(False)
    try:
        return fn(*args, **kwargs)
    finally:
        restore_autocast(saved)


def _contract(row: table.Row, fn: Callable, args: Any, kwargs: dict[str, Any]) -> Any:
    """``fn`` called as ``row``'s rule says, inside an enabled block."""
    tensors = _tensors(args, kwargs)
    if not tensors:
        return fn(*args, **kwargs)
    places = row.adapt.float32_compute
    if "megengine-cpu" in places and not on_cpu(tensors[0]) and "megengine" not in \
            places + row.adapt.wrapped and row.native("megengine") == row.rule:
        return fn(*args, **kwargs)  # handled for its CPU kernels only
    in_float32 = "megengine" in places or ("megengine-cpu" in places and on_cpu(tensors[0]))
    low = dtype_name(_get_amp_low_prec_dtype()) or "float16"
    dtypes = {_name(t) for t in tensors if _floating(t)}
    if row.rule == "refuse":
        raise RuntimeError(f"amp.autocast: {table.REFUSALS[row.name]}")
    if row.refuse_low and dtypes & {"float16", "bfloat16"}:
        raise RuntimeError(table.low_refusal(row.name))
    if row.rule == "float32":
        args, kwargs = _cast(args, kwargs, "float32", ("float16", "bfloat16"))
        return _without_autocast(fn, args, kwargs)
    if row.rule == "low":
        if in_float32:
            args, kwargs = _cast(args, kwargs, "float32")
            return _returned_as(_without_autocast(fn, args, kwargs), low)
        args, kwargs = _cast(args, kwargs, low)
        return _without_autocast(fn, args, kwargs)
    if row.rule == "promote":
        if not dtypes:
            return fn(*args, **kwargs)
        widest = _widest(dtypes)
        args, kwargs = _cast(args, kwargs, widest)
        return _returned_as(_without_autocast(fn, args, kwargs), widest)
    # "input": the op as without autocast; a low-precision input computed in float32
    # (where MegEngine's autocast upcasts, or its low-precision kernels fail) and
    # returned in its dtype
    first = next((_name(t) for t in tensors if _floating(t)), "")
    if row.adapt.follows_first and first in ("float16", "bfloat16") or (
            len(dtypes) == 1 and dtypes <= {"float16", "bfloat16"}):
        args, kwargs = _cast(args, kwargs, "float32")
        return _returned_as(_without_autocast(fn, args, kwargs), first)
    return _without_autocast(fn, args, kwargs)


def _promote(fn: Callable, args: Any, kwargs: dict[str, Any]) -> Any:
    """Mixed floating inputs to the widest of them (a disabled block in an enabled one)."""
    dtypes = {_name(t) for t in _tensors(args, kwargs) if _floating(t)}
    if len(dtypes) > 1:
        args, kwargs = _cast(args, kwargs, _widest(dtypes))
    return fn(*args, **kwargs)


def _following_input(fn: Callable, args: Any, kwargs: dict[str, Any]) -> Any:
    """An "input" row in a disabled block in an enabled one: MegEngine's reduce gives a
    float32 mean of a float16 input even without autocast (torch: float16), so a
    low-precision input's result is handed back in its dtype."""
    dtypes = {_name(t) for t in _tensors(args, kwargs) if _floating(t)}
    out = fn(*args, **kwargs)
    if len(dtypes) == 1 and dtypes <= {"float16", "bfloat16"}:
        return _returned_as(out, next(iter(dtypes)))
    return out


def _which(entries: list[tuple[str, str, table.Row]], fn: Callable, args: Any,
           kwargs: dict[str, Any]) -> table.Row:
    """The row a call belongs to, where one function serves several (``megengine_when``)."""
    if len(entries) == 1 or not any(name for name, _, _ in entries):
        return entries[0][2]  # several rows of one rule (F.matmul: matmul, mv, bmm)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    for name, value, row in entries:
        if not name or str(bound.arguments.get(name)) == value:
            return row
    return entries[-1][2]


# MegEngine's in-place operators: ``self._reset(result)`` of the operator's result (its
# dtype whatever it is); torch's keep the receiver's dtype. (Not ``@=``: torch has no
# in-place matmul, so ``x @= w`` is ``x = x @ w`` there, the matmul row's dtype.)
_IN_PLACE = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__",
                       "__ifloordiv__", "__imod__"})


def _in_place(result: Any, receiver: Any) -> Any:
    """``receiver`` holding ``result`` in the receiver's dtype, as torch's in-place
    operators leave it (MegEngine's would take the result's dtype)."""
    if isinstance(receiver, megengine.Tensor) and isinstance(result, megengine.Tensor):
        if result is not receiver:
            if dtype_name(result.dtype) != dtype_name(receiver.dtype) and _floating(result):
                result = result.astype(receiver.dtype)
            receiver._reset(result)
        return receiver
    return result


def _wrapper(fn: Callable, entries: list[tuple[str, str, table.Row]],
             name: str = "") -> Callable:
    in_place = name in _IN_PLACE

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = policy()
        if state is None:
            return fn(*args, **kwargs)
        rules = thread_rules.rules
        if rules and state == CONTRACT and _amp_state._enabled:
            kind = rules.get(fn)
            if kind is not None:
                return apply_rule(kind, fn, args, kwargs, name or fn.__name__)
            return _rules_off(wrapped, args, kwargs)
        if in_place and args and isinstance(args[0], megengine.Tensor):
            # the operator itself (``x / y``: wrapped or not, as its own row says), its
            # result kept in the receiver, in the receiver's dtype
            operator = getattr(type(args[0]), name.replace("__i", "__", 1))
            return _in_place(operator(*args, **kwargs), args[0])
        row = _which(entries, fn, args, kwargs)
        if state == CONTRACT:
            if not _amp_state._enabled or not handled(row):
                return fn(*args, **kwargs)
            return _contract(row, fn, args, kwargs)
        if row.rule == "input":
            return _following_input(fn, args, kwargs)
        return _promote(fn, args, kwargs)

    wrapped.__unified_amp_wraps__ = fn  # type: ignore[attr-defined]
    return wrapped


def resolve(spelling: str) -> tuple[Any, str, Any]:
    """(where it is bound, its name there, the object) for a table spelling
    ("F.softmax", "F.nn.layer_norm", "Tensor.__truediv__")."""
    head, _, rest = spelling.partition(".")
    owner: Any = {"F": F, "Tensor": megengine.Tensor}[head]
    *path, name = rest.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name, None)


def _rows_by_function() -> dict[tuple[int, str], tuple[Any, str, Any, list]]:
    out: dict[tuple[int, str], tuple[Any, str, Any, list]] = {}
    for row in table.ROWS:
        if not (handled(row) or row.rule != "input"):
            continue
        when = row.adapt.megengine_when.partition("=")
        for spelling in row.megengine:
            owner, name, fn = resolve(spelling)
            if fn is None:
                continue
            key = (id(fn), name)
            entry = out.setdefault(key, (owner, name, fn, []))
            if all(r is not row for _, _, r in entry[3]):
                entry[3].append((when[0], when[2], row))
    return out


# Process-wide, as MegEngine's namespaces are: the wrappers, once swapped into the
# process's bindings, stay there (inert outside a unified block; nothing restores the
# originals, as nothing restores megengine.functional's), so what was swapped is the
# process's fact, not a block's or a scaler's.
_rebinder: Rebinder | None = None


def install() -> None:
    """Wraps the contract's MegEngine functions, once, wherever the process holds them
    (unified_amp/rebinding.py: MegEngine's modules, ``megengine.Tensor``, and what the program bound
    before, such as ``from megengine.functional import softmax``); at a later outermost
    block, swaps them into the modules imported since."""
    global _rebinder
    if _rebinder is None:
        _rebinder = _wrapped()
        _rebinder.everywhere()
    elif not policy_stack:
        _rebinder.new_modules()


def _wrapped() -> Rebinder:
    """The wrappers, set on ``megengine.Tensor`` for its methods and operators (its C
    base takes no attribute); the module functions are left to ``Rebinder``. Holds no
    original once it returns, so that the Rebinder's pass finds only the process's."""
    wrapped = []
    for owner, name, fn, entries in _rows_by_function().values():
        wrapper = _wrapper(fn, entries, name)
        if isinstance(owner, type):
            setattr(owner, name, wrapper)
        where = "megengine.Tensor" if owner is megengine.Tensor else owner.__name__
        wrapped.append((fn, wrapper, f"{where}.{name}"))
    return Rebinder(wrapped, shadowing=(megengine.Tensor,))


def module_functions() -> list[tuple[str, Callable]]:
    """(public name, wrapper) of each module-level function the contract wraps, once
    installed (what ``tests/contract/test_early_bindings.py`` binds early)."""
    if _rebinder is None:
        return []
    return [(name, w) for name, w in _rebinder.wrappers()
            if not name.startswith("megengine.Tensor.")]


# -- a block's own rules (amp.autocast(rules=...)) --------------------------------------------

def _rules_off(fn: Callable, args: Any, kwargs: dict[str, Any]) -> Any:
    """A framework function the block's rules do not name, run with no rule in force for
    what it calls inside (``F.normalize``'s ``F.norm``): on torch, whose function mode
    runs a torch function's body with itself off, a rule reaches only the calls the
    program makes, and so it does here."""
    rules = thread_rules.rules
    thread_rules.rules = {}
    try:
        return fn(*args, **kwargs)
    finally:
        thread_rules.rules = rules


def apply_rule(kind: str, fn: Callable, args: Any, kwargs: dict[str, Any], name: str) -> Any:
    """``fn`` called as a block's rule of ``kind`` says (_rules.MEANING): the floating
    inputs cast, the op run with MegEngine's autocast off, its floating outputs in the
    rule's dtype (MegEngine's reductions hand a float16 input's mean back in float32).
    Where the op is a row whose low-precision kernels MegEngine lacks or computes wrongly
    here (``Adapt.float32_compute``), a low dtype is computed in float32 and handed back
    in it, as the contract does."""
    floating = [t for t in _tensors(args, kwargs) if _floating(t)]
    if not floating:
        return fn(*args, **kwargs)
    if kind == "refuse":
        raise RuntimeError(_rules.refusal(name))
    if kind == "low":
        to = dtype_name(_get_amp_low_prec_dtype()) or "float16"
    elif kind == "float32":
        to = "float32"
    elif kind == "promote":
        to = _widest({_name(t) for t in floating})
    else:  # "input"
        to = _name(floating[0])
    compute = "float32" if to != "float32" and _low_computed_in_float32(fn, floating[0]) \
        else to
    args, kwargs = _cast(args, kwargs, compute)
    return _returned_as(_without_autocast(fn, args, kwargs), to)


# Rows whose float16 kernel on MegEngine's CPU build ends the process (a double free),
# which the contract never runs (its rule promotes to the float32 weight): a rule asking
# for a low dtype there gets it computed in float32 instead.
_LOW_ENDS_THE_PROCESS = frozenset({"local conv2d"})


def _low_computed_in_float32(fn: Callable, first: Any) -> bool:
    if not _ROW_OF:
        _ROW_OF.update(_row_functions())
    found = _ROW_OF.get(id(fn))
    if found is None or found[0] is not fn:
        return False
    places = found[1].adapt.float32_compute
    if found[1].name in _LOW_ENDS_THE_PROCESS:
        places += ("megengine-cpu",)
    return "megengine" in places or ("megengine-cpu" in places and on_cpu(first))


def _ruled(fn: Callable, name: str) -> Callable:
    """A function no row wraps, as a block's rule sees it. A framework function the
    rules do not name keeps them off the calls it makes inside (``_rules_off``); a
    program's own function does not: torch's function mode sees those calls too."""
    framework = not _rules.is_own_function(fn)

    @functools.wraps(fn)
    def ruled(*args: Any, **kwargs: Any) -> Any:
        rules = thread_rules.rules
        if rules and policy() == CONTRACT and _amp_state._enabled:
            kind = rules.get(fn)
            if kind is not None:
                return apply_rule(kind, fn, args, kwargs, name)
            if framework:
                return _rules_off(fn, args, kwargs)
        return fn(*args, **kwargs)

    ruled.__unified_amp_wraps__ = fn  # type: ignore[attr-defined]
    return ruled


# Process-wide, as the bindings they are swapped into: the functions a rule has named
# that no row wraps, each with its wrapper.
_rule_wrappers: dict[Any, Callable] = {}


def _row_functions() -> dict[int, tuple[Any, table.Row]]:
    """id(original) -> (original, the row it spells), for MegEngine's spellings."""
    out: dict[int, tuple[Any, table.Row]] = {}
    for row in table.ROWS:
        for spelling in row.megengine:
            fn = _original(resolve(spelling)[2])
            if fn is not None:
                out.setdefault(id(fn), (fn, row))
    return out


def _original(fn: Any) -> Any:
    return getattr(fn, "__unified_amp_wraps__", fn)


_ROW_OF: dict[int, tuple[Any, table.Row]] = {}


def _targets(key: Any) -> list[tuple[Any, str, Any]]:
    """(owner or None, name, original) of each MegEngine callable a rule's key names."""
    if isinstance(key, str):
        out = []
        for spelling in table.row(key).megengine:
            owner, name, fn = resolve(spelling)
            if fn is not None:
                out.append((owner, name, _original(fn)))
        return out
    if _rules.foreign(key, "megengine"):
        raise _rules.foreign_error(key, "megengine")
    key = _original(key)
    if not _ROW_OF:
        _ROW_OF.update(_row_functions())
    found = _ROW_OF.get(id(key))
    if found is not None and found[0] is key:
        return _targets(found[1].name)
    name = getattr(key, "__name__", "")
    owner = megengine.Tensor if _original(getattr(megengine.Tensor, name, None)) is key \
        else None
    return [(owner, name, key)]


# A block's rules as it gave them -> what they resolved to (immutable once made): a
# block entered again with the same rules, each step, resolves them with one lookup.
_resolved: dict[tuple, dict[Any, str]] = {}


def resolve_rules(rules: tuple[tuple[Any, str], ...]) -> dict[Any, str]:
    """A block's rules as original function -> kind, each function given a wrapper
    that sees it (a row's, or one of its own, swapped into the process's bindings)."""
    seen = _resolved.get(rules)
    if seen is not None:
        return seen
    out: dict[Any, str] = {}
    fresh = []
    wrapped = {id(_original(w)) for _, w in (_rebinder.wrappers() if _rebinder else [])}
    for key, kind in rules:
        for owner, name, fn in _targets(key):
            out[fn] = kind
            if id(fn) in wrapped or fn in _rule_wrappers:
                continue
            wrapper = _ruled(fn, _rules.describe(fn))
            _rule_wrappers[fn] = wrapper
            if isinstance(owner, type):
                setattr(owner, name, wrapper)
            fresh.append((fn, wrapper, _rules.describe(fn)))
    if fresh:
        Rebinder(fresh, shadowing=(megengine.Tensor,), keeps=None).everywhere()
    _resolved[rules] = out
    return out
