"""GradScaler's state machine: stages, checks, the ledger, the device-resident mode.

``ScalerState`` holds what a GradScaler knows and the steps every public method is
made of: split a target's gradients into still-scaled / already-checked / idle (the
ledger), refuse an unscale that would be wrong, run one fused check (agreed across
ranks where needed), step unless a check found an inf/NaN, and end the iteration in
``_update``. Where the scale lives (a Python float, or the adapter's device tensors
once a fused optimizer stepped: ``_dev``) changes only where the arithmetic runs.
The public methods that drive it are ``GradScaler``'s (scaler.py); telemetry,
settings and checkpoints are ``ScalerSurface``'s (_scaler_surface.py).
"""

from __future__ import annotations

import enum
import math
import weakref
from typing import Any, Sequence

from . import _tracing, distributed
from ._ledger import Check, GradLedger, _no_version
from ._registry import get_backend
from ._scale_rule import next_scale, valid_scale
from ._targets import is_optimizer, params_of
from ._adapter_view import AdapterView
from ._scaler_forensics import Forensics
from .interface import (Backend, BackwardHooks, DeviceResident, DeviceScale, GradVersions,
                        capability)

__all__ = ["AdapterView"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptState:
    """One optimizer's progress through the current iteration (torch.amp's stages)."""

    __slots__ = ("stage", "checks")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.checks: list[Check] = []  # the checks that covered its gradients


class _Caps:
    """What one adapter provides, asked once per scaler (a step asks several times):
    the optional capabilities the state machine calls, and whether the adapter has
    traces. Facts about the adapter's class, so they cannot change while it is in use."""

    __slots__ = ("backend", "hooks", "version", "resident", "traces", "fp16",
                 "rejects_non_float32")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.hooks = capability(backend, BackwardHooks)
        versions = capability(backend, GradVersions)
        self.version = _no_version if versions is None else versions.grad_version
        self.resident = capability(backend, DeviceResident)
        self.traces = _tracing.supported(backend)
        self.fp16: dict[Any, bool] = {}  # dtype -> whether it is float16 (asked once)
        # The adapter's fused check raises ValueError for a non-float32 gradient before
        # it runs (LossScaling.rejects_non_float32): then the core reads the dtypes only
        # to word that error, not on every step.
        self.rejects_non_float32 = backend.rejects_non_float32

    def is_fp16(self, dtype: Any) -> bool:
        known = self.fp16.get(dtype)
        if known is None:
            known = self.fp16[dtype] = self.backend.dtype_name(dtype) == "float16"
        return known


class ScalerState:
    """The state and the steps of GradScaler's state machine (see the module's doc)."""

    # Settings and the scale (a float32 value; the adapter's ``_dev`` holds it instead
    # once a fused optimizer stepped).
    _enabled: bool
    _device: str | None
    _process_group: Any
    _scale_value: float
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _tracker: int
    # Telemetry.
    _steps: int
    _skipped_steps: int
    _last_step_skipped: bool
    _as_of_step: int  # the step the telemetry describes (lags only in device mode)
    # Across iterations.
    _backend: Backend | None
    _dev: DeviceScale | None  # the adapter's device-resident scale, once a fused step ran
    #                           (or a trace)
    _trace_copy: Any  # the adapter's copy of the scale for traced steps (_tracing.py)
    _ledger: GradLedger
    _updated_by_backward: bool  # the last update() was backward()'s own
    _forensics: Forensics  # overflow reports (forensics.py)
    _tail: dict[int, list[Check]]  # optimizer id -> the checks behind its last step
    #                                after backward()'s update()
    # optimizer -> (the shape of its param_groups, its parameters), reused while the
    # groups stay the same lists: rebuilding it is a pass over every parameter
    _param_lists: "weakref.WeakKeyDictionary[Any, tuple[list, list[Any]]]"
    _caps_known: _Caps | None = None  # the adapter's capabilities (_caps())

    @property
    def adapter_view(self) -> AdapterView:
        """The declared members an adapter's subclass may read (:class:`AdapterView`)."""
        return AdapterView(self)

    def _be(self) -> Backend:
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    def _caps(self) -> _Caps:
        caps = self._caps_known
        if caps is None or caps.backend is not self._backend:
            caps = self._caps_known = _Caps(self._be())
        return caps

    def _new_iteration(self) -> None:
        # What happened since the last update(): per-optimizer stages keyed by id() as in
        # torch.amp (the keys live for one iteration only), and every check, for update().
        self._opt_states: dict[int, _OptState] = {}
        self._checks: list[Check] = []
        # How the scale was handed out since the last update: through outputs whose
        # backward the adapter can watch, or in a way it cannot (scale_factor, dy=...).
        self._handed_watched = False
        self._handed_blind = False
        self._saw_backward = False
        self._forensics.end_iteration()

    def _opt_state(self, optimizer: Any) -> _OptState:
        state = self._opt_states.get(id(optimizer))
        if state is None:
            state = self._opt_states[id(optimizer)] = _OptState()
        return state

    @property
    def _version(self) -> Any:
        """The adapter's gradient version counter, or a stand-in that has none."""
        return self._caps().version

    def _steps_on_device(self, optimizer: Any) -> bool:
        backend = self._caps().resident
        if backend is None or not backend.steps_on_device(optimizer):
            return False
        if self._dev is None:
            self._dev = backend.device_scale(optimizer, self._scale_value, self._tracker,
                                             self._skipped_steps)
        return True

    def _traced(self, what: str) -> bool:
        """Whether ``what`` runs inside a trace (_tracing.py), raising where it cannot
        run there as it does eagerly. Inside one the scale lives on the device from
        then on, starting from the copy kept current until then."""
        if not self._caps().traces:
            return False  # (what enter() and mirror() answer for such an adapter)
        backend = self._be()
        if not _tracing.enter(backend, what, (self._growth_factor, self._backoff_factor)):
            if self._dev is None and self._trace_copy is None:
                self._mirror()  # after unpickling
            return False
        if self._dev is None:
            self._dev = _tracing.take_copy(backend, what, self._trace_copy)
        return True

    def _can_trace(self) -> bool:
        """Whether the adapter has traces at all; asked once (a step asks often)."""
        return self._caps().traces

    def _refuse_in_trace(self, what: str, kind: str) -> None:
        """Raises if ``what``, a call that needs the host, runs inside a trace."""
        if self._enabled and _tracing.mode(self._be()) is not None:
            raise _tracing.refuse(self._be(), what, kind)

    def _mirror(self) -> None:
        """Brings the adapter's trace copy of the scale up to date with the host's (a
        trace can only use device state that is right when it starts)."""
        if self._enabled and self._dev is None and self._can_trace():
            self._trace_copy = _tracing.mirror(self._be(), self._trace_copy,
                                               self._scale_value, self._tracker,
                                               self._skipped_steps)

    def _mirror_ahead(self) -> bool:
        """Writes the trace copy with what update() will give if this step finds no
        inf/NaN, before a backward pass that unscales and updates at once
        (``backward(gm, loss)``'s default): the write then joins the device work already
        queued instead of waking MegEngine's worker after the flag read, and update()'s
        own _mirror() writes nothing unless an overflow made the guess wrong. Returns
        whether it wrote: the caller must then _mirror() if the step fails part-way."""
        if not (self._enabled and self._dev is None and self._can_trace()
                and self._trace_copy is not None):
            return False
        scale, tracker = next_scale(self._scale_value, self._tracker, False,
                                    self._growth_factor, self._backoff_factor,
                                    self._growth_interval)
        self._trace_copy.write(scale, tracker, self._skipped_steps)
        return True

    def _inv_scale(self) -> float:
        # The reciprocal in float64, rounded to float32 by the adapter: torch.amp's
        # "FP32 division can be imprecise" recipe, and what megengine.amp computes too.
        return 1.0 / self._scale_value if self._scale_value else math.inf

    def _params_of_optimizer(self, optimizer: Any) -> list[Any]:
        groups = optimizer.param_groups
        shape = [(id(g["params"]), len(g["params"])) for g in groups]
        try:
            cached = self._param_lists.get(optimizer)
        except TypeError:  # not weak-referenceable: no cache
            return params_of(optimizer, self._be(), "GradScaler.step()")
        if cached is not None and cached[0] == shape:
            return cached[1]
        params = params_of(optimizer, self._be(), "GradScaler.step()")
        self._param_lists[optimizer] = (shape, params)
        return params

    def _read(self, flag: Any) -> bool:
        return bool(self._be().flag_is_set(flag))

    def _split(self, params: list[Any]
               ) -> tuple[list[Any], list[Any], list[Check], list[Any]]:
        """``params`` with a gradient that still needs unscaling and those gradients,
        the checks that already covered others (from the ledger), and the params with
        neither."""
        return self._ledger.split(params, self._version)

    def _rescale_held(self, params: list[Any]) -> None:
        """Brings gradients this scaler unscaled, and that still hold those values,
        back to the current scale, in one fused multiply: the backward about to run
        adds scaled gradients to them, and one unscale afterwards then gives the true
        sum (automatic mode's accumulation; docs/DROP_IN.md). The flag is not read: a
        gradient that is inf/NaN (or becomes so) stays so, and that unscale finds it."""
        held = self._ledger.held(params, self._version)
        if held and self._dev is not None:
            self._dev.rescale(held)
        elif held:  # the fused check-and-multiply kernel, given the scale itself
            self._be().unscale_and_check(held, self._scale_value)

    def _scaled_or_idle(self, pending: list[Any], idle: list[Any], what: str
                        ) -> tuple[Any, bool]:
        """Whether ``pending`` may be unscaled: returns ``(agreement, unscale)`` for
        ``_check``, or raises if nothing was scaled since the last update.

        One exception to the raise: a rank of a job whose checks are agreed across ranks
        (a process_group, FSDP) that had no loss this step -- an empty micro-batch, an
        expert that got no tokens -- may still hold gradients (zeroed in place). They are
        not scaled, so they are checked as they are, not divided, and the rank joins the
        other ranks' decision instead of leaving them waiting in the collective.
        """
        if self._handed_watched or self._handed_blind:
            self._require_scaled(what)  # raises only if no backward used the scale
            return False, True
        agreement = distributed.plan(self._be(), pending, idle, self._process_group)
        if agreement is None:
            self._require_scaled(what)  # raises
        return agreement, False

    def _require_scaled(self, what: str) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs)"
               " earlier in the iteration.")
        if not (self._handed_watched or self._handed_blind):
            raise RuntimeError(
                f"Attempted {what} but nothing was scaled since the last update().  {fix}"
                f" Unscaling now would divide unscaled gradients by the scale"
                f" ({self._scale_value:g}); call scaler.scale(loss).backward(),"
                f" gm.backward(scaler.scale(loss)) or scaler.backward(gm, loss) first."
            )
        if self._handed_watched and not self._handed_blind and not self._saw_backward:
            raise RuntimeError(
                f"Attempted {what} but no backward pass has gone through a scaler.scale()"
                f" output since the last update(): these gradients were not produced by a"
                f" scaled loss, and unscaling would divide them by the scale"
                f" ({self._scale_value:g}). Call .backward() on scaler.scale(loss), not on"
                f" the loss itself."
            )

    def _check(self, params: list[Any], *, grads: list[Any] | None = None,
               idle: Sequence[Any] = (), agreement: Any = False,
               unscale: bool = True, read: bool = True, allow_fp16: bool = False) -> Check:
        """Checks the gradients of ``params`` for inf/NaN in one fused call, unscaling
        them too unless a fused optimizer will. ``read`` reads the verdict at once (the
        sync); otherwise it is read when first needed.

        In a multi-process job the verdict is agreed across ranks (distributed.py);
        ``idle`` (the target's params without a gradient here) then take part too, and
        ``agreement`` may pass the plan when the caller made it already. ``grads``:
        the gradients of ``params``, where the caller has them already.
        """
        backend = self._be()
        if agreement is False:
            agreement = distributed.plan(backend, params, list(idle), self._process_group)
        if grads is None:
            grads = backend.grads(params)
        if agreement is not None and agreement.standins:
            grads = grads + agreement.standins
        caps = self._caps()
        if not allow_fp16 and not caps.rejects_non_float32:
            self._refuse_fp16(grads)
        flag = None
        if grads:
            try:
                if self._dev is not None:
                    flag = (self._dev.unscale_and_check(grads) if unscale
                            else self._dev.check(grads))
                else:
                    flag = backend.unscale_and_check(grads,
                                                     self._inv_scale() if unscale else 1.0)
            except ValueError:
                if not allow_fp16:
                    self._refuse_fp16(grads)  # float16 gets the core's words
                raise
        if agreement is not None:
            check = agreement.check(flag, params or list(idle))
            # Every rank now covers the same parameters, gradient or not.
            self._ledger.record(list(idle), [None] * len(idle), check)
        else:
            check = Check(None, False) if flag is None else Check(flag, None)
        if check.found is None:
            check.on_overflow = self._forensics.hook(params, backend, self._steps + 1)
        if read:
            check.verdict(self._read)  # the one sync
        self._checks.append(check)
        return check

    def _refuse_fp16(self, grads: list[Any]) -> None:
        is_fp16 = self._caps().is_fp16
        for dtype in {g.dtype for g in grads}:
            if is_fp16(dtype):
                raise ValueError(
                    "Attempting to unscale FP16 gradients. GradScaler needs float32"
                    " parameters (and so float32 gradients): keep the model in float32"
                    " and let autocast run the low-precision ops."
                )

    def _unscale(self, target: Any, what: str, *, drop: bool,
                 params: list[Any] | None = None) -> None:
        """unscale()/unscale_(): the shared part. ``drop``: megengine.amp's form;
        ``params``: the target's parameters, where the caller has them already."""
        state = None
        if is_optimizer(target):
            state = self._opt_state(target)
            if state.stage is _Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last"
                    " update(). Unscaling twice would divide its gradients by the scale"
                    " twice; call scaler.update() to finish the iteration first."
                )
            if state.stage is _Stage.STEPPED:
                raise RuntimeError(
                    "unscale_() is being called after step(). Unscale before"
                    " scaler.step(optimizer) (step() unscales by itself when you don't)."
                )
        if params is None:
            params = params_of(target, self._be(), f"GradScaler.{what}")
        distributed.note_module(self._be(), target)
        pending, grads, done, idle = self._split(params)
        if done:
            raise RuntimeError(
                f"{what} has already been called on these gradients: no backward pass"
                f" the scaler could see (through scaler.scale() or scaler.backward()) has"
                f" written them since they were unscaled. Unscaling twice would divide"
                f" them by the scale twice. Unscale each set of gradients once, after all"
                f" of its backward passes (scaler.backward(gm, loss) already unscales"
                f" unless unscale_grad=False); a gm.backward(loss, dy=scale_factor) into"
                f" gradients that were not cleared also adds to unscaled ones."
            )
        agreement, unscale = False, True
        if pending:
            agreement, unscale = self._scaled_or_idle(pending, idle, what)
            distributed.require_synced(self._be(), pending, f"GradScaler.{what}")
        if state is not None:
            self._steps_on_device(target)  # a fused optimizer moves the scale to the device
        # megengine.amp's form must read the verdict now, to drop; torch.amp's reads it
        # in step(), as torch.amp does.
        check = self._check(pending, grads=grads, idle=idle, agreement=agreement,
                            unscale=unscale, read=drop)
        if drop and check.found:
            self._be().drop_grads(pending)
            grads = [None] * len(pending)
        # torch.amp's unscale_ is followed by step() and update() within the iteration;
        # megengine.amp's unscale may be followed by the next forward instead.
        self._ledger.record(pending, grads, check, weak=drop)
        if state is not None:
            state.stage = _Stage.UNSCALED
            state.checks.append(check)

    def _on_scaled_backward(self, *_: Any) -> None:
        # Called by the adapter when a backward pass runs through a scale() output
        # (with its framework's hook arguments, or none).
        self._saw_backward = True
        self._ledger.new_backward(self._version)

    def _step_unless_found(self, optimizer: Any, checks: list[Check], on_device: bool,
                           fused_unscale: bool, args: tuple, kwargs: dict) -> Any:
        if any(c.found is True for c in checks):
            return None
        if on_device:
            assert self._dev is not None  # _steps_on_device() made it
            return self._dev.step(optimizer, fused_unscale,
                                  [c.ready() for c in checks if c.flag is not None],
                                  args, kwargs)
        if any(c.verdict(self._read) for c in checks):  # the one sync per step
            return None
        return optimizer.step(*args, **kwargs)

    def _tail_step(self, optimizer: Any, checks: list[Check], on_device: bool,
                   args: tuple, kwargs: dict) -> Any:
        previous = self._tail.get(id(optimizer))
        if previous is not None and len(previous) == len(checks) and all(
                any(c is k for k in previous) for c in checks):
            raise RuntimeError(
                "step() has already been called on these gradients: scaler.backward(gm,"
                " loss) unscaled them and called update(), and scaler.step(optimizer)"
                " then stepped them once. Run the next backward pass first."
            )
        self._tail[id(optimizer)] = checks
        return self._step_unless_found(optimizer, checks, on_device, False, args, kwargs)

    def _update(self, new_scale: Any) -> None:
        if new_scale is not None:
            new_scale = self._valid_scale(new_scale, "update(new_scale=...)")
        elif not self._checks:
            raise self._nothing_checked()
        checked = bool(self._checks)
        if self._dev is not None:
            if checked:
                self._steps += 1
            found_host = any(c.found is True for c in self._checks)
            flags = [c.ready() for c in self._checks if c.found is None]
            for c in self._checks:
                c.on_overflow = None  # never read on the host, so never reported
            self._dev.update(found_host, flags, self._growth_factor,
                             self._backoff_factor, self._growth_interval,
                             steps=self._steps, count=checked, new_scale=new_scale)
        else:
            found = any([c.verdict(self._read) for c in self._checks])
            if new_scale is not None:
                self._scale_value = new_scale
            else:
                self._scale_value, self._tracker = next_scale(
                    self._scale_value, self._tracker, found,
                    self._growth_factor, self._backoff_factor, self._growth_interval,
                )
            if checked:
                self._count_step(found)
            self._mirror()
        self._updated_by_backward = False
        self._new_iteration()

    def _nothing_checked(self) -> RuntimeError:
        hint = (" scaler.backward(gm, loss) already unscaled this iteration's gradients and"
                " called update(); drop this update() call, or pass"
                " backward(..., update_scale=False) to update yourself."
                if self._updated_by_backward else
                " Call scaler.step(optimizer), scaler.unscale_(optimizer) or"
                " scaler.unscale(gm) first, or pass update(new_scale=...).")
        return RuntimeError("No inf checks were recorded prior to update()." + hint)

    def _count_step(self, skipped: bool) -> None:
        self._steps += 1
        self._skipped_steps += int(skipped)
        self._last_step_skipped = skipped
        self._as_of_step = self._steps
        self._forensics.counted(skipped, self._scale_value, self._steps)

    def _set_scale(self, value: float) -> None:
        self._refuse_in_trace("Setting GradScaler.scale_factor", "write")
        self._scale_value = value
        if self._dev is not None:
            self._dev.load(value, None)
        self._mirror()

    def _sync_from_device(self) -> None:
        """Reads the device-resident scale and tracker back (a sync, as torch.amp's
        get_scale() is)."""
        if self._dev is not None:
            self._scale_value, self._tracker = self._dev.read()

    def _valid_scale(self, value: Any, what: str) -> float:
        return valid_scale(value, what, self._be)
