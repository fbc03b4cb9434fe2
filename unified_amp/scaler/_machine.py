"""GradScaler's state machine: one object that a GradScaler holds and delegates to.

``ScalerMachine`` holds everything a scaler knows -- the scale and its telemetry
(``ScaleState``, _scaler_state.py), per-optimizer stages, the checks since the last
``update()``, the ledger of unscaled gradient generations (_ledger.py), the overflow
reports (_scaler_forensics.py) -- and runs the loop's operations on it: ``scale``,
``backward``, ``unscale``, ``update`` (``step`` and the usual ``backward(gm, loss)`` are
_step.py's, on this machine). Each splits a target's gradients into
still-scaled / already-checked / idle (the ledger), refuses an unscale that would be
wrong, runs one fused check (``check``: agreed across ranks where needed,
distributed.py), and ``finish`` ends the iteration.

Where the usual step needs nothing of a part, it pays nothing for it: one process asks
the adapter once whether there are other ranks; an adapter without traces never asks
about them; the usual torch.amp step has no record alive when it steps, so it looks
nothing up.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from .. import _foreign
from .. import _tracing, distributed
from ._ledger import Check, GradLedger, by_grad
from .._registry import get_backend
from ._scale_rule import valid_scale
from ._forensics import Forensics
from ._iteration import Iteration, Stage
from ._state import Caps, ScaleState
from ..errors import ScalerStateError
from ._targets import OptimizerParams, each_tensor, is_optimizer, params_of

__all__: list[str] = []


class ScalerMachine:
    """The state and the operations of one GradScaler (see the module's doc)."""

    def __init__(self, scaler: Any, enabled: bool, device: str | None, group: Any,
                 numbers: ScaleState) -> None:
        self.enabled = enabled
        self.device = device  # the constructor's, or None
        self.group = group  # GradScaler(process_group=...)
        self.s = numbers
        self.backend: Any = None  # resolved on first use
        # What the adapter provides, asked once (made here for an enabled scaler: only
        # an enabled one runs the operations below).
        self.caps: Caps = None  # type: ignore[assignment]
        self.ledger = GradLedger()
        self.forensics = Forensics(self, enabled)
        self.updated_by_backward = False  # the last update() was backward()'s own
        # optimizer id -> the checks behind its last step after backward()'s update()
        self.tail: dict[int, list[Check]] = {}
        self.optimizer_params = OptimizerParams()
        self.scaler = weakref.ref(scaler)  # its public get_scale(), for reports
        # An adapter may take the optimizer's own step out of step() (defer_steps): torch
        # does inside a compiled function, so that dynamo compiles the optimizer's step
        # as it does under torch.amp, while the scaler's host work runs eagerly.
        self.defer_steps = False
        self.deferred: tuple[Any, tuple, dict] | None = None
        self._new_iteration()
        if enabled:
            self._caps()  # (an adapter with traces calls flush_trace_copy from now on)

    def call_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(*args, **kwargs)``, or, with ``defer_steps``, a note for the
        caller to make that call itself (and None)."""
        if self.defer_steps:
            self.deferred = (optimizer, args, kwargs)
            return None
        return optimizer.step(*args, **kwargs)

    # -- the adapter ----------------------------------------------------------------------
    def be(self) -> Any:
        if self.backend is None:
            self.backend = get_backend()
        return self.backend

    def _caps(self) -> Caps:
        caps = self.caps
        if caps is None:
            caps = self.caps = Caps(self.be())
            if caps.tracer is not None:  # keep the trace copy current before each trace
                _tracing.follow(caps.tracer, self.flush_trace_copy)
        return caps

    def current_scale(self) -> float:
        self.s.sync_from_device()
        return self.s.value

    def overflows_since_update(self) -> int:
        return self.it.overflows()

    def _new_iteration(self) -> None:
        self.it = Iteration()
        self.forensics.end_iteration()

    # -- traces (_tracing.py has the policy) ----------------------------------------------
    def traced(self, what: str) -> bool:
        """Whether ``what`` runs inside a trace, raising where it cannot run there as it
        does eagerly (then the scale stays on the device: ScaleState.enter_trace)."""
        tracer = self.caps.tracer
        if tracer is None or tracer.trace_mode() is None:
            return False
        self.s.enter_trace(tracer, what)
        return True

    def refuse_in_trace(self, what: str, kind: str) -> None:
        """Raises if ``what``, a call that needs the host, runs inside a trace."""
        if self.enabled:
            tracer = self.caps.tracer
            if tracer is not None and tracer.trace_mode() is not None:
                raise _tracing.refuse(tracer, what, kind)

    def flush_trace_copy(self) -> None:
        """The adapter calls this right before each traced call starts, outside it."""
        if self.enabled and self.caps is not None and self.caps.tracer is not None:
            self.s.mirror(self.caps.tracer)

    # -- scaling ----------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        caps = self.caps
        if caps.tracer is not None:
            self.traced("GradScaler.scale()")
        if not caps.backend.is_tensor(outputs):
            self.forensics.saw_loss(outputs)
            return self._scaled(outputs, "outputs", caps)
        # The usual call, one loss, written out: it runs every step.
        self.forensics.loss = outputs
        dev = self.s.dev
        out = dev.scale(outputs) if dev is not None else caps.backend.scale(outputs,
                                                                           self.s.value)
        self.it.handed(None if caps.probes is None else caps.probes.backward_token(out))
        self.ledger.new_backward(caps.version)  # a backward may follow
        return out

    def _scaled(self, val: Any, where: str, caps: Caps) -> Any:
        backend = caps.backend
        if not backend.is_tensor(val):
            return each_tensor(val, where, lambda v, w: self._scaled(v, w, caps), backend)
        dev = self.s.dev
        out = dev.scale(val) if dev is not None else backend.scale(val, self.s.value)
        self.it.handed(None if caps.probes is None else caps.probes.backward_token(out))
        # A backward may follow: the records' versions are read now, before it.
        self.ledger.new_backward(caps.version)
        return out

    def backward(self, gm: Any, y: Any, dy: Any, unscale_grad: bool,
                 update_scale: bool) -> None:
        caps = self.caps
        if caps.tracer is not None:
            if unscale_grad:
                self.refuse_in_trace("GradScaler.backward(gm, loss)", "backward")
            self.traced("GradScaler.backward(gm, loss, unscale_grad=False)")
        ys = [] if y is None else list(y) if isinstance(y, (list, tuple)) else [y]
        _foreign.require_tensors(caps.backend, ys, "GradScaler.backward(gm, y)",
                                 "Pass the loss (or outputs) the forward pass recorded.")
        if dy is None:
            dys = None
        else:
            dys = list(dy) if isinstance(dy, (list, tuple)) else [dy]
            if len(dys) != len(ys):
                raise ValueError(
                    f"GradScaler.backward() got {len(ys)} output(s) y but {len(dys)}"
                    f" cotangent(s) dy; pass one dy per y, or dy=None for ones."
                )
        backend, s = caps.backend, self.s
        if s.dev is not None:
            cotangents = s.dev.scaled_cotangents(ys, dys)
        else:
            cotangents = backend.scaled_cotangents(ys, dys, s.value)
        attached = params_of(gm, backend, "GradScaler.backward()")
        # This backward writes a new generation of gm's gradients.
        held = self.ledger.begin_backward(attached, caps.version)
        if held:  # bring them back to the scale: one unscale afterwards gives the true sum
            if s.dev is not None:
                s.dev.rescale(held)
            else:  # the fused check-and-multiply kernel, given the scale itself
                backend.unscale_and_check(held, s.value, True)
        self.it.handed(None)
        self.forensics.saw_loss(ys)
        gm.backward(ys, cotangents)
        if unscale_grad:
            # Every attached gradient is new: the ledger has nothing to say about them.
            self.unscale(gm, "unscale()", True, attached)
            if update_scale:
                self.finish(None)  # not the user's: the ledger's iteration goes on
                self.updated_by_backward = True
            self.ledger.weaken()  # the user's step, zero_grad and next forward follow

    # -- unscaling --------------------------------------------------------------------------
    def unscale(self, target: Any, what: str, drop: bool,
                fresh: list[Any] | None = None) -> None:
        """unscale() (``drop``: megengine.amp's form, the verdict read at once and the
        overflowed gradients dropped) and unscale_(). ``fresh``: the target's
        parameters, when a backward pass this scaler ran just wrote all their gradients
        (nothing to look up)."""
        caps = self.caps
        state = None
        if fresh is None and is_optimizer(target):
            state = self.it.opt_state(target)
            if state.stage is Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last"
                    " update(). Unscaling twice would divide its gradients by the scale"
                    " twice; call scaler.update() to finish the iteration first."
                )
            if state.stage is Stage.STEPPED:
                raise RuntimeError(
                    "unscale_() is being called after step(). Unscale before"
                    " scaler.step(optimizer) (step() unscales by itself when you don't)."
                )
        backend = caps.backend
        if fresh is None:
            params = params_of(target, backend, f"GradScaler.{what}")
            distributed.note_module(backend, target)
            pending, grads, done, idle = self.split(params)
        else:
            pending, grads, done, idle = by_grad(fresh)
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
        solo = self.solo()
        agreement, unscale = None if solo else False, True
        if pending:
            agreement, unscale = self.scaled_or_idle(pending, idle, what, solo)
            if not solo:
                distributed.require_synced(backend, pending, f"GradScaler.{what}")
        if state is not None:
            self.steps_on_device(target)  # a fused optimizer moves the scale to the device
        # megengine.amp's form must read the verdict now, to drop; torch.amp's reads it
        # in step(), as torch.amp does.
        check = self.check(pending, grads=grads, idle=idle, agreement=agreement,
                           unscale=unscale, read=drop)
        if drop and check.found:
            backend.drop_grads(pending)
            grads = [None] * len(pending)
            self.forensics.overflowed_without_update(self.it.overflows(),
                                                     self.s.value)
        # torch.amp's unscale_ is followed by step() and update() within the iteration;
        # megengine.amp's unscale may be followed by the next forward instead.
        self.record(pending, grads, check, weak=drop)
        if state is not None:
            state.stage = Stage.UNSCALED
            state.checks.append(check)

    def split(self, params: list[Any]
              ) -> tuple[list[Any], list[Any], list[Check], list[Any]]:
        """``params`` with a gradient that still needs unscaling and those gradients,
        the checks that already covered others (from the ledger), and the params with
        neither."""
        caps = self.caps
        if self.it.records_wait and self.it.late_backward(caps.probes):
            self.ledger.new_backward(caps.version)  # that backward ran after the record
        return self.ledger.split(params, caps.version)

    def record(self, params: list[Any], grads: list[Any], check: Check,
               weak: bool) -> None:
        it, caps = self.it, self.caps
        if params and it.watched and it.waiting(caps.probes):
            # A backward through a scale() output made before this record may run after
            # it: keep the gradients' versions as they are now, to compare with then.
            it.records_wait = True
            self.ledger.record(params, grads, check, weak=weak, version=caps.version)
        else:
            self.ledger.record(params, grads, check, weak=weak)

    # -- the misuse checks --------------------------------------------------------------------
    def scaled_or_idle(self, pending: list[Any], idle: list[Any], what: str,
                       solo: bool) -> tuple[Any, bool]:
        """Whether ``pending`` may be unscaled: returns ``(agreement, unscale)`` for
        ``check``, or raises if nothing was scaled since the last update.

        One exception to the raise: a rank of a job whose checks are agreed across ranks
        (a process_group, FSDP) that had no loss this step -- an empty micro-batch, an
        expert that got no tokens -- may still hold gradients (zeroed in place). They are
        not scaled, so they are checked as they are, not divided, and the rank joins the
        other ranks' decision instead of leaving them waiting in the collective.
        """
        it = self.it
        if it.handed_watched or it.handed_blind:
            self.require_scaled(what)  # raises only if no backward used the scale
            return None if solo else False, True
        agreement = None if solo else self.plan(pending, idle)
        if agreement is None:
            self.require_scaled(what)  # raises
        return agreement, False

    def require_scaled(self, what: str) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        self.it.require_scaled(what, self.s.value, self.caps.probes)

    # -- the fused check ----------------------------------------------------------------------
    def solo(self) -> bool:
        """Whether no other rank takes part in this scaler's decisions (no process
        group given, one process): then no check needs agreement, and nothing waits in
        a no_sync() window. One question to the adapter."""
        collectives = self.caps.collectives
        return self.group is None and (collectives is None
                                       or collectives.world_group() is None)

    def plan(self, params: list[Any], idle: Sequence[Any]) -> Any:
        """The cross-rank agreement a check needs (distributed.py), or None."""
        if self.solo():
            return None
        return distributed.plan(self.backend, params, list(idle), self.group)

    def check(self, params: list[Any], *, grads: list[Any] | None = None,
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
        caps = self.caps
        backend, s = caps.backend, self.s
        if agreement is False:
            agreement = self.plan(params, idle)
        if grads is None:
            grads = backend.grads(params)
        if agreement is not None and agreement.standins:
            grads = grads + agreement.standins
        flag = None
        if grads:
            dev = s.dev
            try:
                if dev is None:
                    # The adapter refuses a float16 gradient unless allowed (ValueError)
                    flag = backend.unscale_and_check(grads, s.inv() if unscale else 1.0,
                                                     allow_fp16)
                else:
                    if not allow_fp16:
                        caps.refuse_fp16(grads)
                    flag = dev.unscale_and_check(grads) if unscale else dev.check(grads)
            except ValueError:
                if not allow_fp16:
                    caps.refuse_fp16(grads)  # float16 gets the core's words
                raise
        if agreement is not None:
            check = agreement.check(flag, params or list(idle))
            # Every rank now covers the same parameters, gradient or not.
            self.ledger.record(list(idle), [None] * len(idle), check)
        else:
            check = Check(None, False) if flag is None else Check(flag, None)
        self.it.add(check)
        if check.found is None:
            check.on_overflow = self.forensics.hook(params, backend, s.steps + 1)
            if read:
                check.verdict(backend.flag_is_set)  # the one sync
        return check

    # -- stepping -----------------------------------------------------------------------------
    def steps_on_device(self, optimizer: Any) -> bool:
        resident = self.caps.resident
        if resident is None or not resident.steps_on_device(optimizer):
            return False
        s = self.s
        if s.dev is None:
            s.dev = resident.device_scale(optimizer, s.value, s.tracker, s.skipped_steps)
        return True

    # -- the end of an iteration ----------------------------------------------------------------
    def update(self, new_scale: Any) -> None:
        if new_scale is not None:
            self.refuse_in_trace("GradScaler.update(new_scale=...)", "write")
        if self.caps.tracer is not None:
            self.traced("GradScaler.update()")
        self.finish(new_scale)
        self.ledger.new_iteration()

    def finish(self, new_scale: Any) -> None:
        if new_scale is not None:
            new_scale = valid_scale(new_scale, "update(new_scale=...)", self.be)
        it = self.it
        checks, checked = it.checks, it.checked()
        if new_scale is None and not checked:
            raise self._nothing_checked()
        s = self.s
        if s.dev is not None:
            if checked:
                s.steps += 1
            found_host = bool(it.folded_found) or any(c.found is True for c in checks)
            flags = [c.ready() for c in checks if c.found is None]
            for c in checks:
                c.on_overflow = None  # never read on the host, so never reported
            s.dev.update(found_host, flags, s.growth_factor, s.backoff_factor,
                         s.growth_interval, steps=s.steps, count=checked,
                         new_scale=new_scale)
        else:
            read = self.backend.flag_is_set
            found = bool(it.folded_found)
            for c in checks:  # every verdict read: each check's report must run
                if c.verdict(read):
                    found = True
            if new_scale is None:
                s.advance(found, checked)
            else:
                s.value = new_scale
                if checked:
                    s.count(found)
            if checked:
                self.forensics.counted(found, s.value, s.steps)
        self.updated_by_backward = False
        self.it = Iteration()
        self.forensics.end_iteration()

    def _nothing_checked(self) -> ScalerStateError:
        hint = (" scaler.backward(gm, loss) already unscaled this iteration's gradients and"
                " called update(); drop this update() call, or pass"
                " backward(..., update_scale=False) to update yourself."
                if self.updated_by_backward else
                " Call scaler.step(optimizer), scaler.unscale_(optimizer) or"
                " scaler.unscale(gm) first, or pass update(new_scale=...).")
        return ScalerStateError("No inf checks were recorded prior to update()." + hint)
