"""GradScaler's state machine: one record per iteration, and every transition over it.

A ``GradScaler`` (_grad_scaler.py) holds one ``ScalerMachine`` and hands each call of
the loop to the method of the same name: ``scale``, ``backward`` (megengine.amp's
automatic step: scaled backward, unscale, update), ``unscale`` (megengine.amp's
``unscale`` and torch.amp's ``unscale_``), ``step`` and ``update``. Each reads top to
bottom, as torch.amp's ``GradScaler.step`` does: check the stage, unscale what is still
scaled (``check``: the one fused check-and-unscale, which agrees across ranks by itself
where needed: distributed.py), read the verdict (``skips``, ``read_verdict``: the one
host sync), step or skip, record the stage. ``step()`` has that one path for every
optimizer, as torch's has.

What one iteration (from one ``update()`` to the next) records is one ``Iteration``
(_iteration.py): each optimizer's stage with the checks that decided it, every
``Check`` that ``update()`` must count, and how the scale went out. What outlives an
iteration: the numbers (``ScaleState``, _state.py: the scale, where it lives, the
telemetry), the ledger of unscaled gradient generations (``GradLedger``, _ledger.py),
the marks of dropped gradients (_overflowed.py) and the optimizers' parameter lists
(_targets.py).

The machine announces what happened to its listeners (``Listener``): the scale went out,
a check found an inf/NaN, gradients were dropped, an update was counted, the iteration
ended. Overflow forensics (forensics.py) is one, subscribed by GradScaler; the machine
imports none.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any, Protocol, Sequence

from .. import _foreign, _overflowed, _scaled, _tracing, distributed
from .._registry import get_backend
from .._scale_rule import valid_scale
from ..errors import OverflowWarning, ScalerStateError, _user_stacklevel
from ..capabilities import (BackwardProbes, Collectives, DeviceResident, GradVersions,
                            Tracing, capability)
from ._iteration import Check, Iteration, OptimizerStage, Stage
from ._ledger import GradLedger, Split, _no_version, by_grad
from ._state import ScaleState
from ._targets import OptimizerParams, each_tensor, is_optimizer, params_of

__all__: list[str] = []

class Listener(Protocol):
    """What a machine announces (``ScalerMachine.listeners``)."""

    def scaled(self, outputs: Any, checks: int) -> None:
        """The scale went out on ``outputs`` (the loss, or a list of outputs), after
        ``checks`` checks of this iteration (a check since the last ``scaled`` ends a
        set of micro-batches)."""

    def overflow_found(self, params: list[Any], step: int, scale: float,
                       overflows_since_update: int) -> None:
        """A check of the gradients of ``params`` read an inf/NaN, before anything
        dropped them: in scaler step ``step``, scaled by ``scale``;
        ``overflows_since_update`` checks since the last update() found one, this one
        included."""

    def updated(self, skipped: bool, scale: float, step: int) -> None:
        """An update() that followed a check: step ``step`` was skipped or taken, and
        the scale is now ``scale``."""

    def iteration_ended(self) -> None:
        """The iteration ended (update(), or the one backward(gm, loss) runs)."""


class Capabilities:
    """The adapter's optional capabilities that the machine calls, asked once per scaler
    (a step asks several times; each is a fact about the adapter's class)."""

    __slots__ = ("backend", "backward_probes", "grad_version", "device_resident",
                 "tracing", "collectives", "is_float16")

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.backward_probes = capability(backend, BackwardProbes)
        versions = capability(backend, GradVersions)
        self.grad_version = _no_version if versions is None else versions.grad_version
        self.device_resident = capability(backend, DeviceResident)
        self.tracing = capability(backend, Tracing)
        self.collectives = capability(backend, Collectives)
        self.is_float16: dict[Any, bool] = {}  # dtype -> whether it is float16 (asked once)


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler_kwarg(optimizer_class: Any) -> bool:
    # Asked once per class: inspect.signature is slow.
    try:
        return "grad_scaler" in inspect.signature(optimizer_class.step).parameters
    except (TypeError, ValueError):
        return False


def _asks_the_scaler(optimizer: Any) -> bool:
    """torch's older contract for optimizers that unscale and check by themselves: they
    take the scaler as step(grad_scaler=...)."""
    return (getattr(optimizer, "_step_supports_amp_scaling", False)
            and _takes_grad_scaler_kwarg(optimizer.__class__))


class ScalerMachine:
    """The state and the transitions of one GradScaler (see the module's doc)."""

    def __init__(self, scaler: Any, enabled: bool, device: str | None, process_group: Any,
                 scale_state: ScaleState) -> None:
        self.enabled = enabled
        self.device = device  # the constructor's, or None
        self.process_group = process_group  # GradScaler(process_group=...)
        self.scale_state = scale_state
        self.listeners: list[Listener] = []
        self._backend: Any = None  # resolved on first use
        # The adapter's optional capabilities, asked once (made here for an enabled
        # scaler: only an enabled one runs the transitions below).
        self.caps: Capabilities = None  # type: ignore[assignment]
        self.iteration = Iteration()
        self.ledger = GradLedger()
        self.dropped = _overflowed.Dropped()  # marks for clip_grad_norm, till the next scale
        self.updated_by_backward = False  # the last update() was backward()'s own
        # optimizer id -> the checks, consumed by backward()'s own update(), that decided
        # its last step (scaler.backward(gm, loss) then scaler.step(opt))
        self.stepped_after_update: dict[int, list[Check]] = {}
        self.optimizer_params = OptimizerParams()
        self.scaler = weakref.ref(scaler)  # for step(grad_scaler=...)
        self.ref = weakref.ref(self)  # what the marks of scaled gradients hold (_scaled.py)
        self.in_backward = False  # inside backward(gm, loss), which marks by itself
        # An adapter may take the optimizer's own step out of step(): torch does inside
        # a compiled function, so that dynamo compiles the optimizer's step as it does
        # under torch.amp, while the scaler's host work runs eagerly (AdapterView).
        self.defer_optimizer_step = False
        self.deferred_step: tuple[Any, tuple, dict] | None = None
        if enabled:
            self.caps = Capabilities(self.backend)
            if self.caps.tracing is not None:  # keep the trace copy current
                _tracing.follow(self.caps.tracing, self.flush_trace_copy)

    @property
    def backend(self) -> Any:
        """The adapter, resolved on first use."""
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    # -- gradients still scaled (_scaled.py: clip_grad_norm refuses them) ------------------
    def hand_out(self, token: Any) -> None:
        """The scale went out (``Iteration.hand_out``)."""
        self.iteration.hand_out(token)
        _scaled.handed_out(self.ref)

    def scaled_backward(self, ys: list[Any], dys: list[Any] | None) -> bool:
        """Whether a GradManager's backward pass of ``ys`` carries this scaler's scale:
        a ``scale()`` output of this iteration, or a ``dy`` after ``scale_factor`` was
        read (its own backward(gm, loss) marks what it leaves scaled itself)."""
        iteration = self.iteration
        if self.in_backward:
            return False
        if dys is not None:
            return iteration.handed_unwatched
        outputs = iteration.scaled_outputs
        return any(ref() is y for ref in outputs for y in ys)

    def unscaled(self, params: list[Any]) -> bool:
        """Whether a check unscaled every gradient ``params`` hold now."""
        try:
            pending = self.split(params)[0]
        except RuntimeError:  # gradients that mix both: unscale() says so, not clip
            return True
        return not pending

    def current_scale(self) -> float:
        self.scale_state.sync_from_device()
        return self.scale_state.scale

    # -- scale ------------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``scaler.scale(outputs)``: a tensor, or any nesting of them, times the scale."""
        caps = self.caps
        if caps.tracing is not None:
            self.traced("GradScaler.scale()")
        backend = caps.backend
        if backend.is_tensor(outputs):
            scaled = self._scale_tensor(outputs, "outputs")
        else:
            scaled = each_tensor(outputs, "outputs", self._scale_tensor, backend)
        for listener in self.listeners:
            listener.scaled(outputs, self.iteration.checks_made())
        return scaled

    def _scale_tensor(self, tensor: Any, where: str) -> Any:
        if self.dropped:  # the scale goes out for new gradients
            self.dropped.forget()
        caps, device_scale = self.caps, self.scale_state.device_scale
        if device_scale is not None:
            out = device_scale.scale(tensor)
        else:
            out = caps.backend.scale(tensor, self.scale_state.scale)
        probes = caps.backward_probes
        self.hand_out(None if probes is None else probes.backward_token(out))
        self.iteration.scaled(out)
        # A backward may follow: the records' versions are read now, before it.
        self.ledger.new_backward(caps.grad_version)
        return out

    # -- backward(gm, loss): scaled backward, unscale, update -------------------------------
    def backward(self, gm: Any, y: Any, dy: Any, unscale_grad: bool,
                 update_scale: bool) -> None:
        """``scaler.backward(gm, y, dy)``: the scaled backward pass, then (by default)
        megengine.amp's ``unscale`` of the gradients it wrote and an ``update()``."""
        caps, scale_state = self.caps, self.scale_state
        if self.dropped:
            self.dropped.forget()
        if caps.tracing is not None:
            if unscale_grad:
                self.refuse_in_trace("GradScaler.backward(gm, loss)", "backward")
            self.traced("GradScaler.backward(gm, loss, unscale_grad=False)")
        backend = caps.backend
        ys = [] if y is None else list(y) if isinstance(y, (list, tuple)) else [y]
        _foreign.require_tensors(backend, ys, "GradScaler.backward(gm, y)",
                                 "Pass the loss (or outputs) the forward pass recorded.")
        dys = None
        if dy is not None:
            dys = list(dy) if isinstance(dy, (list, tuple)) else [dy]
            if len(dys) != len(ys):
                raise ValueError(
                    f"GradScaler.backward() got {len(ys)} output(s) y but {len(dys)}"
                    f" cotangent(s) dy; pass one dy per y, or dy=None for ones."
                )
        device_scale = scale_state.device_scale
        if device_scale is not None:
            cotangents = device_scale.scaled_cotangents(ys, dys)
        else:
            cotangents = backend.scaled_cotangents(ys, dys, scale_state.scale)
        attached = params_of(gm, backend, "GradScaler.backward()")
        # This backward writes a new generation of the attached gradients.
        held = self.ledger.begin_backward(attached, caps.grad_version)
        if held:  # back to the scale: one unscale afterwards gives the true sum
            if device_scale is not None:
                device_scale.rescale(held)
            else:  # the fused check-and-multiply kernel, given the scale itself
                backend.unscale_and_check(held, scale_state.scale, True)
        self.hand_out(None)
        for listener in self.listeners:
            listener.scaled(ys, self.iteration.checks_made())
        self.in_backward = True
        try:
            gm.backward(ys, cotangents)
        finally:
            self.in_backward = False
        if not unscale_grad:
            _scaled.mark(attached, self, self.ref)  # left scaled, to accumulate
            return
        # Every attached gradient is new: the ledger has nothing to say about them.
        self.unscale(gm, "unscale()", drop=True, split=by_grad(attached))
        if update_scale:
            self._end_iteration(None)  # not the user's: the ledger's records go on
            self.updated_by_backward = True
        self.ledger.weaken()  # the user's step, zero_grad and next forward follow

    # -- unscale ----------------------------------------------------------------------------
    def unscale(self, target: Any, what: str, drop: bool, split: Split | None = None
                ) -> None:
        """megengine.amp's ``unscale(target)`` (``drop``: the verdict read at once, the
        overflowed gradients dropped) and torch.amp's ``unscale_(optimizer)`` (READY ->
        UNSCALED; the verdict read in ``step()``). ``split``: the target's gradients as
        ``split`` gives them, where a backward pass this scaler ran just wrote them all
        (nothing to look up)."""
        fresh, stage = split is not None, None  # fresh: backward()'s own gradients
        if not fresh and is_optimizer(target):
            stage = self.iteration.optimizers[id(target)]
            if stage.stage is Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last"
                    " update(). Unscaling twice would divide its gradients by the scale"
                    " twice; call scaler.update() to finish the iteration first."
                )
            if stage.stage is Stage.STEPPED:
                raise RuntimeError(
                    "unscale_() is being called after step(). Unscale before"
                    " scaler.step(optimizer) (step() unscales by itself when you don't)."
                )
        backend = self.caps.backend
        if split is None:
            params = params_of(target, backend, f"GradScaler.{what}")
            distributed.note_module(backend, target)
            split = self.split(params)
        pending, grads, done, _ = split
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
        if self.iteration.overflowed and pending:
            self.warn_if_no_update_since_overflow(pending)
        if stage is not None:
            self.steps_on_device(target)  # a fused optimizer moves the scale to the device
        # megengine.amp's form must read the verdict now, to drop; torch.amp's reads it
        # in step(), as torch.amp does.
        check = self.check(split, what, read=drop)
        if check is None:  # nothing to check: what update() counts all the same
            check = Check(None, False)
            self.iteration.add(check)
        if drop and check.found:
            backend.drop_grads(pending)  # so that any optimizer step leaves them alone
            self.dropped.add(pending)  # (marked for clip_grad_norm)
            grads = [None] * len(pending)
        if fresh:
            check.flag = None  # read: the verdict is all its records need from now on
        # torch.amp's unscale_ is followed by step() and update() within the iteration;
        # megengine.amp's unscale may be followed by the next forward instead.
        self.record(pending, grads, check, weak=drop)
        if stage is not None:
            stage.stage = Stage.UNSCALED
            stage.checks.append(check)

    # -- step: the stage; unscale what is still scaled; the verdict; step or skip ----------
    def step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """``scaler.step(optimizer, *args, **kwargs)``: unscales what is still scaled,
        then steps unless a check of its gradients found an inf/NaN."""
        caps = self.caps
        stage = self.iteration.optimizers[id(optimizer)]
        if stage.stage is Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call"
                " scaler.update() once per iteration, after stepping every optimizer."
            )
        checks: list[Check] = []
        on_device = after_update = by_optimizer = False
        if _asks_the_scaler(optimizer):
            # torch's older contract for optimizers that unscale and check by themselves:
            # this scaler goes with the step (step(grad_scaler=...)), which decides.
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the"
                " passed optimizer. In the near future GradScaler registers `grad_scale:"
                " Tensor` and `found_inf: Tensor` to the passed optimizer and let the"
                " optimizer use them directly.",
                FutureWarning,
                stacklevel=_user_stacklevel(),
            )
            kwargs = dict(kwargs, grad_scaler=self.scaler())
        else:
            # A fused optimizer skips on the device by itself; inside a trace the
            # adapter's device scale skips for any optimizer (_tracing.py).
            fused = caps.device_resident is not None and self.steps_on_device(optimizer)
            on_device = fused or (caps.tracing is not None and self.traced("GradScaler.step()"))
            split = self.split(self.optimizer_params(optimizer, caps.backend))
            after_update = bool(split.done) and self.decided_before_update(
                optimizer, stage, split)
            # the checks that decided it already: an update()'s, or this iteration's
            checks = list(split.done) if after_update else stage.checks + [
                c for c in split.done if all(c is not k for k in stage.checks)
            ] if split.done else list(stage.checks)
            if stage.stage is Stage.READY and not after_update:
                # Unscale what is still scaled: a fused optimizer unscales inside its own
                # kernel (grad_scale), as with torch.amp, unless some of its gradients
                # were unscaled already.
                check = self.check(split, "step()", read=False,
                                   fused=fused and not split.done)
                if check is not None:
                    by_optimizer = check.by_optimizer
                    if not by_optimizer:  # held until update(), which comes next
                        self.record(split.pending, split.grads, check, weak=False)
                    checks.append(check)
            if not checks and not fused:
                raise ScalerStateError(
                    "No inf checks were recorded for this optimizer: none of its"
                    " parameters has a gradient. Run the scaled backward pass before"
                    " scaler.step(optimizer)."
                )
        # The verdict (the one sync), or, on the device, the flags for the optimizer.
        if self.skips(optimizer, checks, on_device):
            result = None
        elif on_device:
            assert self.scale_state.device_scale is not None  # made by steps_on_device/traced
            result = self.scale_state.device_scale.step(
                optimizer, by_optimizer, [c.ready() for c in checks if c.flag is not None],
                args, kwargs)
        else:
            result = self._call_optimizer_step(optimizer, args, kwargs)
        if not after_update:
            stage.stage, stage.checks = Stage.STEPPED, checks  # the checks that decided it
        return result

    def decided_before_update(self, optimizer: Any, stage: OptimizerStage,
                              split: Split) -> bool:
        """Whether checks an update() already consumed decided this step
        (scaler.backward(gm, loss), then step(opt)): it ends that iteration and starts
        no stage of this one. Raises for a second step on the same gradients."""
        done = split.done
        if stage.stage is not Stage.READY or split.pending or not done or any(
                c is k for c in done for k in self.iteration.checks):
            return False
        previous = self.stepped_after_update.get(id(optimizer))
        if previous is not None and len(previous) == len(done) and all(
                any(c is k for k in previous) for c in done):
            raise RuntimeError(
                "step() has already been called on these gradients:"
                " scaler.backward(gm, loss) unscaled them and called update(), and"
                " scaler.step(optimizer) then stepped them once. Run the next"
                " backward pass first."
            )
        self.stepped_after_update[id(optimizer)] = done
        return True

    def skips(self, optimizer: Any, checks: list[Check], on_device: bool) -> bool:
        """Whether a step decided by ``checks`` is skipped on the host: a check found an
        inf/NaN (the verdicts read here, the one sync); on the device, never, the
        optimizer's kernel reads the flags there."""
        for c in checks:  # (loops, not any(): no generator frame on the step's path)
            if c.found is True:
                return True
        if not on_device:
            for c in checks:
                if self.read_verdict(c):
                    return True
            return False
        resident = self.caps.device_resident
        if resident is not None and resident.skip_leaves_uninitialised_state(optimizer):
            # Skipped on the device, this step would leave state that the next one
            # reads uninitialised (torch's fused SGD before its first step, which
            # torch.amp inherits): its verdict is read and it skips here, as the stock
            # optimizer does (one host read, only until a step is taken).
            return any(self.read_verdict(c) for c in checks if c.flag is not None)
        return False

    def _call_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(*args, **kwargs)``, or, with ``defer_optimizer_step``, a note
        for the adapter to make that call itself (and None)."""
        if self.defer_optimizer_step:
            self.deferred_step = (optimizer, args, kwargs)
            return None
        return optimizer.step(*args, **kwargs)

    def steps_on_device(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` skips on the device by itself (torch's fused ones); the
        first time one does, the scale moves to the device for good."""
        resident = self.caps.device_resident
        if resident is None or not resident.steps_on_device(optimizer):
            return False
        scale_state = self.scale_state
        if scale_state.device_scale is None:
            scale_state.device_scale = resident.device_scale(
                optimizer, scale_state.scale, scale_state.growth_tracker,
                scale_state.skipped_steps)
        return True

    # -- update -----------------------------------------------------------------------------
    def update(self, new_scale: Any) -> None:
        """``scaler.update(new_scale)``: ends the iteration and the ledger's records."""
        if new_scale is not None:
            self.refuse_in_trace("GradScaler.update(new_scale=...)", "write")
        if self.caps.tracing is not None:
            self.traced("GradScaler.update()")  # (the scale stays on the device)
        self._end_iteration(new_scale)
        self.ledger.new_iteration()

    def _end_iteration(self, new_scale: Any) -> None:
        """Counts this iteration's checks (every verdict read, so each overflow is
        announced), moves the scale by the rule (or sets ``new_scale``) and starts a
        new ``Iteration``."""
        if new_scale is not None:
            new_scale = valid_scale(new_scale, "update(new_scale=...)", lambda: self.backend)
        iteration, scale_state = self.iteration, self.scale_state
        checks, checked = iteration.checks, iteration.checked()
        if new_scale is None and not checked:
            raise self._nothing_checked()
        device_scale = scale_state.device_scale
        if device_scale is not None:
            if checked:
                scale_state.steps += 1
            found_host = bool(iteration.folded_overflows) or any(
                c.found is True for c in checks)
            flags = [c.ready() for c in checks if c.found is None]
            for c in checks:
                c.params = None  # never read on the host, so never announced
            device_scale.update(found_host, flags, scale_state.growth_factor,
                                scale_state.backoff_factor, scale_state.growth_interval,
                                steps=scale_state.steps, count=checked,
                                new_scale=new_scale)
        else:
            found = bool(iteration.folded_overflows)
            for c in checks:  # every verdict read: each overflow must be announced
                if self.read_verdict(c):
                    found = True
            if new_scale is None:
                scale_state.advance(found, checked)
            else:
                scale_state.scale = new_scale
                if checked:
                    scale_state.count(found)
            if checked:
                for listener in self.listeners:
                    listener.updated(found, scale_state.scale, scale_state.steps)
        self.updated_by_backward = False
        self.iteration = Iteration()
        for listener in self.listeners:
            listener.iteration_ended()

    def _nothing_checked(self) -> ScalerStateError:
        hint = (" scaler.backward(gm, loss) already unscaled this iteration's gradients and"
                " called update(); drop this update() call, or pass"
                " backward(..., update_scale=False) to update yourself."
                if self.updated_by_backward else
                " Call scaler.step(optimizer), scaler.unscale_(optimizer) or"
                " scaler.unscale(gm) first, or pass update(new_scale=...).")
        return ScalerStateError("No inf checks were recorded prior to update()." + hint)

    # -- the fused check and its verdict ---------------------------------------------------
    def check(self, split: Split, what: str | None, *, read: bool,
              fused: bool = False) -> Check | None:
        """The one fused check of ``split.pending``'s gradients for inf/NaN, unscaling
        them too (``fused``: unless the optimizer's own kernel will), agreed across
        ranks (distributed.py): the target's parameters without a gradient here take
        part too, and a rank whose gradients were never scaled (no loss this step: an
        empty micro-batch, an expert without tokens) checks its zeroed gradients as they
        are, to join the others' decision. None where there is nothing to check and no
        other rank to join. ``read``: the verdict now (the sync), else when first
        needed. ``what`` names the call for the "nothing was scaled" errors (None: the
        adapter checks without unscaling, AdapterView.check_only)."""
        pending, grads, _, idle = split
        solo = self.solo()
        agreement = None if solo else \
            distributed.plan(self.backend, pending, idle, self.process_group)
        if not pending and agreement is None:
            return None
        divide = what is not None
        if pending and what is not None:
            iteration = self.iteration
            if iteration.handed_watched or iteration.handed_unwatched:
                if not (iteration.handed_unwatched or iteration.backward_seen):
                    self.require_scaled(what)  # raises if no backward used the scale
            elif agreement is None:
                self.require_scaled(what)  # raises: nothing was scaled
            else:
                divide = False
            if not solo:  # (DDP too: no agreement, but no_sync() windows)
                distributed.require_synced(self.backend, pending, f"GradScaler.{what}")
        if agreement is not None and agreement.standins:
            grads = grads + agreement.standins
        by_optimizer = fused and divide
        flag = self._fused_check(grads, divide and not by_optimizer,
                                 by_optimizer or what is None) if grads else None
        reduction = None
        if agreement is not None:
            flag, reduction = agreement.reduce(flag, pending or idle)
        check = Check(None, False) if flag is None else \
            Check(flag, None, reduction, pending, self.scale_state.steps + 1)
        check.by_optimizer = by_optimizer
        if agreement is not None:  # every rank now covers the same parameters
            self.ledger.record(idle, [None] * len(idle), check)
        self.iteration.add(check)
        if read and check.found is None:
            self.read_verdict(check)  # the one sync
        return check

    def _fused_check(self, grads: list[Any], unscale: bool, allow_fp16: bool) -> Any:
        """The adapter's fused kernel over ``grads``: checks them, unscaling too
        (``unscale``), by the scale where it lives; returns the device flag."""
        device_scale = self.scale_state.device_scale
        try:
            if device_scale is None:
                # The adapter refuses a float16 gradient unless allowed (ValueError)
                return self.caps.backend.unscale_and_check(
                    grads, self.scale_state.inverse() if unscale else 1.0, allow_fp16)
            if not allow_fp16:
                self._refuse_float16(grads)
            return device_scale.unscale_and_check(grads) if unscale \
                else device_scale.check(grads)
        except ValueError:
            if not allow_fp16:
                self._refuse_float16(grads)  # float16 gets the core's words
            raise

    def read_verdict(self, check: Check) -> bool:
        """The check's host verdict, reading its flag (a host sync) the first time only;
        an inf/NaN is announced then, before anyone drops the gradients it describes."""
        if check.found is None:
            found = check.found = bool(self.caps.backend.flag_is_set(check.ready()))
            params, check.params = check.params, None
            if found and params is not None:
                self.iteration.overflow_at(params, check.step)
                if self.listeners:
                    scale, overflows = self.current_scale(), self.iteration.overflows()
                    for listener in self.listeners:
                        listener.overflow_found(params, check.step, scale, overflows)
        return check.found

    def warn_if_no_update_since_overflow(self, params: list[Any]) -> None:
        """Warns once per iteration where a check of ``params`` follows one that found an
        inf/NaN in their gradients with no update() between: the next iteration, with
        update() forgotten (megengine.amp's forms allow unscaling again; only update()
        backs the scale off, so the later steps may overflow and be dropped as well)."""
        iteration = self.iteration
        overflowed = iteration.overflowed
        if iteration.warned_no_update or not any(id(p) in overflowed for p in params):
            return
        iteration.warned_no_update = True
        warnings.warn(OverflowWarning(
            f"unified_amp: a gradient check found inf/NaN gradients (step"
            f" {iteration.overflow_step}) and the next check of the same gradients came"
            f" with no scaler.update() between them: the loss scale stays"
            f" {self.scale_state.scale:g}, since only update() backs it off, so the"
            f" following steps may overflow and be dropped too. Call scaler.update()"
            f" once per iteration, after the optimizer step (megengine.amp's manual form:"
            f" gm.backward(scaler.scale(loss)), scaler.unscale(gm), opt.step(),"
            f" scaler.update(); scaler.backward(gm, loss, update_scale=False) leaves"
            f" update() to you)."), stacklevel=_user_stacklevel())

    def _refuse_float16(self, grads: list[Any]) -> None:
        """Raises torch.amp's ValueError if a gradient is float16 (each dtype asked once)."""
        known_dtypes = self.caps.is_float16
        for dtype in {g.dtype for g in grads}:
            known = known_dtypes.get(dtype)
            if known is None:
                known = known_dtypes[dtype] = \
                    self.caps.backend.dtype_name(dtype) == "float16"
            if known:
                raise ValueError(
                    "Attempting to unscale FP16 gradients. GradScaler needs float32"
                    " parameters (and so float32 gradients): keep the model in float32"
                    " and let autocast run the low-precision ops."
                )

    # -- a target's gradients, as the ledger splits and records them -----------------------
    def split(self, params: list[Any]) -> Split:
        """``params`` with a gradient that still needs unscaling and those gradients,
        the checks that already covered others (from the ledger), and the params with
        neither."""
        caps, iteration = self.caps, self.iteration
        if iteration.recorded_while_awaiting and \
                iteration.backward_since_record(caps.backward_probes):
            self.ledger.new_backward(caps.grad_version)  # it ran after the record
        return self.ledger.split(params, caps.grad_version)

    def record(self, params: list[Any], grads: list[Any], check: Check,
               weak: bool) -> None:
        """Notes in the ledger that ``check`` covered these gradients (``weak``: hold
        none of them alive)."""
        iteration, caps = self.iteration, self.caps
        if params and iteration.awaiting_backward and \
                iteration.still_awaiting(caps.backward_probes):
            # A backward through a scale() output made before this record may run after
            # it: keep the gradients' versions as they are now, to compare with then.
            iteration.recorded_while_awaiting = True
            self.ledger.record(params, grads, check, weak=weak, version=caps.grad_version)
        else:
            self.ledger.record(params, grads, check, weak=weak)

    def require_scaled(self, what: str) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        self.iteration.require_scaled(what, self.scale_state.scale,
                                      self.caps.backward_probes)

    # -- other ranks (distributed.py) --------------------------------------------------------
    def solo(self) -> bool:
        """Whether no other rank takes part in this scaler's decisions (no process
        group given, one process): then no check needs agreement, and nothing waits in
        a no_sync() window. One question to the adapter."""
        collectives = self.caps.collectives
        return self.process_group is None and (collectives is None
                                               or collectives.world_group() is None)

    # -- traces (_tracing.py has the policy) -----------------------------------------------
    def traced(self, what: str) -> bool:
        """Whether ``what`` runs inside a trace, raising where it cannot run there as it
        does eagerly (then the scale stays on the device: ScaleState.enter_trace)."""
        tracing = self.caps.tracing
        if tracing is None or tracing.trace_mode() is None:
            return False
        self.scale_state.enter_trace(tracing, what)
        return True

    def refuse_in_trace(self, what: str, kind: str) -> None:
        """Raises if ``what``, a call that needs the host, runs inside a trace."""
        if self.enabled:
            tracing = self.caps.tracing
            if tracing is not None and tracing.trace_mode() is not None:
                raise _tracing.refuse(tracing, what, kind)

    def flush_trace_copy(self) -> None:
        """The adapter calls this right before each traced call starts, outside it."""
        if self.enabled and self.caps is not None and self.caps.tracing is not None:
            self.scale_state.mirror(self.caps.tracing)
