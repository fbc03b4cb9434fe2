"""Autocasting: torch.autocast per device, and the dtype contract, both in a form that
``torch.compile`` traces on every torch the extra admits (docs/COMPILE.md).

The contract is a ``TorchFunctionMode`` (dtype_contract.py) on torch's function-mode
stack rather than a Python flag read inside dispatcher kernels, pushed where a block's
devices need it (the CPU; on CUDA torch's own policy is the contract). Dynamo guards on
that stack and inlines the mode's ``__torch_function__``, so its casts become ordinary
nodes of the captured graph: a graph traced with the contract differs from one traced
without it, in dynamo's cache and in AOTAutograd's and inductor's (also on disk), and
plain ``torch.autocast`` never meets the contract. Eagerly the mode does the same casts,
so eager and compiled code agree.

A block has three forms, picked when it is made or entered:

- eagerly, autocast's state is switched directly (what ``torch.autocast.__enter__``
  does, without building one per device) and the mode pushed;
- while dynamo traces, a generator of ``with torch.autocast(...)`` statements and the
  mode, which dynamo 2.7-2.14 records as torch.autocast's own ``_enter_autocast`` /
  ``_exit_autocast`` nodes;
- while dynamo traces a block that is one ``torch.autocast`` and nothing else (one
  device, no contract to push or pop), on a dynamo that knows the type of such an
  object (torch >= 2.12), ``amp.autocast(...)`` *is* that ``torch.autocast``, so a graph
  break inside it splits the graph as it does inside ``torch.autocast``.

A graph break inside any other block makes dynamo give up on the frame that holds it
(a user-defined context manager cannot be resumed): the frame runs eagerly, and the
functions it calls are compiled on their own, with the block's state in force. That
is correct but slower, so it is said once (:class:`unified_amp.CompileWarning`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
import weakref
from typing import Any, Iterator

import torch

from unified_amp import interface
from unified_amp.autocast import autocast as amp_autocast
from unified_amp.errors import CompileWarning, UnsupportedPrecisionError

from . import autocast_dynamo
from .autocast_dynamo import never_a_frame_of_its_own
from .basics import DTYPES, default_dtype, devices
from .dtype_contract import (CONTRACT, MODE_DEVICES, PROMOTE, RulesMode, rules_mode,
                             rules_mode_name, top_mode)


@torch.compiler.assume_constant_result
def _cuda_lacking_bfloat16() -> str:
    """The current CUDA device's name if it does not compute bfloat16, else "".

    Asked on each block's entry, which may be inside a compiled function. Dynamo cannot
    put ``torch.cuda``'s queries in a graph (they return a bool or a str, not a tensor):
    asked there directly, they break the graph, and ``fullgraph=True`` fails, on a GPU
    machine only. The answer is a fact of the hardware, so dynamo may ask it once, while
    tracing, and keep it as a constant of the graph.
    """
    return "" if torch.cuda.is_bf16_supported() else torch.cuda.get_device_name()


def _contract_action(enabled: bool, contract: bool, devs: list[str],
                     rules: tuple[tuple[Any, str], ...] = ()) -> Any:
    """What a block does to the mode stack: None, or (the mode it takes off the top, the
    mode it puts there), either None.

    An enabled block with the contract puts ContractMode on top where one of its devices
    needs it (none on CUDA: torch's CUDA policy is the contract); an enabled block
    without the contract takes ours off; a disabled block with the contract inside an
    enabled one puts PromoteMode on top. Otherwise the stack stays as it is, and so
    does what the enclosing block put there. A block with rules, or inside one, puts
    the RulesMode of its rules merged over the enclosing block's, on every device (a
    rule is the block's: CUDA's kernels do not know it)."""
    top = top_mode()
    want: Any
    if not contract:
        want = None
    elif enabled and rules:
        want = rules_mode(top, rules)
    elif enabled and isinstance(top, RulesMode):
        want = top
    elif enabled:
        # an enclosing block's ContractMode stays for the devices this one leaves on
        want = CONTRACT if any(dev in MODE_DEVICES for dev in devs) or top is CONTRACT \
            else None
    elif torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        want = PROMOTE
    else:
        want = top
    return None if want is top else (top, want)


# -- a block as dynamo traces it ----------------------------------------------------------

@contextlib.contextmanager
def _mode_popped(mode: Any) -> Iterator[None]:
    """``mode`` taken off the mode stack for a nested block, and put back after."""
    torch._C._pop_torch_function_stack()
    yield
    torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _contract_as(action: Any) -> Iterator[None]:
    if action is None:
        yield
        return
    popped, pushed = action
    with _mode_popped(popped) if popped is not None else contextlib.nullcontext():
        with pushed if pushed is not None else contextlib.nullcontext():
            yield


@contextlib.contextmanager
def _traced_block(devs: list[str], dtypes: list[torch.dtype], enabled: bool,
                  action: Any) -> Iterator[None]:
    """The block inside a function dynamo compiles: ``with torch.autocast(...)``
    statements and the contract's mode, in a generator.

    dynamo traces a generator context manager entered in one call and left in another
    (every torch from 2.7 on), and inside it it meets ``torch.autocast`` as the subject
    of a ``with`` statement, which it records as the ``_enter_autocast`` /
    ``_exit_autocast`` nodes torch.autocast's own blocks give; the mode's entry is the
    mode-stack push it guards on. At most two devices (CPU and CUDA), spelled out: a
    loop over an ExitStack would not be traced whole.
    """
    with torch.autocast(devs[0], dtype=dtypes[0], enabled=enabled):
        if len(devs) == 1:
            with _contract_as(action):
                yield
        else:
            with torch.autocast(devs[1], dtype=dtypes[1], enabled=enabled):
                with _contract_as(action):
                    yield


class _TracedBlock:
    """Holds a traced block's generator. Handed back from a function as it is, a
    generator context manager makes dynamo 2.7-2.10 fail when a graph break has it
    rebuild the frame's values; an object holding one it can rebuild."""

    def __init__(self, devs: list[str], dtypes: list[torch.dtype], enabled: bool,
                 action: Any) -> None:
        self.block = _traced_block(devs, dtypes, enabled, action)
        self.block.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.block.__exit__(None, None, None)


# -- a block run eagerly ------------------------------------------------------------------

class _EagerBlock:
    """torch.autocast's entry and exit for each device, switched directly, and the
    contract's mode.

    torch.autocast builds an object per device and asks CUDA whether it may run there;
    ``check_precision`` has asked that already, so a block switches the thread's autocast
    state as ``torch.autocast.__enter__`` / ``__exit__`` do, and nothing else. Where a
    torch function mode is in force (torch.export's pre-dispatch mode records autocast
    regions through one, and nested blocks run under the contract's), it enters real
    ``torch.autocast`` objects, so such modes see what they expect.
    """

    __slots__ = ("devs", "dtypes", "enabled", "action", "saved", "contexts")

    def __init__(self, devs: list[str], dtypes: list[torch.dtype], enabled: bool,
                 action: Any) -> None:
        self.devs, self.dtypes, self.enabled, self.action = devs, dtypes, enabled, action
        self.saved: list[tuple[bool, torch.dtype]] = []
        self.contexts: list[Any] = []

    def __enter__(self) -> None:
        if torch._C._is_torch_function_mode_enabled():
            self.contexts = [torch.autocast(dev, dtype=dtype, enabled=self.enabled)
                             for dev, dtype in zip(self.devs, self.dtypes)]
            for ctx in self.contexts:
                ctx.__enter__()
        else:
            for dev, dtype in zip(self.devs, self.dtypes):
                self.saved.append((torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
                torch.set_autocast_enabled(dev, self.enabled)
                torch.set_autocast_dtype(dev, dtype)
                torch.autocast_increment_nesting()
        if self.action is not None:
            popped, pushed = self.action
            if popped is not None:
                torch._C._pop_torch_function_stack()
            if pushed is not None:
                torch._C._push_on_torch_function_stack(pushed)

    def __exit__(self, *exc: Any) -> None:
        if self.action is not None:
            popped, pushed = self.action
            if pushed is not None:
                torch._C._pop_torch_function_stack()
            if popped is not None:
                torch._C._push_on_torch_function_stack(popped)
        if self.contexts:
            for ctx in reversed(self.contexts):
                ctx.__exit__(None, None, None)
            return
        for dev, (enabled, dtype) in zip(reversed(self.devs), reversed(self.saved)):
            # torch.autocast's exit: the weight-cast cache lives until the outermost
            # block of the thread ends.
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled(dev, enabled)
            torch.set_autocast_dtype(dev, dtype)


@torch.compiler.disable
def _exit_eagerly(block: _EagerBlock) -> None:
    """A block entered eagerly and left in compiled code (dynamo resumed inside it, or
    compiles the block's exit as a frame of its own): torch.autocast objects made
    eagerly cannot be left in a trace."""
    block.__exit__()


@torch.compiler.disable
def _enter_eagerly(devs: list[str], dtypes: list[torch.dtype], enabled: bool,
                   action: Any) -> _EagerBlock:
    """A block's entry that dynamo compiles as a frame of its own (torch 2.7-2.8, where
    the entry carries no skip strategy: `never_a_frame_of_its_own`): the frame holding
    the block runs eagerly, so the block is entered eagerly too, as it is there. In a
    graph of its own its switches would be dropped when that graph returns."""
    _warn_for_abandoned_codes()
    block = _EagerBlock(devs, dtypes, enabled, action)
    block.__enter__()
    return block


# -- blocks dynamo gave up on ---------------------------------------------------------------

# Code objects of functions whose trace entered a block and never left it: dynamo gave
# up on the frame (a graph break inside the block) and is about to run it eagerly. Each
# with the trace that entered (a weak reference to dynamo's root translator: a restarted
# analysis is a new one) and how many of its blocks are open: a nested block left before
# the break must not take the frame off the list.
_abandoned: dict[Any, tuple[Any, int]] = {}  # in the order the traces entered their blocks
_warned: set[Any] = set()


def _current_trace() -> Any:
    """dynamo's root translator (the frame it is compiling), asked while it traces."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:  # dynamo's internals moved: no warning rather than a failure
        return None


def _traced_frame_code() -> Any:
    """The code dynamo is compiling (its root frame), asked while it traces."""
    tx = _current_trace()
    return getattr(tx, "f_code", None)


def _trace_entered() -> None:
    tx = _current_trace()
    code = getattr(tx, "f_code", None)
    if code is None:
        return
    trace, depth = _abandoned.pop(code, (None, 0))  # to the end: the latest trace
    _abandoned[code] = (weakref.ref(tx), depth + 1 if trace is not None and trace() is tx else 1)


def _trace_left() -> None:
    code = _traced_frame_code()
    if code not in _abandoned:
        return
    trace, depth = _abandoned[code]
    if depth > 1:
        _abandoned[code] = (trace, depth - 1)
    else:
        del _abandoned[code]


# dynamo runs these as they are while it traces (the marker torch.compiler.
# assume_constant_result sets), instead of tracing them: they note a fact of the trace.
def _block_is_its_own_frame() -> bool:
    """Whether dynamo is compiling the block's own entry or exit as the root of a trace
    (called from a frame it gave up on) rather than inlining it into the user's."""
    return _traced_frame_code() in _BLOCK_CODES


def _warn_for_abandoned_codes() -> None:
    """The CompileWarning of a block entered through `_enter_eagerly`, named from the
    code dynamo gave up on: the frames between here and the user's are dynamo's, and
    no frame object is made for them (issue 33)."""
    if not _abandoned:
        return
    code = next(reversed(_abandoned))  # the last trace given up on: the frame now eager
    del _abandoned[code]
    if code in _warned or code.co_name == "wrapper" and code.co_filename == _DECORATOR_FILE:
        return  # the decorator's own frame holds nothing but the call it wraps
    _warned.add(code)
    warnings.warn_explicit(_gave_up_message(code, code.co_firstlineno), CompileWarning,
                           code.co_filename, code.co_firstlineno)


_trace_entered._dynamo_marked_constant = True  # type: ignore[attr-defined]
_trace_left._dynamo_marked_constant = True  # type: ignore[attr-defined]
_block_is_its_own_frame._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _warn_if_dynamo_gave_up(frame: Any) -> None:
    """Warns once per function when a block that dynamo traced is entered eagerly after
    all, inside a compiled call."""
    code = frame.f_code
    _abandoned.pop(code, None)
    if code in _warned or code.co_name == "wrapper" and code.co_filename == _DECORATOR_FILE:
        return  # the decorator's own frame holds nothing but the call it wraps
    outer = frame.f_back
    while outer is not None and outer.f_code.co_filename != _EVAL_FRAME_FILE:
        outer = outer.f_back
    if outer is None:  # not inside a compiled call: dynamo's trace failed and raised
        return
    _warned.add(code)
    warnings.warn(_gave_up_message(code, frame.f_lineno), CompileWarning, stacklevel=4)


def _gave_up_message(code: Any, line: int) -> str:
    return (
        f"amp.autocast: a graph break in {code.co_name} ({code.co_filename}:{line}), before"
        f" or inside its amp.autocast block, made torch.compile give up on that function"
        f" (torch {torch.__version__}): it runs eagerly, and only the"
        f" functions it calls are compiled, with the block's autocast state and contract"
        f" in force. For graph pieces as torch.autocast gives: move the body into a"
        f" function decorated with @amp.autocast(...), which splits at the break on every"
        f" torch; or, on one device without the contract and torch >= 2.12, use"
        f" amp.autocast(..., contract=False), which is torch.autocast there; or remove"
        f" the break (torch.compile(fullgraph=True) names it). docs/COMPILE.md, 'Graph"
        f" breaks'.")


def _dynamo_types_autocast_objects() -> bool:
    """Whether dynamo knows the Python type of a torch.autocast object it made while
    tracing (torch >= 2.12). It needs to, where ``amp.autocast(...)`` returns one: a
    class whose ``__new__`` returns another object is followed by an ``isinstance`` check
    that older dynamos cannot answer, and fail."""
    try:
        from torch._dynamo.variables.ctx_manager import AutocastModeVariable

        return "python_type" in vars(AutocastModeVariable)
    except Exception:  # dynamo's internals moved: keep to the generator form
        return False


_NATIVE = _dynamo_types_autocast_objects()


def _made_for_a_with_statement() -> bool:
    """Whether the frame dynamo compiles enters what it is making at once, in a ``with``
    statement (its next instruction), rather than keeping it: a torch.autocast object
    is entered once, while an ``amp.autocast`` object may be entered again, nested in
    itself. Asked while dynamo traces; anything unexpected answers no."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        at = tx.instruction_pointer
        return at is not None and tx.instructions[at].opname in ("BEFORE_WITH", "SETUP_WITH")
    except Exception:
        return False


_made_for_a_with_statement._dynamo_marked_constant = True  # type: ignore[attr-defined]


class Autocasting(interface.Autocasting):
    """Switching autocast on and off, and which precisions a device computes."""

    def check_precision(self, dtype: str | None, device: str | None) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise UnsupportedPrecisionError(
                "autocast(device='cuda') was requested, but torch sees no CUDA device"
                f" (torch {torch.__version__}). Use device='cpu' or device=None."
            )
        for dev in devices(device, True):
            want = dtype or default_dtype(dev)
            lacking = dev == "cuda" and want == "bfloat16" and _cuda_lacking_bfloat16()
            if lacking:
                raise UnsupportedPrecisionError(
                    f"autocast dtype 'bfloat16' is not supported by this CUDA device"
                    f" ({lacking}); use dtype='float16'."
                )

    def native_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                        contract: bool) -> Any:
        if not (_NATIVE and torch.compiler.is_compiling()):
            return None
        devs = devices(device, enabled)
        if len(devs) != 1 or _contract_action(enabled, contract, devs) is not None \
                or not _made_for_a_with_statement():
            return None
        autocast_dynamo.release_dead_guards()
        return torch.autocast(devs[0], dtype=DTYPES[dtype or default_dtype(devs[0])],
                              enabled=enabled)

    def prepare_rules(self, rules: tuple[tuple[Any, str], ...]) -> None:
        if rules and not torch.compiler.is_compiling():
            flat = [item for pair in rules for item in pair]
            rules_mode_name("", *flat)  # resolved, and own functions' wrappers swapped in

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True, rules: tuple[tuple[Any, str], ...] = ()
                       ) -> Any:
        devs = devices(device, enabled)
        dtypes = [DTYPES[dtype or default_dtype(dev)] for dev in devs]
        action = _contract_action(enabled, contract, devs, rules)
        if torch.compiler.is_compiling():
            autocast_dynamo.release_dead_guards()
            if _block_is_its_own_frame():
                return _enter_eagerly(devs, dtypes, enabled, action)
            _trace_entered()
            return _TracedBlock(devs, dtypes, enabled, action)
        if _abandoned:
            _warn_if_dynamo_gave_up(sys._getframe(2))
        block = _EagerBlock(devs, dtypes, enabled, action)
        block.__enter__()
        return block

    def exit_autocast(self, token: Any) -> None:
        if isinstance(token, _TracedBlock):
            token.__exit__()
            _trace_left()
        elif torch.compiler.is_compiling():
            _exit_eagerly(token)
        else:
            token.__exit__()

    def is_autocast_enabled(self) -> bool:
        return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")

    def autocast_low_dtype(self, device: str) -> str | None:
        if not torch.is_autocast_enabled(device):
            return None
        return str(torch.get_autocast_dtype(device)).removeprefix("torch.")


_ENTRY_AND_EXIT = (amp_autocast.__new__, amp_autocast.__init__, amp_autocast.__enter__,
                   amp_autocast.__exit__, Autocasting.enter_autocast, Autocasting.exit_autocast)
_BLOCK_CODES = frozenset(fn.__code__ for fn in _ENTRY_AND_EXIT)
# torch 2.7 and 2.8 crashed (a segmentation fault, a double free, CPython 3.10, 3.12 and
# 3.13) in a process that had run a block's entry under this "skip, recursively" strategy
# -- set by hand, a strategy dynamo itself hands out rarely -- and later reset dynamo and
# compiled (docs/VERSIONS.md, "Failures explained"). There the entry and exit carry no
# strategy, and a block sees dynamo compile them as frames of their own
# (`_block_is_its_own_frame`) and enters and leaves eagerly; every later torch keeps it.
SKIPS_RECURSIVELY = torch.torch_version.TorchVersion(torch.__version__) >= "2.9"
if SKIPS_RECURSIVELY:
    never_a_frame_of_its_own(*_ENTRY_AND_EXIT[:4])
    # The adapter's side of a block as well: marked here, before any of them can run. On
    # the library's first use, amp.autocast's own __enter__ is already running when the
    # adapter is imported (it imports it), so its mark comes too late for that call, and
    # dynamo, where it runs the calling frame eagerly, would compile these on their own:
    # the eager entry's autocast switches in a graph of their own, whose switches are
    # lost (the block was not in force, silently: issue 33).
    never_a_frame_of_its_own(Autocasting.check_precision, Autocasting.enter_autocast,
                              Autocasting.exit_autocast)
# A block object made outside the compiled function is traced as one made inside it.
OUTSIDE_BLOCKS_TRACED = autocast_dynamo.install(amp_autocast)
_DECORATOR_FILE = inspect.getsourcefile(amp_autocast)
_EVAL_FRAME_FILE = inspect.getsourcefile(torch._dynamo.eval_frame)
