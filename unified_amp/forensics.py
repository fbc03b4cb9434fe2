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

Reports read the same on both backends: parameter names are the frameworks' dotted
module paths (the same for the same model), sorted, and the wording is fixed here.
"""

from __future__ import annotations

import collections
import math
import os
import re
import sys
import warnings
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

from ._interface import LOW_PRECISION
from ._registry import get_backend

__all__ = ["OverflowReport", "BadGradient", "NonFiniteOutput", "OverflowWarning",
           "ForwardTrace", "trace_forward"]

_FLOATING = ("float16", "bfloat16", "float32", "float64")
_LISTED = 5  # gradients named in a report line; the rest are counted


class OverflowWarning(RuntimeWarning):
    """A GradScaler keeps skipping steps: every gradient it checks holds an inf/NaN."""


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
    """

    module: str
    type: str
    dtype: str

    def describe(self) -> str:
        return f"{self.module or '(model)'} ({self.type}, {self.dtype})"


@dataclass(frozen=True)
class OverflowReport:
    """What one overflowing gradient check found. Plain data; ``as_dict()`` for logs.

    Attributes:
        step: the scaler step it decided (1 for the first ``update()``).
        scale: the loss scale the gradients were scaled by.
        loss: the value of the last loss given to ``scale()`` or ``backward()`` in this
            iteration (the first, if it was a list), or None if that was no
            one-element tensor or the scale was handed out as ``scale_factor``.
        checked: how many gradients the check covered.
        gradients: those that held inf/NaN, sorted by name.
        traced: whether a :func:`trace_forward` block recorded this step's forward.
        first_nonfinite: the first traced module with a non-finite output, or None.
        bad_samples: indices (along the batch dimension) of the traced model's input
            samples that held inf/NaN.
    """

    step: int
    scale: float
    loss: float | None
    checked: int
    gradients: tuple[BadGradient, ...]
    traced: bool
    first_nonfinite: NonFiniteOutput | None
    bad_samples: tuple[int, ...]

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
                        f" overflow (|x| > 65504): run that op in float32"
                        f" (autocast(enabled=False)) or use bfloat16")
            if cause == "forward-bfloat16":
                return (f"first non-finite forward output: {first.describe()}: not an"
                        f" overflow (bfloat16 has float32's range); if that op cancels or"
                        f" divides, run it in float32 (autocast(enabled=False)), else the"
                        f" inf/NaN is genuine")
            if cause == "forward-float32":
                return (f"first non-finite forward output: {first.describe()}, computed in"
                        f" {first.dtype}: a genuine inf/NaN, not a precision overflow")
        if cause == "loss":
            return "every traced forward output was finite, the loss was not"
        if cause == "backward":
            where = "every traced forward output" if self.traced else "the loss"
            return (f"{where} was finite, so the scaled gradients overflowed in the"
                    f" backward pass; the scale backs off")
        hint = "; amp.trace_forward(model) finds the layer"
        if cause == "forward":
            return "the loss itself is inf/NaN, so the forward pass made it" + hint
        return "forward or backward pass, unknown without the loss" + hint

    def line(self) -> str:
        """The report as one line, the same wording on every backend."""
        loss = "unknown" if self.loss is None else f"{self.loss:.4g}"
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
            {"module": first.module, "type": first.type, "dtype": first.dtype},
            "bad_samples": list(self.bad_samples),
            "cause": self.cause,
            "line": self.line(),
        }


# -- forward tracing ---------------------------------------------------------------------
class _Record:
    __slots__ = ("trace", "index", "dtype", "flag", "is_input")

    def __init__(self, trace: "ForwardTrace", index: int, dtype: str, flag: Any,
                 is_input: bool) -> None:
        self.trace, self.index, self.dtype, self.flag = trace, index, dtype, flag
        self.is_input = is_input


# Flags of every active trace since the last clear (a GradScaler's update() clears
# them), in execution order. Bounded, for traces used without a scaler.
_records: list[_Record] = []
_MAX_RECORDS = 1 << 16
_active: list["ForwardTrace"] = []


def _clear_records() -> None:
    _records.clear()


def _append(record: _Record) -> None:
    if len(_records) >= _MAX_RECORDS:
        del _records[: _MAX_RECORDS // 2]
    _records.append(record)


def _floating_tensors(obj: Any, backend: Any) -> list[Any]:
    """The floating-point tensors in a module's inputs or outputs (nested lists,
    tuples and dicts)."""
    if backend.is_tensor(obj):
        return [obj] if backend.dtype_name(obj.dtype) in _FLOATING else []
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
    the flags only when it reports an overflow, and clears them at every ``update()``.
    Stopped, no hook is left on any module.
    """

    def __init__(self, model: Any) -> None:
        backend = get_backend()
        if not backend.is_module(model):
            raise TypeError(
                f"trace_forward() expects a {backend.name} module (the model to trace);"
                f" got {type(model).__name__}. Pass the model itself, e.g."
                f" amp.trace_forward(model)."
            )
        self._backend = backend
        self.model = model
        self._modules: list[tuple[str, str]] = []  # (name, class name) by hook index
        self._removers: list[Any] = []

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
        self._removers = [backend.add_forward_hook(self.model, self._input_hook, pre=True)]
        for index, (_, module) in enumerate(modules):
            self._removers.append(backend.add_forward_hook(module, self._output_hook(index)))
        _active.append(self)
        return self

    def stop(self) -> None:
        """Removes every hook. The flags already recorded stay until cleared."""
        for handle in self._removers:
            handle.remove()
        self._removers = []
        if self in _active:
            _active.remove(self)

    def __enter__(self) -> "ForwardTrace":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _input_hook(self, module: Any, inputs: Any) -> None:
        backend = self._backend
        for i, t in enumerate(_floating_tensors(inputs, backend)):
            if len(t.shape):
                _append(_Record(self, i, backend.dtype_name(t.dtype),
                                backend.finite_flag(t, per_row=True), True))

    def _output_hook(self, index: int) -> Callable[..., None]:
        backend = self._backend

        def hook(module: Any, inputs: Any, outputs: Any) -> None:
            for t in _floating_tensors(outputs, backend):
                _append(_Record(self, index, backend.dtype_name(t.dtype),
                                backend.finite_flag(t), False))

        return hook

    def first_nonfinite(self) -> tuple[NonFiniteOutput | None, tuple[int, ...]]:
        """Reads this trace's flags (one host read): the first module whose output was
        non-finite since the last clear, and the input samples that were."""
        records = [r for r in _records if r.trace is self]
        _, _, finite = self._backend.read_overflow([], None, [r.flag for r in records])
        return _first_nonfinite(records, finite)

    def clear(self) -> None:
        """Forgets the flags recorded so far (by every trace)."""
        _clear_records()

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


def _first_nonfinite(records: list[_Record], finite: list[list[bool]]
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
            first = NonFiniteOutput(name, kind, record.dtype)
    return first, samples


# -- the scaler's side -------------------------------------------------------------------
def _natural(name: str) -> list[Any]:
    # "layers.10.weight" after "layers.9.weight"
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weakly referenceable: hold it
        return lambda: obj


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside this package, for warnings."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"GradScaler.watch() {name} must be an int; got {value!r}.")
    if value < least:
        raise ValueError(f"GradScaler.watch() {name} must be >= {least}; got {value!r}.")


class Forensics:
    """One GradScaler's overflow reports, history and warning state (internal)."""

    def __init__(self, scaler: Any) -> None:
        self._scaler = weakref.ref(scaler)
        self._models: list[Callable[[], Any]] = []
        self._loss: Any = None  # the last loss scaled in this iteration
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
                    f" {type(model).__name__}.{hint}"
                )
            if all(ref() is not model for ref in self._models):
                self._models.append(_ref(model))
        self.warn_after, self.warn_below = warn_after, float(warn_below)
        if history != self.history.maxlen:
            self.history = collections.deque(self.history, maxlen=history)

    def saw_loss(self, outputs: Any) -> None:
        """Remembers the loss being scaled, for the report's loss value, until the
        iteration ends (the loop holds it that long anyway)."""
        if isinstance(outputs, (list, tuple)):
            outputs = outputs[0] if outputs else None
        self._loss = outputs

    def hook(self, params: list[Any]) -> Callable[[], None]:
        """What a check runs if its verdict reads "overflow". Pure Python: a clean
        check drops it unread."""
        return lambda: self._report(params)

    # -- the slow path: only after a check found an inf/NaN ---------------------------
    def _names(self, backend: Any) -> dict[int, str]:
        names: dict[int, str] = {}
        traces = dict.fromkeys(_active + [r.trace for r in _records])
        models = [ref() for ref in self._models] + [t.model for t in traces]
        seen: set[int] = set()
        for model in models:
            if model is None or id(model) in seen:
                continue
            seen.add(id(model))
            for name, p in backend.named_parameters(model):
                names.setdefault(id(p), name)
        return names

    def _report(self, params: list[Any]) -> None:
        # A diagnostic must not end a training run: a failure here becomes a warning.
        try:
            self._make_report(params)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"unified_amp: the overflow report failed ({type(exc).__name__}:"
                          f" {exc}); the step was skipped as usual.", RuntimeWarning,
                          stacklevel=_user_stacklevel())

    def _make_report(self, params: list[Any]) -> None:
        scaler = self._scaler()
        if scaler is None:
            return
        backend = scaler._be()
        with_grad = [p for p in params if p.grad is not None]
        loss = self._loss
        if loss is not None and math.prod(int(d) for d in loss.shape) != 1:
            loss = None
        traced = bool(_active or _records)
        records = list(_records) if traced else []
        # The one host read of the report (the verdict before it was the step's own).
        counts, loss_value, finite = backend.read_overflow(
            [p.grad for p in with_grad], loss, [r.flag for r in records])
        names = self._names(backend)
        bad = []
        for i, (p, (n_inf, n_nan)) in enumerate(zip(with_grad, counts)):
            if n_inf or n_nan:
                name = names.get(id(p), f"param[{i}]")
                bad.append(BadGradient(name, tuple(int(d) for d in p.grad.shape),
                                       n_inf, n_nan))
        bad.sort(key=lambda g: (g.name.startswith("param["), _natural(g.name)))
        first, samples = _first_nonfinite(records, finite)
        report = OverflowReport(
            step=scaler._steps + 1, scale=scaler.get_scale(), loss=loss_value,
            checked=len(with_grad), gradients=tuple(bad), traced=traced,
            first_nonfinite=first, bad_samples=samples)
        self.last = report
        if self.history.maxlen:
            self.history.append(report)

    # -- after each counted update ---------------------------------------------------
    def counted(self, skipped: bool, scale: float, step: int) -> None:
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

    def end_iteration(self) -> None:
        self._loss = None
        _clear_records()

    def history_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.history]
