"""The scale's way out and back, on the machine (_machine.py): the loop's calls but step.

``scale`` and ``backward(gm, loss)`` hand the scale out (noted in the iteration's
``Handout``); ``unscale`` (megengine.amp's ``unscale(gm)``; torch.amp's
``unscale_(optimizer)``, READY -> UNSCALED) divides it back out of a target's gradients
through the machine's fused check; ``update`` ends the iteration: it counts the checks,
moves the scale by the rule and starts a new ``Iteration``. ``backward`` is written out
first for the usual automatic step (the scale on the host, no trace, no ``dy``, one
process): on a small model the step's host time is the budget, and it runs every step.
"""

from __future__ import annotations

from typing import Any

from .. import _foreign, distributed
from ..errors import ScalerStateError
from ._machine import Check, ScalerMachine, Stage, by_grad, refuse_fp16
from .._scale_rule import valid_scale
from ._state import Caps
from ._targets import each_tensor, is_optimizer, params_of

__all__: list[str] = []


def scale(m: ScalerMachine, outputs: Any) -> Any:
    """``scaler.scale(outputs)``: a tensor, or any nesting of them, times the scale."""
    caps = m.caps
    if caps.tracer is not None:
        caps.traced(m.s, "GradScaler.scale()")
    if not caps.backend.is_tensor(outputs):
        m.forensics.saw_loss(outputs)
        return _scaled(m, outputs, "outputs", caps)
    # The usual call, one loss, written out: it runs every step.
    if m.dropped:
        m.dropped.forget()
    m.forensics.loss = outputs
    dev = m.s.dev
    out = dev.scale(outputs) if dev is not None else caps.backend.scale(outputs,
                                                                       m.s.value)
    m.it.handout.handed(None if caps.probes is None else caps.probes.backward_token(out))
    m.ledger.new_backward(caps.version)  # a backward may follow
    return out


def _scaled(m: ScalerMachine, val: Any, where: str, caps: Caps) -> Any:
    backend = caps.backend
    if not backend.is_tensor(val):
        return each_tensor(val, where, lambda v, w: _scaled(m, v, w, caps), backend)
    if m.dropped:
        m.dropped.forget()
    dev = m.s.dev
    out = dev.scale(val) if dev is not None else backend.scale(val, m.s.value)
    m.it.handout.handed(None if caps.probes is None else caps.probes.backward_token(out))
    # A backward may follow: the records' versions are read now, before it.
    m.ledger.new_backward(caps.version)
    return out


def backward(m: ScalerMachine, gm: Any, y: Any, dy: Any, unscale_grad: bool,
             update_scale: bool) -> None:
    """``scaler.backward(gm, loss)``; written out where the usual automatic step needs
    nothing more: the scale on the host, no trace, no ``dy``, one process, unscale and
    update."""
    caps, s, it = m.caps, m.s, m.it
    if m.dropped:
        m.dropped.forget()
    tracer = caps.tracer
    if (not (unscale_grad and update_scale) or dy is not None or s.dev is not None
            or (tracer is not None and tracer.trace_mode() is not None)
            or not m.solo()):
        return _backward(m, gm, y, dy, unscale_grad, update_scale)
    backend, ledger, version = caps.backend, m.ledger, caps.version
    ys = [] if y is None else list(y) if isinstance(y, (list, tuple)) else [y]
    _foreign.require_tensors(backend, ys, "GradScaler.backward(gm, y)",
                             "Pass the loss (or outputs) the forward pass recorded.")
    cotangents = backend.scaled_cotangents(ys, None, s.value)
    attached = params_of(gm, backend, "GradScaler.backward()")
    # This backward writes a new generation of the attached gradients.
    held = ledger.begin_backward(attached, version)
    if held:  # back to the scale: one unscale afterwards gives the true sum
        backend.unscale_and_check(held, s.value, True)
    it.handout.handed_blind = True
    m.forensics.loss = ys[0] if ys else None
    gm.backward(ys, cotangents)
    # Every attached gradient is new: the ledger has nothing to say about them.
    pending, grads, _, _ = by_grad(attached)
    if pending:
        try:
            flag = backend.unscale_and_check(grads, s.inv(), False)
        except ValueError:
            refuse_fp16(caps, grads)
            raise
        check = Check(flag, None, None,
                      m.forensics.hook(pending, backend, s.steps + 1))
        it.add(check)
        found = check.verdict(backend.flag_is_set)  # the one sync
        check.flag = None  # read: the verdict is all that is needed of it from now on
        if found:
            backend.drop_grads(pending)
            m.dropped.add(pending)
            grads = [None] * len(pending)
            m.forensics.overflowed_without_update(it.overflows(), s.value)
        if it.handout.watched:
            m.record(pending, grads, check, weak=True)
        else:
            ledger.record(pending, grads, check, weak=True)
    else:
        it.add(Check(None, False))
        found = False
    if len(it.checks) == 1 and not it.folded:  # update(), for this one read check
        s.advance(found, True)
        m.forensics.counted(found, s.value, s.steps)
        m.new_iteration()
    else:
        finish(m, None)  # not the user's: the ledger's iteration goes on
    m.updated_by_backward = True
    ledger.weaken()  # the user's step, zero_grad and next forward follow


def _backward(m: ScalerMachine, gm: Any, y: Any, dy: Any, unscale_grad: bool,
              update_scale: bool) -> None:
    """``scaler.backward(gm, y, dy)``'s general path: any ``dy``, a trace, the scale on
    the device, several ranks, ``unscale_grad``/``update_scale`` off."""
    caps = m.caps
    if caps.tracer is not None:
        if unscale_grad:
            m.refuse_in_trace("GradScaler.backward(gm, loss)", "backward")
        caps.traced(m.s, "GradScaler.backward(gm, loss, unscale_grad=False)")
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
    backend, s = caps.backend, m.s
    if s.dev is not None:
        cotangents = s.dev.scaled_cotangents(ys, dys)
    else:
        cotangents = backend.scaled_cotangents(ys, dys, s.value)
    attached = params_of(gm, backend, "GradScaler.backward()")
    # This backward writes a new generation of gm's gradients.
    held = m.ledger.begin_backward(attached, caps.version)
    if held:  # bring them back to the scale: one unscale afterwards gives the true sum
        if s.dev is not None:
            s.dev.rescale(held)
        else:  # the fused check-and-multiply kernel, given the scale itself
            backend.unscale_and_check(held, s.value, True)
    m.it.handout.handed(None)
    m.forensics.saw_loss(ys)
    gm.backward(ys, cotangents)
    if unscale_grad:
        # Every attached gradient is new: the ledger has nothing to say about them.
        unscale(m, gm, "unscale()", True, attached)
        if update_scale:
            finish(m, None)  # not the user's: the ledger's iteration goes on
            m.updated_by_backward = True
        m.ledger.weaken()  # the user's step, zero_grad and next forward follow


def unscale(m: ScalerMachine, target: Any, what: str, drop: bool,
            fresh: list[Any] | None = None) -> None:
    """unscale() (``drop``: megengine.amp's form, the verdict read at once and the
    overflowed gradients dropped) and unscale_(). ``fresh``: the target's
    parameters, when a backward pass this scaler ran just wrote all their gradients
    (nothing to look up)."""
    caps = m.caps
    state = None
    if fresh is None and is_optimizer(target):
        state = m.it.opt_state(target)
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
        pending, grads, done, idle = m.split(params)
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
    solo = m.solo()
    agreement, unscale = None if solo else False, True
    if pending:
        agreement, unscale = m.scaled_or_idle(pending, idle, what, solo)
        if not solo:
            distributed.require_synced(backend, pending, f"GradScaler.{what}")
    if state is not None:
        m.steps_on_device(target)  # a fused optimizer moves the scale to the device
    # megengine.amp's form must read the verdict now, to drop; torch.amp's reads it
    # in step(), as torch.amp does.
    check = m.check(pending, grads=grads, idle=idle, agreement=agreement,
                       unscale=unscale, read=drop)
    if drop and check.found:
        backend.drop_grads(pending)
        m.dropped.add(pending)
        grads = [None] * len(pending)
        m.forensics.overflowed_without_update(m.it.overflows(),
                                                 m.s.value)
    # torch.amp's unscale_ is followed by step() and update() within the iteration;
    # megengine.amp's unscale may be followed by the next forward instead.
    m.record(pending, grads, check, weak=drop)
    if state is not None:
        state.stage = Stage.UNSCALED
        state.checks.append(check)


# -- the end of an iteration ----------------------------------------------------------------
def update(m: ScalerMachine, new_scale: Any) -> None:
    """``scaler.update(new_scale)``: ends the iteration and the ledger's records."""
    if new_scale is not None:
        m.refuse_in_trace("GradScaler.update(new_scale=...)", "write")
    if m.caps.tracer is not None:
        m.caps.traced(m.s, "GradScaler.update()")  # (the scale stays on the device)
    finish(m, new_scale)
    m.ledger.new_iteration()


def finish(m: ScalerMachine, new_scale: Any) -> None:
    """Counts this iteration's checks (every verdict read, so each report runs), moves
    the scale by the rule (or sets ``new_scale``) and starts a new ``Iteration``."""
    if new_scale is not None:
        new_scale = valid_scale(new_scale, "update(new_scale=...)", m.be)
    it = m.it
    checks, checked = it.checks, it.checked()
    if new_scale is None and not checked:
        raise _nothing_checked(m)
    s = m.s
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
        read = m.backend.flag_is_set
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
            m.forensics.counted(found, s.value, s.steps)
    m.updated_by_backward = False
    m.new_iteration()


def _nothing_checked(m: ScalerMachine) -> ScalerStateError:
    hint = (" scaler.backward(gm, loss) already unscaled this iteration's gradients and"
            " called update(); drop this update() call, or pass"
            " backward(..., update_scale=False) to update yourself."
            if m.updated_by_backward else
            " Call scaler.step(optimizer), scaler.unscale_(optimizer) or"
            " scaler.unscale(gm) first, or pass update(new_scale=...).")
    return ScalerStateError("No inf checks were recorded prior to update()." + hint)
