"""The loop's two busiest calls, ``scaler.backward(gm, loss)`` and ``scaler.step(opt)``.

Each is written out for the usual step, where nothing else is in play (the scale on the
host, no trace, one process, and for ``step()`` an ordinary optimizer not yet unscaled
this iteration, with no record of the ledger alive), and takes there the same decisions
as the general path of the state machine (``ScalerMachine``, _scaler_machine.py), in
fewer calls: on a small model the step's host time is the budget, and these run every
step. Anything else goes to the general path: ``ScalerMachine.backward`` and ``_step``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

from .. import _foreign
from .. import distributed
from ._ledger import Check, by_grad
from ..errors import ScalerStateError
from ._forensics import _user_stacklevel
from ._iteration import Iteration, Stage
from ._machine import ScalerMachine
from ._targets import params_of

__all__: list[str] = []


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler_kwarg(optimizer_class: Any) -> bool:
    # torch's older contract for optimizers that unscale themselves: the scaler passes
    # itself as step(grad_scaler=...). Asked once per class: inspect.signature is slow.
    try:
        return "grad_scaler" in inspect.signature(optimizer_class.step).parameters
    except (TypeError, ValueError):
        return False


def backward(m: ScalerMachine, gm: Any, y: Any, dy: Any, unscale_grad: bool,
             update_scale: bool) -> None:
    """``scaler.backward(gm, loss)``; written out where the usual automatic step needs
    nothing more: the scale on the host, no trace, no ``dy``, one process, unscale and
    update."""
    caps, s, it = m.caps, m.s, m.it
    tracer = caps.tracer
    if (not (unscale_grad and update_scale) or dy is not None or s.dev is not None
            or (tracer is not None and tracer.trace_mode() is not None)
            or not m.solo()):
        return m.backward(gm, y, dy, unscale_grad, update_scale)
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
    it.handed_blind = True
    m.forensics.loss = ys[0] if ys else None
    gm.backward(ys, cotangents)
    # Every attached gradient is new: the ledger has nothing to say about them.
    pending, grads, _, _ = by_grad(attached)
    if pending:
        try:
            flag = backend.unscale_and_check(grads, s.inv(), False)
        except ValueError:
            caps.refuse_fp16(grads)
            raise
        check = Check(flag, None, None,
                      m.forensics.hook(pending, backend, s.steps + 1))
        it.add(check)
        found = check.verdict(backend.flag_is_set)  # the one sync
        check.flag = None  # read: the verdict is all that is needed of it from now on
        if found:
            backend.drop_grads(pending)
            grads = [None] * len(pending)
            m.forensics.overflowed_without_update(it.overflows(), s.value)
        if it.watched:
            m.record(pending, grads, check, weak=True)
        else:
            ledger.record(pending, grads, check, weak=True)
    else:
        it.add(Check(None, False))
        found = False
    if len(it.checks) == 1 and not it.folded:  # update(), for this one read check
        s.advance(found, True)
        m.forensics.counted(found, s.value, s.steps)
        m.it = Iteration()
        m.forensics.end_iteration()
    else:
        m.finish(None)  # not the user's: the ledger's iteration goes on
    m.updated_by_backward = True
    ledger.weaken()  # the user's step, zero_grad and next forward follow


def step(m: ScalerMachine, optimizer: Any, args: tuple, kwargs: dict) -> Any:
    """``scaler.step(optimizer)``; written out where the usual torch.amp step needs
    nothing more: the scale on the host, no trace, no record alive, one process, an
    optimizer that neither skips by itself nor was unscaled this iteration, and
    gradients to check."""
    it, caps, s = m.it, m.caps, m.s
    if (id(optimizer) in it.opt_states or s.dev is not None or caps.tracer is not None
            or it.records_wait or not m.ledger.empty()
            or getattr(optimizer, "_step_supports_amp_scaling", False)):
        return _step(m, optimizer, args, kwargs)
    backend = caps.backend
    pending, grads, _, idle = by_grad(m.optimizer_params(optimizer, backend))
    if not pending or not m.solo():
        return _step(m, optimizer, args, kwargs)
    if not (it.handed_blind or it.saw_backward):
        it.require_scaled("step()", s.value, caps.probes)  # raises unless scaled
    try:
        flag = backend.unscale_and_check(grads, s.inv(), False)
    except ValueError:
        caps.refuse_fp16(grads)
        raise
    check = Check(flag, None, None, m.forensics.hook(pending, backend, s.steps + 1))
    it.add(check)
    m.record(pending, grads, check, weak=False)  # held until update()
    state = it.opt_state(optimizer)
    result = None if check.verdict(backend.flag_is_set) else m.call_step(optimizer, args,
                                                                         kwargs)
    state.stage = Stage.STEPPED
    state.checks = [check]
    return result


def _step(m: ScalerMachine, optimizer: Any, args: tuple, kwargs: dict) -> Any:
    state = m.it.opt_state(optimizer)
    if state.stage is Stage.STEPPED:
        raise RuntimeError(
            "step() has already been called since the last update(). Call"
            " scaler.update() once per iteration, after stepping every optimizer."
        )
    if getattr(optimizer, "_step_supports_amp_scaling", False) and \
            _takes_grad_scaler_kwarg(optimizer.__class__):
        # The optimizer unscales and checks by itself, asking this scaler.
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword argument to the"
            " passed optimizer. In the near future GradScaler registers `grad_scale:"
            " Tensor` and `found_inf: Tensor` to the passed optimizer and let the"
            " optimizer use them directly.",
            FutureWarning,
            stacklevel=_user_stacklevel(),
        )
        result = optimizer.step(*args, **dict(kwargs, grad_scaler=m.scaler()))
        state.stage = Stage.STEPPED
        return result
    caps = m.caps
    # A fused optimizer skips on the device by itself; inside a trace the adapter's
    # device scale skips for any optimizer (_tracing.py).
    fused = caps.resident is not None and m.steps_on_device(optimizer)
    on_device = fused or (caps.tracer is not None and m.traced("GradScaler.step()"))
    params = m.optimizer_params(optimizer, caps.backend)
    pending, grads, done, idle = m.split(params)
    if state.stage is Stage.READY and not pending and done and not any(
            c is k for c in done for k in m.it.checks):
        # Every gradient was decided by checks that an update() already consumed:
        # scaler.backward(gm, loss) then step(opt). This step ends that iteration.
        return _tail_step(m, optimizer, done, on_device, args, kwargs)
    checks = list(state.checks)
    checks += [c for c in done if all(c is not k for k in checks)]
    fused_unscale = False
    agreement = None
    solo = m.solo()
    if state.stage is Stage.READY and not pending and idle and not solo:
        # No gradient here, but another rank may have some: take part in its check.
        agreement = m.plan([], idle)
    if state.stage is Stage.READY and (pending or agreement is not None):
        unscale = True
        if pending:
            agreement, unscale = m.scaled_or_idle(pending, idle, "step()", solo)
            if not solo:
                distributed.require_synced(caps.backend, pending, "GradScaler.step()")
        # A fused optimizer unscales inside its own kernel (grad_scale), as with
        # torch.amp -- unless some of its gradients were unscaled already.
        fused_unscale = fused and not done and unscale
        check = m.check(pending, grads=grads, idle=idle,
                        agreement=None if solo else agreement or False,
                        unscale=unscale and not fused_unscale, read=False,
                        allow_fp16=fused_unscale)
        if not fused_unscale:
            # held until update(), which torch.amp's loop calls next
            m.record(pending, grads, check, weak=False)
        checks.append(check)
    if not checks and not fused:
        raise ScalerStateError(
            "No inf checks were recorded for this optimizer: none of its parameters"
            " has a gradient. Run the scaled backward pass before"
            " scaler.step(optimizer)."
        )
    result = _step_unless_found(m, optimizer, checks, on_device, fused_unscale, args,
                                kwargs)
    state.stage = Stage.STEPPED
    state.checks = checks  # every check that decided this step
    return result


def _step_unless_found(m: ScalerMachine, optimizer: Any, checks: list[Check],
                       on_device: bool, fused_unscale: bool, args: tuple,
                       kwargs: dict) -> Any:
    if any(c.found is True for c in checks):
        return None
    if on_device:
        assert m.s.dev is not None  # steps_on_device() or traced() made it
        resident = m.caps.resident
        if resident is not None and resident.skip_leaves_uninitialised_state(optimizer):
            # Skipped on the device, this step would leave state that the next one
            # reads uninitialised (torch's fused SGD before its first step: torch.amp
            # inherits it). Read the verdict and skip here, as the stock optimizer is
            # skipped: one host read, only until a step is taken.
            read = m.backend.flag_is_set
            if any(c.verdict(read) for c in checks if c.flag is not None):
                return None
        return m.s.dev.step(optimizer, fused_unscale,
                            [c.ready() for c in checks if c.flag is not None],
                            args, kwargs)
    read = m.backend.flag_is_set
    if any(c.verdict(read) for c in checks):  # the one sync per step
        return None
    return m.call_step(optimizer, args, kwargs)


def _tail_step(m: ScalerMachine, optimizer: Any, checks: list[Check], on_device: bool,
               args: tuple, kwargs: dict) -> Any:
    previous = m.tail.get(id(optimizer))
    if previous is not None and len(previous) == len(checks) and all(
            any(c is k for k in previous) for c in checks):
        raise RuntimeError(
            "step() has already been called on these gradients: scaler.backward(gm,"
            " loss) unscaled them and called update(), and scaler.step(optimizer)"
            " then stepped them once. Run the next backward pass first."
        )
    m.tail[id(optimizer)] = checks
    return _step_unless_found(m, optimizer, checks, on_device, False, args, kwargs)
