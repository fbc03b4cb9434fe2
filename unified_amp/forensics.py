"""Overflow forensics: when GradScaler skips a step, say where the inf/NaN came from.

Two parts, both written once here over the adapter's primitives:

- **Gradient reports.** Every check a GradScaler makes carries a hook. When the check's
  verdict is read on the host and says "overflow", the hook counts the inf and NaN
  elements of each gradient it covered and records an :class:`OverflowReport`: which
  parameters (by name, for models given to ``GradScaler.watch()`` or traced), inf or
  NaN, the loss and the scale. The counts, the loss and any trace flags come back in
  one host read (``Backend.read_overflow``), so an overflow step syncs twice: its
  verdict, then its report. Nothing runs on a clean step: the hook is a Python
  object that is dropped unread.
  A run of skipped steps that goes on (``warn_after`` in a row, or the scale below
  ``warn_below``) raises one :class:`OverflowWarning` per run.
- **Forward tracing** (opt-in, :func:`trace_forward`). A forward hook on every
  submodule leaves a device-side "all finite" flag for each output
  (``Backend.finite_flag``: no host read). Only when a report is made are the flags
  read, in the report's one read, to name the first module in execution order whose
  output was non-finite, and the dtype it ran in; the model's own input is checked
  per sample.
  Outside a ``trace_forward`` block no hook is installed.

Each trace keeps its own flags; each GradScaler reads those recorded since its own last
``update()``, and flags are dropped only once every live scaler has passed them, so two
scalers in one process never clear or read each other's.

One scaler's side is :class:`ScalerForensics`, its reports, history and warning state:
the scaler's state machine announces what happened (the scale went out, a check found
an inf/NaN, an update was counted), and it listens. The machine imports nothing of this
module.

Reports read the same on both backends: parameter names are the frameworks' dotted
module paths (the same for the same model), sorted, and the wording is fixed here.
"""

from __future__ import annotations

import collections
import itertools
import math
import re
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import _foreign, _tracing
from .capabilities import ForensicsProbes, capability, require
from .errors import OverflowWarning, _user_stacklevel
from .interface import LOW_PRECISION
from ._registry import get_backend
from ._pin_hint import pin_expression

__all__ = ["OverflowReport", "BadGradient", "NonFiniteOutput", "OverflowWarning",
           "ForwardTrace", "trace_forward"]

_FLOATING = ("float16", "bfloat16", "float32", "float64")
_LISTED = 5  # gradients named in a report line; the rest are counted


@dataclass(frozen=True)
class BadGradient:
    """One gradient that held inf/NaN elements.

    Attributes:
        name: the parameter's dotted name in a watched or traced model, else
            ``"param[i]"``: its position among the parameters checked together.
        shape: the gradient's shape.
        inf: how many elements were +-inf.
        nan: how many were NaN.
    """

    name: str
    shape: tuple[int, ...]
    inf: int
    nan: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        kinds = [f"{n} {k}" for n, k in ((self.inf, "inf"), (self.nan, "NaN")) if n]
        return f"{self.name} ({' + '.join(kinds)} of {self.numel})"


@dataclass(frozen=True)
class NonFiniteOutput:
    """The first traced module whose forward output held inf/NaN.

    Attributes:
        module: its dotted name in the traced model ("" is the model itself).
        type: its class name (``Linear``).
        dtype: the dtype of that output ("float16" means autocast ran it in float16).
        pin: the module as a Python expression on the model, ``model.encoder.layer3``
            or ``model[1]``: named from a model given to ``GradScaler.watch()`` when it
            holds the module, else from the traced model.
    """

    module: str
    type: str
    dtype: str
    pin: str = "model"

    @property
    def fix(self) -> str:
        """The call that runs this module in float32: ``amp.keep_float32(model.x)``."""
        return f"amp.keep_float32({self.pin})"

    def describe(self) -> str:
        return f"{self.module or '(model)'} ({self.type}, {self.dtype})"


@dataclass(frozen=True)
class OverflowReport:
    """What one overflowing gradient check found. Plain data; ``as_dict()`` for logs.

    Attributes:
        step: the scaler step it decided (1 for the first ``update()``).
        scale: the loss scale the gradients were scaled by.
        loss: the value of a loss given to ``scale()`` or ``backward()`` in this
            iteration (the first of a list): the first that is inf/NaN, else, with
            several (micro-batches accumulated), the largest in magnitude, else the one;
            None if none was a one-element tensor (the scale handed out as
            ``scale_factor``).
        checked: how many gradients the check covered.
        gradients: those that held inf/NaN, sorted by name.
        traced: whether a :func:`trace_forward` block recorded this step's forward.
        first_nonfinite: the first traced module with a non-finite output, or None.
        bad_samples: indices (along the batch dimension) of the traced model's input
            samples that held inf/NaN.
        forward_in_trace: the forward ran inside a traced function
            (``megengine.jit.trace``), whose outputs :func:`trace_forward` cannot read
            back, so ``traced`` is False.
        overflows_since_update: the checks since the last ``update()`` that found an
            inf/NaN, this one included (more than 1 in a step with several optimizers,
            or where a loop unscales again without calling ``update()``, which alone
            backs the scale off).
        micro_batch: which of the iteration's losses ``loss`` is (1 for the first),
            or None without one.
        micro_batches: how many losses went out scaled in this iteration (the
            micro-batches of an accumulation).
    """

    step: int
    scale: float
    loss: float | None
    checked: int
    gradients: tuple[BadGradient, ...]
    traced: bool
    first_nonfinite: NonFiniteOutput | None
    bad_samples: tuple[int, ...]
    forward_in_trace: bool = False
    overflows_since_update: int = 1
    micro_batch: int | None = None
    micro_batches: int = 1

    @property
    def cause(self) -> str:
        """Where the inf/NaN most likely came from, as a short code.

        ``"elsewhere"``: no gradient checked here held one; the skip was agreed with
        another process (a distributed job, where every rank skips together).
        ``"input"``: the traced model's input held it. ``"forward-float16"``: a
        module's output first went non-finite in float16 (an activation past 65504).
        ``"forward-bfloat16"``: it did in bfloat16, which has float32's range (no
        overflow; low precision in an op that cancels or divides, or a genuine
        inf/NaN). ``"forward-float32"``: it did in float32 (a genuine inf/NaN, not a
        precision problem). ``"loss"``: every traced output was finite, the loss was
        not. ``"backward"``: the forward pass (or the loss) was finite, so the scaled
        gradients overflowed on the way back. ``"forward"``: the loss was non-finite
        and nothing was traced. ``"unknown"``: nothing to tell from.
        """
        finite_loss = None if self.loss is None else math.isfinite(self.loss)
        if not self.gradients:
            return "elsewhere"
        if self.traced:
            if self.bad_samples:
                return "input"
            if self.first_nonfinite is not None:
                dtype = self.first_nonfinite.dtype
                return f"forward-{dtype if dtype in LOW_PRECISION else 'float32'}"
            return "loss" if finite_loss is False else "backward"
        if finite_loss is None:
            return "unknown"
        return "backward" if finite_loss else "forward"

    def explain(self) -> str:
        """The cause in words, with the fix where there is one."""
        cause, first = self.cause, self.first_nonfinite
        if cause == "elsewhere":
            return ("no gradient here held inf/NaN: another process found one, and every"
                    " rank skips together")
        if cause == "input":
            samples = ", ".join(map(str, self.bad_samples))
            return (f"the model's input holds inf/NaN in sample(s) {samples}: bad data,"
                    f" not precision")
        if cause.startswith("forward-"):
            assert first is not None  # what a forward-<dtype> cause is made from
            if cause == "forward-float16":
                return (f"first non-finite forward output: {first.describe()}, a float16"
                        f" overflow (|x| > 65504): run it in float32 with {first.fix}"
                        f" or use bfloat16")
            if cause == "forward-bfloat16":
                return (f"first non-finite forward output: {first.describe()}: not an"
                        f" overflow (bfloat16 has float32's range); if it cancels or"
                        f" divides, run it in float32 with {first.fix}, else the"
                        f" inf/NaN is genuine")
            if cause == "forward-float32":
                return (f"first non-finite forward output: {first.describe()}, computed in"
                        f" {first.dtype}: a genuine inf/NaN, not a precision overflow")
        if cause == "loss":
            return "every traced forward output was finite, the loss was not"
        if cause == "backward":
            where = "every traced forward output" if self.traced else \
                f"each of the {self.micro_batches} losses" if self.micro_batches > 1 \
                else "the loss"
            if self.overflows_since_update > 1:
                return (f"{where} was finite, so the scaled gradients overflowed in the"
                        f" backward pass; {self.overflows_since_update} checks since the"
                        f" last update() found inf/NaN, and only update() backs the"
                        f" scale off")
            return (f"{where} was finite, so the scaled gradients overflowed in the"
                    f" backward pass; the scale backs off")
        hint = ("; the forward ran inside a traced function, where amp.trace_forward"
                " cannot read its outputs: run one step untraced to find the layer"
                if self.forward_in_trace else "; amp.trace_forward(model) finds the layer")
        if cause == "forward":
            return "the loss itself is inf/NaN, so the forward pass made it" + hint
        return "forward or backward pass, unknown without the loss" + hint

    def line(self) -> str:
        """The report as one line, the same wording on every backend."""
        loss = "unknown" if self.loss is None else f"{self.loss:.4g}"
        if self.micro_batch is not None and self.micro_batches > 1:
            largest = ", the largest" if math.isfinite(self.loss or 0.0) else ""
            loss += f" in micro-batch {self.micro_batch} of {self.micro_batches}{largest}"
        listed = ", ".join(g.describe() for g in self.gradients[:_LISTED])
        more = len(self.gradients) - _LISTED
        if more > 0:
            listed += f" and {more} more"
        return (f"unified_amp: step {self.step} skipped (scale {self.scale:g}, loss {loss}):"
                f" inf/NaN gradients in {len(self.gradients)} of {self.checked}"
                f" parameters{': ' + listed if listed else ''}; {self.explain()}")

    __str__ = line

    def as_dict(self) -> dict[str, Any]:
        """Plain Python values only (JSON-ready but for inf/NaN losses)."""
        first = self.first_nonfinite
        return {
            "step": self.step,
            "scale": self.scale,
            "loss": self.loss,
            "checked": self.checked,
            "gradients": [{"name": g.name, "shape": list(g.shape), "inf": g.inf,
                           "nan": g.nan} for g in self.gradients],
            "traced": self.traced,
            "first_nonfinite": None if first is None else
            {"module": first.module, "type": first.type, "dtype": first.dtype,
             "pin": first.pin},
            "bad_samples": list(self.bad_samples),
            "forward_in_trace": self.forward_in_trace,
            "overflows_since_update": self.overflows_since_update,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "cause": self.cause,
            "line": self.line(),
        }


# -- forward tracing ---------------------------------------------------------------------
class _Record:
    __slots__ = ("trace", "seq", "index", "dtype", "flag", "is_input")

    def __init__(self, trace: "ForwardTrace", index: int, dtype: str, flag: Any,
                 is_input: bool) -> None:
        self.trace, self.index, self.dtype, self.flag = trace, index, dtype, flag
        self.seq = next(_clock)  # execution order across traces
        self.is_input = is_input


_MAX_RECORDS = 1 << 16  # per trace: bounded, for traces used without a scaler
# Counts records and scaler updates as they happen, so that flags from several traces
# read in execution order and each scaler reads those after its own last update. A
# clock: it only counts; no scaler's state depends on another's through it.
_clock = itertools.count()
# Weakly, every trace that was ever started (where a scaler looks for flags when it
# reports) and every live scaler that reads them (one's flags are dropped once all have
# passed them). Neither holds any scaler's state.
_traces: "weakref.WeakSet[ForwardTrace]" = weakref.WeakSet()
_readers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _floating_tensors(obj: Any, backend: Any) -> list[tuple[Any, str]]:
    """The floating-point tensors in a module's inputs or outputs (nested lists,
    tuples and dicts), each with its dtype's name."""
    if backend.is_tensor(obj):
        dtype = backend.dtype_name(obj.dtype)
        return [(obj, dtype)] if dtype in _FLOATING else []
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _floating_tensors(item, backend)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _floating_tensors(item, backend)]
    return []


class ForwardTrace:
    """Records, for each forward pass of ``model``, which module outputs were finite.

    Made by :func:`trace_forward`; a context manager (``with``), or ``start()`` /
    ``stop()`` for a trace that outlives a block. While started, every submodule has a
    forward hook that leaves one device-side flag per floating output (no host read),
    and the model itself a pre-hook that flags each input sample. A GradScaler reads
    the flags only when it reports an overflow; flags every scaler reading this trace
    has passed (at its ``update()``) are dropped. Stopped, no hook is left on any module.
    """

    def __init__(self, model: Any) -> None:
        backend = get_backend()
        if not backend.is_module(model):
            raise TypeError(
                f"trace_forward() expects a {backend.name} module (the model to trace);"
                f" got {type(model).__name__}."
                + (_foreign.hint(model, backend.name)
                   or " Pass the model itself, e.g. amp.trace_forward(model).")
            )
        self._backend: Any = require(backend, ForensicsProbes, "amp.trace_forward")
        self.model = model
        self._modules: list[tuple[str, str]] = []  # (name, class name) by hook index
        self._module_refs: list[Callable[[], Any]] = []  # the modules, by hook index
        self._removers: list[Any] = []
        self._started_at = -1  # when start() last ran, on the records' clock
        self._records: list[_Record] = []  # in execution order

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._removers)

    def start(self) -> "ForwardTrace":
        """Installs the hooks (once; starting an active trace does nothing)."""
        if self.active:
            return self
        backend = self._backend
        modules = backend.named_modules(self.model)
        self._modules = [(name, type(m).__name__) for name, m in modules]
        self._module_refs = [_ref(m) for _, m in modules]
        self._removers = [backend.add_forward_hook(self.model, self._input_hook, pre=True)]
        for index, (_, module) in enumerate(modules):
            self._removers.append(backend.add_forward_hook(module, self._output_hook(index)))
        self._started_at = next(_clock)
        _traces.add(self)
        return self

    def stop(self) -> None:
        """Removes every hook. The flags already recorded stay until read or cleared."""
        for handle in self._removers:
            handle.remove()
        self._removers = []

    def __enter__(self) -> "ForwardTrace":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _append(self, record: _Record) -> None:
        if len(self._records) >= _MAX_RECORDS:
            del self._records[:_MAX_RECORDS // 2]
        self._records.append(record)

    def _after(self, seq: int) -> list[_Record]:
        """The records made after clock value ``seq``."""
        n = 0
        while n < len(self._records) and self._records[n].seq < seq:
            n += 1
        return self._records[n:]

    def _drop_before(self, seq: int) -> None:
        n = 0
        while n < len(self._records) and self._records[n].seq < seq:
            n += 1
        del self._records[:n]

    def _input_hook(self, module: Any, inputs: Any) -> None:
        backend = self._backend
        if _tracing.mode(backend) is not None:
            # Inside a trace a flag read back after a replay is not this call's value
            # (it reads as finite); mark the forward unseen instead of flagging it.
            self._append(_Record(self, -1, "", None, True))
            return
        for i, (t, dtype) in enumerate(_floating_tensors(inputs, backend)):
            if len(t.shape):
                self._append(_Record(self, i, dtype, backend.finite_flag(t, per_row=True),
                                     True))

    def _output_hook(self, index: int) -> Callable[..., None]:
        backend = self._backend

        def hook(module: Any, inputs: Any, outputs: Any) -> None:
            if _tracing.mode(backend) is not None:
                return  # see _input_hook
            for t, dtype in _floating_tensors(outputs, backend):
                self._append(_Record(self, index, dtype, backend.finite_flag(t), False))

        return hook

    def first_nonfinite(self) -> tuple[NonFiniteOutput | None, tuple[int, ...]]:
        """Reads this trace's flags (one host read): the first module whose output was
        non-finite among those it holds, and the input samples that were."""
        # (Forwards run inside a trace left no flag: see _input_hook.)
        records = [r for r in self._records if r.flag is not None]
        _, _, finite = self._backend.read_overflow([], [], [r.flag for r in records])
        return first_nonfinite(records, finite)

    def clear(self) -> None:
        """Forgets the flags this trace recorded so far."""
        self._records.clear()

    def __repr__(self) -> str:
        state = "active" if self.active else "stopped"
        return f"ForwardTrace({type(self.model).__name__}, {state})"


def trace_forward(model: Any) -> ForwardTrace:
    """Opt-in forward tracing for overflow reports.

    ::

        with amp.trace_forward(model):
            ...training steps...      # an overflow report now names the first module
                                      # whose output was inf/NaN, and its dtype

    Costs a small reduction per module output while active (``make bench`` measures
    it); no host read until a GradScaler finds an overflow. Outside the block no hook
    is installed.

    Raises:
        TypeError: ``model`` is not a module of the active backend's framework.
    """
    return ForwardTrace(model)


def traces() -> list[ForwardTrace]:
    """Every trace started and not yet freed, in the order they were last started."""
    return sorted(_traces, key=lambda t: t._started_at)


class Reader:
    """What reads traces' flags for one scaler: it reads those recorded after its last
    ``passed()``, and flags every live reader has passed are dropped."""

    def __init__(self) -> None:
        self.since = next(_clock)
        _readers.add(self)

    def unread(self) -> list[_Record]:
        """The flags recorded since this reader last passed, in execution order."""
        records = [r for t in traces() for r in t._after(self.since)]
        records.sort(key=lambda r: r.seq)
        return records

    def passed(self) -> None:
        """This reader is done with every flag recorded so far."""
        self.since = next(_clock)
        if not _traces:  # nothing recorded anywhere: skip the readers' horizon (per step)
            return
        horizon = min(reader.since for reader in _readers)
        for trace in traces():
            trace._drop_before(horizon)


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weakly referenceable: hold it
        return lambda: obj


def _pin_name(record: _Record, watched: Sequence[Any]) -> str:
    """The dotted name of the record's module in the first watched model that holds
    it, else in the traced model."""
    trace = record.trace
    module = trace._module_refs[record.index]() if trace._module_refs else None
    if module is not None:
        for model in watched:
            for name, m in trace._backend.named_modules(model):
                if m is module:
                    return name
    return trace._modules[record.index][0]


def first_nonfinite(records: list[_Record], finite: list[list[bool]],
                    watched: Sequence[Any] = ()
                    ) -> tuple[NonFiniteOutput | None, tuple[int, ...]]:
    """The first non-finite module output and the bad input samples, from the flags
    of ``records`` as read back (``finite``)."""
    first: NonFiniteOutput | None = None
    samples: tuple[int, ...] = ()
    for record, ok in zip(records, finite):
        if all(ok):
            continue
        if record.is_input:
            if not samples:
                samples = tuple(i for i, row_ok in enumerate(ok) if not row_ok)
        elif first is None:
            name, kind = record.trace._modules[record.index]
            first = NonFiniteOutput(name, kind, record.dtype,
                                    pin_expression(_pin_name(record, watched)))
    return first, samples


# -- one scaler's side: what it listens to -------------------------------------------------
def _natural(name: str) -> list[Any]:
    # "layers.10.weight" after "layers.9.weight"
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"GradScaler.watch() {name} must be an int; got {value!r}.")
    if value < least:
        raise ValueError(f"GradScaler.watch() {name} must be >= {least}; got {value!r}.")


def _loss_of(outputs: Any) -> Any:
    """The loss a report may give the value of: the scaled tensor, or the first of a
    list, if it has one element."""
    if isinstance(outputs, (list, tuple)):
        outputs = outputs[0] if outputs else None
    if not hasattr(outputs, "shape") or math.prod(int(d) for d in outputs.shape) != 1:
        return None
    return outputs


# Losses of one iteration a report reads back, at most (the latest): an accumulation of
# more micro-batches is named among those.
_MAX_LOSSES = 64


def _quoted(values: list[float]) -> int:
    """Which loss a report quotes: the first inf/NaN one, else the largest."""
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return max(range(len(values)), key=lambda i: abs(values[i]))


class ScalerForensics:
    """One GradScaler's overflow reports, history and warning state, made from what its
    state machine announces (a ``Listener`` of scaler/_machine.py)."""

    def __init__(self, enabled: bool) -> None:
        # Reads forward traces' flags; a disabled scaler checks nothing, so never reports.
        self._traces = Reader() if enabled else None
        self._models: list[Callable[[], Any]] = []
        # this iteration's scaled losses: (which micro-batch, the one-element tensor)
        self.losses: collections.deque[tuple[int, Any]] = collections.deque(
            maxlen=_MAX_LOSSES)
        self.scaled_count = 0  # outputs scaled since then
        self._checks = 0  # the iteration's checks when the set began
        self.warn_after = 10
        self.warn_below = 1.0
        self.history: collections.deque[OverflowReport] = collections.deque(maxlen=16)
        self.last: OverflowReport | None = None
        self._run = 0  # skipped steps in a row
        self._warned = False  # this run of skipped steps has been warned about

    def watch(self, model: Any, warn_after: int, warn_below: float, history: int) -> None:
        _check_int("warn_after", warn_after, 1)
        _check_int("history", history, 0)
        if isinstance(warn_below, bool) or not isinstance(warn_below, (int, float)) or \
                not (warn_below >= 0 and math.isfinite(warn_below)):
            raise ValueError(
                f"GradScaler.watch() warn_below must be a finite number >= 0 (0 turns the"
                f" floor off); got {warn_below!r}."
            )
        if model is not None:
            backend = get_backend()
            if not backend.is_module(model):
                hint = (" Pass the model itself, not its parameters."
                        if isinstance(model, (list, tuple)) or hasattr(model, "__next__")
                        else "")
                raise TypeError(
                    f"GradScaler.watch() expects a {backend.name} module (the model whose"
                    f" parameters get names in overflow reports); got"
                    f" {type(model).__name__}.{hint or _foreign.hint(model, backend.name)}"
                )
            require(backend, ForensicsProbes, "GradScaler.watch(model)")
            if all(ref() is not model for ref in self._models):
                self._models.append(_ref(model))
        self.warn_after, self.warn_below = warn_after, float(warn_below)
        if history != self.history.maxlen:
            self.history = collections.deque(self.history, maxlen=history)

    def history_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.history]

    # -- what the machine announces --------------------------------------------------------
    def scaled(self, outputs: Any, checks: int) -> None:
        """Remembers the loss being scaled, for the report's loss value, until a check
        came and a new loss goes out, or the iteration ends: the micro-batches whose
        gradients the next check covers (an accumulating loop holds them anyway)."""
        if checks != self._checks:  # a check came since the last loss: a new set
            self._checks = checks
            self.losses.clear()
            self.scaled_count = 0
        self.scaled_count += 1
        loss = _loss_of(outputs)
        if loss is not None:
            self.losses.append((self.scaled_count, loss))

    def overflow_found(self, params: list[Any], step: int, scale: float,
                       overflows_since_update: int) -> None:
        # A diagnostic must not end a training run: a failure here becomes a warning.
        try:
            self._report(params, step, scale, overflows_since_update)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"unified_amp: the overflow report failed ({type(exc).__name__}:"
                          f" {exc}); the step was skipped as usual.", RuntimeWarning,
                          stacklevel=_user_stacklevel())

    def updated(self, skipped: bool, scale: float, step: int) -> None:
        """Follows runs of skipped steps; warns once per run that goes on too long."""
        if not skipped:
            self._run, self._warned = 0, False
            return
        self._run += 1
        long_run = self._run >= self.warn_after
        # One skip below the floor is no collapse (a scale that starts low backs off
        # once); two in a row are.
        collapsed = self._run >= 2 and scale < self.warn_below
        if self._warned or not (long_run or collapsed):
            return
        self._warned = True
        first = step - self._run + 1
        floor = f", below warn_below={self.warn_below:g}" if collapsed else ""
        last = f" Last: {self.last.line()}" if self.last is not None else ""
        warnings.warn(OverflowWarning(
            f"unified_amp: {self._run} step{'s' if self._run > 1 else ''} in a row (steps"
            f" {first}-{step}) skipped for inf/NaN gradients; loss scale now"
            f" {scale:g}{floor}: training is not progressing.{last}"),
            stacklevel=_user_stacklevel())

    def iteration_ended(self) -> None:
        self.losses.clear()
        self.scaled_count = self._checks = 0
        if self._traces is not None:
            self._traces.passed()  # this scaler's next report reads only newer flags

    # -- the report: only after a check found an inf/NaN -----------------------------------
    def _report(self, params: list[Any], step: int, scale: float,
                overflows_since_update: int) -> None:
        backend = capability(get_backend(), ForensicsProbes)
        if backend is None:
            return  # an adapter without the probes gets no reports (the warning stays)
        with_grad = [p for p in params if p.grad is not None]
        # The flags recorded since this scaler's last update, whichever trace made them.
        records = self._traces.unread() if self._traces is not None else []
        unseen = any(r.flag is None for r in records)  # a forward inside a trace
        traced = (bool(records) or any(t.active for t in traces())) and not unseen
        if not traced:
            records = []
        # The one host read of the report (the verdict before it was the step's own).
        counts, loss_values, finite = backend.read_overflow(
            [p.grad for p in with_grad], [loss for _, loss in self.losses],
            [r.flag for r in records])
        loss_value, micro_batch = None, None
        if loss_values:
            at = _quoted(loss_values)
            loss_value, micro_batch = loss_values[at], self.losses[at][0]
        names = self._names(backend, records)
        bad = []
        for i, (p, (n_inf, n_nan)) in enumerate(zip(with_grad, counts)):
            if n_inf or n_nan:
                name = names.get(id(p), f"param[{i}]")
                bad.append(BadGradient(name, tuple(int(d) for d in p.grad.shape),
                                       n_inf, n_nan))
        bad.sort(key=lambda g: (g.name.startswith("param["), _natural(g.name)))
        watched = [m for m in (ref() for ref in self._models) if m is not None]
        first, samples = first_nonfinite(records, finite, watched)
        report = OverflowReport(
            step=step, scale=scale, loss=loss_value, checked=len(with_grad),
            gradients=tuple(bad), traced=traced, first_nonfinite=first,
            bad_samples=samples, forward_in_trace=unseen,
            overflows_since_update=overflows_since_update, micro_batch=micro_batch,
            micro_batches=max(self.scaled_count, 1))
        self.last = report
        if self.history.maxlen:
            self.history.append(report)

    def _names(self, backend: Any, records: list[Any]) -> dict[int, str]:
        names: dict[int, str] = {}
        active = dict.fromkeys([t for t in traces() if t.active] + [r.trace for r in records])
        models = [ref() for ref in self._models] + [t.model for t in active]
        seen: set[int] = set()
        for model in models:
            if model is None or id(model) in seen:
                continue
            seen.add(id(model))
            for name, p in backend.named_parameters(model):
                names.setdefault(id(p), name)
        return names
