"""The dtype contract on torch (unified_amp/dtype_contract/): two torch function modes.

The contract is torch's CUDA autocast policy, so on CUDA torch's own AutocastCUDA
kernels keep it and nothing of ours runs: a block that covers only CUDA pushes no mode.
Where torch's own autocast differs from a row -- on the CPU, where torch's CPU policy
is another one, and on a device whose registrations differ from those the table was
derived from (an older torch) -- ``ContractMode`` keeps the row, by casting the inputs
of the row's Python spellings as torch's CUDA autocast kernels would, and computing in
float32 where a row says the device has no low-precision kernel.

The contract is a mode on torch's function-mode stack rather than a kernel on torch's
Autocast key: dynamo guards on that stack and inlines the mode's ``__torch_function__``,
so its casts become ordinary nodes of a captured graph, a graph traced with the
contract differs from one without it in every cache, and plain ``torch.autocast`` never
meets the contract.

``PromoteMode`` is pushed by an ``amp.autocast(enabled=False)`` block (with the
contract) inside an enabled block: there the ops that autocast would have cast get
their mixed floating inputs cast to the widest of them (a low-precision activation
meeting a float32 weight), which is what MegEngine does without autocast, instead of
torch's "expected the same dtype" error.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from unified_amp import rules as _rules
from unified_amp import dtype_contract as table
from unified_amp.rebinding import Rebinder

LOW = (torch.float16, torch.bfloat16)
_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)  # what autocast casts
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
# Registered on AutocastCUDA by torch's CUDA builds only (cuDNN's RNN), so absent from
# the table's CPU-build sets.
_CUDA_BUILD_ONLY = frozenset({"_cudnn_rnn"})


def resolve(spelling: str) -> Any:
    """The torch object a table spelling names ("F.softmax", "Tensor.sum",
    "torch.linalg.inv"), or None where this torch lacks it."""
    head, _, rest = spelling.partition(".")
    obj: Any = {"F": F, "Tensor": torch.Tensor, "torch": torch}[head]
    for part in rest.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _registered(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
    except RuntimeError:  # no such operator in this torch
        return False


def _recorded() -> dict[str, frozenset[str]]:
    cuda = table.CUDA_REGISTRATIONS
    if torch.backends.cuda.is_built():
        cuda = cuda | _CUDA_BUILD_ONLY
    later = {dev: frozenset(op for op, keys in table.LATER_REGISTRATIONS.items() if key in keys)
             for dev, key in _KEYS.items()}
    return {"cpu": table.CPU_REGISTRATIONS | later["cpu"], "cuda": cuda | later["cuda"]}


def drifted(row: table.Row, dev: str) -> bool:
    """Whether this torch registers ``row``'s ops on ``dev``'s Autocast key otherwise
    than the torch the table was derived from (an older torch): then what torch's own
    autocast gives the row there is not the table's to say. A row this torch predates
    (``Row.torch_since``) drifts nowhere: it has nothing to keep."""
    if not row.on_torch(torch.__version__):
        return False
    recorded = _recorded()[dev]
    return any(_registered(op, _KEYS[dev]) != (op in recorded) for op in row.aten)


def handled_devices(row: table.Row) -> frozenset[str]:
    """The device types on which torch's own autocast does not keep ``row`` by itself,
    so the contract's mode must: the CPU where torch's CPU policy differs (or the row
    computes in float32 there), and any device whose Autocast registrations of the
    row's ops differ from the table's."""
    devs = {dev for dev in _KEYS if drifted(row, dev)}
    if row.native("torch-cpu") != row.rule or any(
            place.startswith("torch-cpu") for place in row.adapt.float32_compute) \
            or _partly_registered_on_cpu(row) or row.refuse_low:
        devs.add("cpu")
    return frozenset(devs)


def _partly_registered_on_cpu(row: table.Row) -> bool:
    """A row that autocast casts (every rule but "input") some of whose ops torch's CPU
    autocast does not register: its first spelling may be kept by torch on the CPU, but
    not the others (torch.dist beside cdist, torch.convolution beside conv2d)."""
    recorded = _recorded()["cpu"]
    return row.rule not in ("input", "refuse") and any(op not in recorded for op in row.aten)


# -- the pieces every handler uses ---------------------------------------------------------

def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to every tensor in ``value`` (lists and tuples of any depth: cat's
    list, lstm's state tuple and weights)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [_map(fn, v) for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _tensors(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    return out


def _autocast_device(args: Any, kwargs: dict[str, Any], where: frozenset[str]) -> str | None:
    """The device type of the call's tensors if the contract acts there (one of
    ``where``, with autocast on), else None."""
    for t in _tensors(args, []) + _tensors(list(kwargs.values()), []):
        dev = t.device.type
        return dev if dev in where and torch.is_autocast_enabled(dev) else None
    return None


def _floating_dtypes(args: Any, kwargs: dict[str, Any], dev: str) -> set[torch.dtype]:
    return {t.dtype for t in _tensors(args, []) + _tensors(list(kwargs.values()), [])
            if t.dtype in _ELIGIBLE and t.device.type == dev}


def _cast(args: Any, kwargs: dict[str, Any], dev: str, to: torch.dtype,
          only: tuple[torch.dtype, ...] = _ELIGIBLE) -> tuple[Any, dict[str, Any]]:
    """The call's floating tensors on ``dev`` whose dtype is one of ``only``, in ``to``
    (as autocast's casts: other devices, integers, float64 and ``out=`` untouched)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(to) if t.dtype in only and t.dtype != to and t.device.type == dev else t

    return (_map(cast, args),
            {k: v if k == "out" else _map(cast, v) for k, v in kwargs.items()})


_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64}


def _returned_as(out: Any, want: torch.dtype, name: str) -> Any:
    """``out``'s floating (and complex) tensors in ``want`` (complex: its complex dtype)."""

    def back(t: torch.Tensor) -> torch.Tensor:
        if t.is_complex():
            if want not in _COMPLEX:
                raise RuntimeError(
                    f"amp.autocast: {name} on a {want} input returns a complex tensor, and"
                    f" torch has no complex {want} dtype (torch's CUDA kernels take no"
                    f" {want} input there either). Cast the input to float32 first.")
            return t.to(_COMPLEX[want]) if t.dtype != _COMPLEX[want] else t
        return t.to(want) if t.dtype in _ELIGIBLE and t.dtype != want else t

    return _map(back, out)


@contextlib.contextmanager
def _compiled_autocast_off(dev: str) -> Iterator[None]:
    with torch.autocast(dev, enabled=False):
        yield


class _EagerAutocastOff:
    """The device's autocast off for one call, as an Autocast kernel's exclusion guard
    does (no nesting count: the enclosing block keeps the weight-cast cache)."""

    __slots__ = ("dev",)

    def __init__(self, dev: str) -> None:
        self.dev = dev

    def __enter__(self) -> None:
        torch.set_autocast_enabled(self.dev, False)

    def __exit__(self, *exc: Any) -> None:
        torch.set_autocast_enabled(self.dev, True)


def _autocast_off(dev: str) -> Any:
    return _compiled_autocast_off(dev) if torch.compiler.is_compiling() \
        else _EagerAutocastOff(dev)


def _first_eligible(args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the call's first tensor that autocast would cast, or None.
    (A loop: dynamo 2.7-2.8 cannot trace ``next()`` with a default, and breaks the graph
    inside the block.)"""
    for t in _tensors(args, []) + _tensors(list(kwargs.values()), []):
        if t.dtype in _ELIGIBLE:
            return t.dtype
    return None


def _widest(dtypes: set[torch.dtype]) -> torch.dtype:
    out = torch.float16 if torch.float16 in dtypes else torch.bfloat16
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


# -- one handler per rule -------------------------------------------------------------------

Handler = Callable[[Any, Any, dict[str, Any]], Any]


def _handler(row: table.Row, where: frozenset[str]) -> Handler:
    rule, name = row.rule, row.name
    float32_places = row.adapt.float32_compute
    refuses_low = row.refuse_low  # as torch's CUDA kernels do, on every device

    def computes_in_float32(dev: str, low: torch.dtype) -> bool:
        return (f"torch-{dev}" in float32_places
                or f"torch-{dev}-{str(low).removeprefix('torch.')}" in float32_places)

    def in_float32(func: Any, args: Any, kwargs: dict[str, Any], dev: str,
                   want: torch.dtype) -> Any:
        args, kwargs = _cast(args, kwargs, dev, torch.float32)
        with _autocast_off(dev):
            out = func(*args, **kwargs)
        return _returned_as(out, want, name)

    def handle(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        dev = _autocast_device(args, kwargs, where)
        if dev is None:
            return func(*args, **kwargs)
        if refuses_low and _floating_dtypes(args, kwargs, dev) & set(LOW):
            raise RuntimeError(table.low_refusal(name))
        if rule == "float32":  # torch's fp32 kernels: low-precision inputs up
            args, kwargs = _cast(args, kwargs, dev, torch.float32, LOW)
            return func(*args, **kwargs)
        if rule == "low":
            low = torch.get_autocast_dtype(dev)
            if computes_in_float32(dev, low):
                return in_float32(func, args, kwargs, dev, low)
            args, kwargs = _cast(args, kwargs, dev, low)
            return func(*args, **kwargs)
        if rule == "refuse":
            raise RuntimeError(f"amp.autocast: {table.REFUSALS[name]}")
        dtypes = _floating_dtypes(args, kwargs, dev)
        if rule == "promote":
            if not dtypes:
                return func(*args, **kwargs)
            widest = _widest(dtypes)
            args, kwargs = _cast(args, kwargs, dev, widest)
            with _autocast_off(dev):
                return _returned_as(func(*args, **kwargs), widest, name)
        # "input": the op as without autocast; a low-precision input computed in float32
        # (where torch's own autocast on this device upcasts, or has no low kernel) and
        # returned in its dtype
        first = _first_eligible(args, kwargs)
        if row.adapt.follows_first and first in LOW or (len(dtypes) == 1 and first in LOW):
            return in_float32(func, args, kwargs, dev, first)
        with _autocast_off(dev):
            return func(*args, **kwargs)

    return handle


def _spellings(rows: Any) -> dict[Any, table.Row]:
    out: dict[Any, table.Row] = {}
    for row in rows:
        for spelling in row.torch:
            fn = resolve(spelling)
            if fn is not None:
                out.setdefault(fn, row)
    return out


def _contract_handlers() -> tuple[dict[Any, Handler], frozenset[str]]:
    handlers: dict[Any, Handler] = {}
    devices: set[str] = set()
    for fn, row in _spellings(table.ROWS).items():
        where = handled_devices(row)
        if where:
            handlers[fn] = _handler(row, where)
            devices |= where
    return handlers, frozenset(devices)


# Read once, at import, from the table and torch's dispatcher (nothing of ours is ever
# registered in it).
HANDLERS, MODE_DEVICES = _contract_handlers()


class ContractMode(TorchFunctionMode):
    """Keeps the contract's rows on the devices where torch's own autocast does not.

    Pushed by an enabled unified autocast block with ``contract=True`` whose devices
    include one of ``MODE_DEVICES`` (popped by a nested block without the contract).
    Acts only where torch's autocast is on for the tensors' device, as a kernel on
    torch's Autocast key would.
    """

    RULES: dict[Any, str] = {}  # a block's own rules: RulesMode's

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        handle = HANDLERS.get(func)
        if handle is None:
            return func(*args, **kwargs)
        return handle(func, args, kwargs)


# -- a disabled block inside an enabled one ---------------------------------------------------

# The ops whose inputs autocast casts (every row but the "input" ones): those whose
# mixed floating inputs torch refuses (matmuls, convolutions, norms) or computes in the
# wrong precision without autocast.
# (A dict, read with .get as HANDLERS is: dynamo hashes a builtin for set membership
# and fails, "Missing hash_impl override".)
PROMOTED = {fn: True for fn, row in _spellings(table.ROWS).items() if row.rule != "input"}


class PromoteMode(TorchFunctionMode):
    """Mixed floating inputs of the contract's ops cast to the widest of them, inside
    an ``amp.autocast(enabled=False)`` block that sits in an enabled one."""

    RULES: dict[Any, str] = {}  # autocast is off: no rule of a block applies

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if PROMOTED.get(func):
            tensors = _tensors(args, []) + _tensors(list(kwargs.values()), [])
            dtypes = {t.dtype for t in tensors if t.dtype in _ELIGIBLE}
            if len(dtypes) > 1:
                widest = _widest(dtypes)
                dev = tensors[0].device.type
                args, kwargs = _cast(args, kwargs, dev, widest)
        return func(*args, **kwargs)


# One instance of each serves every block: dynamo guards on the stack's mode types, and
# the modes keep no state.
CONTRACT = ContractMode()
PROMOTE = PromoteMode()


def top_mode() -> Any:
    """The contract's mode on top of torch's function-mode stack, or None."""
    n = torch._C._len_torch_function_stack()
    top = torch._C._get_function_stack_at(n - 1) if n > 0 else None
    return top if isinstance(top, (ContractMode, PromoteMode)) else None


# -- a block's own rules (amp.autocast(rules=...)) -------------------------------------------

_RULE_DEVICES = frozenset(_KEYS)


def apply_rule(kind: str, func: Any, args: Any, kwargs: dict[str, Any], name: str) -> Any:
    """``func`` called as a block's rule of ``kind`` says, where autocast is on for its
    tensors' device (CPU or CUDA alike: a rule is the block's, not a device's): the
    floating inputs cast (_rules.MEANING), the op run with that device's autocast off,
    as torch's Autocast kernels run theirs, and its floating outputs in the rule's dtype
    (computed in float32 where the contract computes the row so on this device)."""
    dev = _autocast_device(args, kwargs, _RULE_DEVICES)
    if dev is None:
        return func(*args, **kwargs)
    if kind == "refuse":
        raise RuntimeError(_rules.refusal(name))
    to: torch.dtype | None
    if kind == "low":
        to = torch.get_autocast_dtype(dev)
    elif kind == "float32":
        to = torch.float32
    elif kind == "promote":
        dtypes = _floating_dtypes(args, kwargs, dev)
        to = _widest(dtypes) if dtypes else None
    else:  # "input"
        to = _first_eligible(args, kwargs)
    compute = torch.float32 if to in LOW and _low_computed_in_float32(func, dev, to) else to
    if compute is not None:
        args, kwargs = _cast(args, kwargs, dev, compute)
    with _autocast_off(dev):
        out = func(*args, **kwargs)
    return out if to is None else _returned_as(out, to, name)


def _low_computed_in_float32(func: Any, dev: str, low: torch.dtype) -> bool:
    """Whether ``func`` spells a row that this device computes in float32 for ``low``
    (``Adapt.float32_compute``: torch's CPU has no low-precision LSTM on every ISA): a
    rule asking for ``low`` there is computed in float32 and handed back in ``low``, as
    the contract does."""
    row = _ROW_OF.get(func)
    if row is None:
        return False
    places = row.adapt.float32_compute
    return f"torch-{dev}" in places or f"torch-{dev}-{str(low).removeprefix('torch.')}" in places


class RulesMode(ContractMode):
    """ContractMode with a block's own rules over the rows: one subclass per set of
    rules (``RULES``: torch callable -> kind), so that the mode stack's types, which
    dynamo guards, tell one set from another, and a graph traced under one set is
    never served under another."""

    NAME = ""  # its attribute of _Modes

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        kind = self.RULES.get(func)
        if kind is not None:
            return apply_rule(kind, func, args, kwargs, getattr(func, "__name__", str(func)))
        handle = HANDLERS.get(func)
        if handle is None:
            return func(*args, **kwargs)
        return handle(func, args, kwargs)


class _Modes:
    """Every RulesMode made so far, one attribute each: what a block pushes is read
    from here by a constant name, so that dynamo, which reads it too, guards on it."""


# Process-wide, as dynamo's cache that they key is: each set of rules is one immutable mode,
# which any thread may push; a block's rules live on its thread's mode stack.
_mode_names: dict[frozenset, str] = {}
_names_by_rules: dict[tuple, str] = {}  # (outer, key, kind, ...) as a block gave them
_own_wrappers: dict[Any, Callable] = {}
_lock = threading.Lock()
_ROW_OF = _spellings(table.ROWS)


def _targets(key: Any) -> list[Any]:
    """The torch callables a rule's key names: a row's spellings; a framework function
    that spells a row, the row's; a custom op, its overloads (what torch's function
    mode is called with); any other torch function, itself; a program's own Python
    function, itself, once its wrapper is in the process's bindings."""
    key = getattr(key, "__unified_amp_wraps__", key)
    if isinstance(key, str):
        return [fn for fn in map(resolve, table.row(key).torch) if fn is not None]
    if _rules.foreign(key, "torch"):
        raise _rules.foreign_error(key, "torch")
    if isinstance(getattr(key, "_opoverload", None), torch._ops.OpOverload):
        return [key._opoverload]  # torch.library.custom_op's CustomOpDef
    if isinstance(key, torch._ops.OpOverloadPacket):
        return [getattr(key, name) for name in key.overloads()]
    row = _ROW_OF.get(key)
    if row is not None:
        return _targets(row.name)
    if _rules.is_own_function(key) and key not in _own_wrappers:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"amp.autocast: this block's rules name {_rules.describe(key)}, a"
                f" function of yours, for the first time inside torch.compile. Its"
                f" calls are seen through a wrapper swapped into the names that hold"
                f" it, which cannot happen while dynamo traces: make the"
                f" amp.autocast(rules=...) object once outside the compiled function"
                f" (it may be entered inside), or run one block with these rules"
                f" eagerly first.")
        wrapper: Any = _ruled(key)
        del key  # the pass swaps what holds the original; the wrapper keeps it
        Rebinder([(wrapper.__wrapped__, wrapper, _rules.describe(wrapper))],
                 keeps=None).everywhere()
        _own_wrappers[wrapper.__wrapped__] = wrapper
        return [wrapper.__wrapped__]
    return [key]


def _ruled(fn: Callable) -> Callable:
    """A program's own function as a rule sees it: the rule of the mode on top of the
    stack, if it has one for ``fn``; else ``fn`` as it is."""
    name = _rules.describe(fn)

    @functools.wraps(fn)
    def ruled(*args: Any, **kwargs: Any) -> Any:
        top = top_mode()
        kind = top.RULES.get(fn) if top is not None else None
        if kind is None:
            return fn(*args, **kwargs)
        return apply_rule(kind, fn, args, kwargs, name)

    ruled.__unified_amp_wraps__ = fn  # type: ignore[attr-defined]
    return ruled


def rules_mode_name(outer: str, *flat: Any) -> str:
    """The name in ``_Modes`` of the mode for the rules ``flat`` (key, kind, key, kind,
    ...) over those of the mode named ``outer`` ("" for none), made on first use.

    dynamo runs it as it is while it traces (marked below, as
    torch.compiler.assume_constant_result marks): it makes classes, which no trace can."""
    seen = _names_by_rules.get((outer,) + flat)
    if seen is not None:  # a block entered again with the same rules: one lookup
        return seen
    merged = dict(getattr(_Modes, outer).RULES) if outer else {}
    for key, kind in zip(flat[::2], flat[1::2]):
        for fn in _targets(key):
            merged[fn] = kind
    frozen = frozenset(merged.items())
    with _lock:
        name = _mode_names.get(frozen)
        if name is None:
            name = f"rules_{len(_mode_names)}"
            mode_type = type(f"RulesMode_{len(_mode_names)}", (RulesMode,),
                             {"RULES": merged, "NAME": name, "__module__": __name__})
            setattr(_Modes, name, mode_type())
            _mode_names[frozen] = name
        _names_by_rules[(outer,) + flat] = name
    return name


rules_mode_name._dynamo_marked_constant = True  # type: ignore[attr-defined]


def rules_mode(top: Any, rules: tuple[tuple[Any, str], ...]) -> Any:
    """The mode a block with ``rules`` pushes over the mode ``top`` (None, or the
    enclosing block's): the enclosing block's rules merged with these, these winning."""
    flat: list[Any] = []
    for key, kind in rules:
        flat.append(key)
        flat.append(kind)
    outer = top.NAME if isinstance(top, RulesMode) else ""
    return getattr(_Modes, rules_mode_name(outer, *flat))



def _never_compiled_alone() -> None:
    """Every frame of this module runs as it is when a torch call reaches the modes
    eagerly inside a compiled call (in a frame dynamo gave up on after a graph break, or
    in ``nn.LSTM``'s forward, which dynamo does not trace); code that dynamo traces
    still inlines them, so the casts stay in the caller's graph.

    Compiled as frames of their own, an eager autocast switch (``_EagerAutocastOff``)
    landed in a graph whose switches AOTAutograd drops, so an LSTM the row computes in
    float32 ran in the low dtype (oneDNN's AVX2 path has no such kernel: it raised), and
    an LSTM's own graph is one AOTAutograd cannot build (its weights are Parameters).
    Each frame is skipped by itself, not "recursively": on torch 2.7-2.8 that strategy
    is the suspect of a crash (autocast.py, ``SKIPS_RECURSIVELY``)."""
    code_type = type(_never_compiled_alone.__code__)
    codes: list[Any] = []

    def collect(code: Any) -> None:
        codes.append(code)
        for const in code.co_consts:
            if isinstance(const, code_type):
                collect(const)

    for value in list(globals().values()):
        functions = [value] if getattr(value, "__module__", None) == __name__ else []
        if isinstance(value, type) and value.__module__ == __name__:
            functions = [f for f in vars(value).values() if hasattr(f, "__code__")]
        for fn in functions:
            if hasattr(fn, "__code__"):
                collect(fn.__code__)
    for code in codes:
        torch._dynamo.eval_frame.skip_code(code)


_never_compiled_alone()
