"""One GradScaler's side of overflow forensics: the hook each check carries, the
reports it makes, their history, and the once-per-run warning (the reports and forward
tracing themselves are forensics.py)."""

from __future__ import annotations

import collections
import functools
import math
import os
import re
import sys
import warnings
import weakref
from types import FrameType
from typing import Any, Callable

from .. import _foreign
from .. import forensics as tracing
from .._registry import get_backend
from ..forensics import BadGradient, OverflowReport, OverflowWarning, _ref

__all__: list[str] = []


def _natural(name: str) -> list[Any]:
    # "layers.10.weight" after "layers.9.weight"
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside this package and its adapters, for
    warnings."""
    ours = [os.path.dirname(os.path.abspath(__file__))]
    adapters = sys.modules.get("unified_amp.backends")
    ours += [os.path.abspath(p) for p in getattr(adapters, "__path__", [])]
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            tuple(ours)):
        frame, level = frame.f_back, level + 1
    return level


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"GradScaler.watch() {name} must be an int; got {value!r}.")
    if value < least:
        raise ValueError(f"GradScaler.watch() {name} must be >= {least}; got {value!r}.")


class Forensics:
    """One GradScaler's overflow reports, history and warning state (internal).

    The scaler hands it what a report needs (the adapter, the step number) with each
    hook; it asks the scaler's state machine for the scale and for how many checks
    found an inf/NaN since the last ``update()`` (``current_scale()``,
    ``it.overflows()``).
    """

    def __init__(self, machine: Any, enabled: bool) -> None:
        self._scaler = weakref.ref(machine)
        # Reads forward traces' flags; a disabled scaler checks nothing, so never reports.
        self._traces = tracing.Reader() if enabled else None
        self._models: list[Callable[[], Any]] = []
        self.loss: Any = None  # the last loss scaled in this iteration
        self.warn_after = 10
        self.warn_below = 1.0
        self.history: collections.deque[OverflowReport] = collections.deque(maxlen=16)
        self.last: OverflowReport | None = None
        self._run = 0  # skipped steps in a row
        self._warned = False  # this run of skipped steps has been warned about
        self._stall_warned = False  # overflows with no update() between: warned about

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
        self.loss = outputs

    def hook(self, params: list[Any], backend: Any, step: int) -> Callable[[], None]:
        """What a check of ``params`` in scaler step ``step`` runs if its verdict reads
        "overflow". Pure Python: a clean check drops it unread."""
        return functools.partial(self._report, params, backend, step)

    # -- the slow path: only after a check found an inf/NaN ---------------------------
    def _names(self, backend: Any, records: list[Any]) -> dict[int, str]:
        names: dict[int, str] = {}
        traces = dict.fromkeys([t for t in tracing.traces() if t.active]
                               + [r.trace for r in records])
        models = [ref() for ref in self._models] + [t.model for t in traces]
        seen: set[int] = set()
        for model in models:
            if model is None or id(model) in seen:
                continue
            seen.add(id(model))
            for name, p in backend.named_parameters(model):
                names.setdefault(id(p), name)
        return names

    def _loss_value(self) -> float | None:
        loss = self.loss
        if loss is None or math.prod(int(d) for d in loss.shape) != 1:
            return None
        return float(loss.item())

    def _report(self, params: list[Any], backend: Any, step: int) -> None:
        # A diagnostic must not end a training run: a failure here becomes a warning.
        try:
            self._make_report(params, backend, step)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"unified_amp: the overflow report failed ({type(exc).__name__}:"
                          f" {exc}); the step was skipped as usual.", RuntimeWarning,
                          stacklevel=_user_stacklevel())

    def _make_report(self, params: list[Any], backend: Any, step: int) -> None:
        scaler = self._scaler()
        if scaler is None:
            return
        with_grad = [p for p in params if p.grad is not None]
        loss = self.loss
        if loss is not None and math.prod(int(d) for d in loss.shape) != 1:
            loss = None
        # The flags recorded since this scaler's last update, whichever trace made them.
        records = self._traces.unread() if self._traces is not None else []
        unseen = any(r.flag is None for r in records)  # a forward inside a trace
        traced = (bool(records) or any(t.active for t in tracing.traces())) and not unseen
        if not traced:
            records = []
        # The one host read of the report (the verdict before it was the step's own).
        counts, loss_value, finite = backend.read_overflow(
            [p.grad for p in with_grad], loss, [r.flag for r in records])
        names = self._names(backend, records)
        bad = []
        for i, (p, (n_inf, n_nan)) in enumerate(zip(with_grad, counts)):
            if n_inf or n_nan:
                name = names.get(id(p), f"param[{i}]")
                bad.append(BadGradient(name, tuple(int(d) for d in p.grad.shape),
                                       n_inf, n_nan))
        bad.sort(key=lambda g: (g.name.startswith("param["), _natural(g.name)))
        watched = [m for m in (ref() for ref in self._models) if m is not None]
        first, samples = tracing.first_nonfinite(records, finite, watched)
        report = OverflowReport(
            step=step, scale=scaler.current_scale(), loss=loss_value,
            checked=len(with_grad), gradients=tuple(bad), traced=traced,
            first_nonfinite=first, bad_samples=samples, forward_in_trace=unseen,
            overflows_since_update=scaler.it.overflows())
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

    def overflowed_without_update(self, overflows: int, scale: float) -> None:
        """After a check that found an inf/NaN and dropped the gradients: ``overflows``
        such checks since the last ``update()``. The scale backs off only in update(),
        so a loop that never calls it skips every step at the same scale: said once."""
        if self._stall_warned or overflows < max(2, self.warn_after):
            return
        self._stall_warned = True
        last = f" Last: {self.last.line()}" if self.last is not None else ""
        warnings.warn(OverflowWarning(
            f"unified_amp: {overflows} gradient checks since the last scaler.update() found"
            f" inf/NaN gradients and dropped them, so the weights have not moved; the loss"
            f" scale stays {scale:g}, because only update() backs it off. Call"
            f" scaler.update() once per iteration, after the optimizer step"
            f" (megengine.amp's manual form: gm.backward(scaler.scale(loss)),"
            f" scaler.unscale(gm), opt.step(), scaler.update()).{last}"),
            stacklevel=_user_stacklevel())

    def end_iteration(self) -> None:
        self._stall_warned = False
        self.loss = None
        if self._traces is not None:
            self._traces.passed()  # this scaler's next report reads only newer flags

    def history_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.history]
