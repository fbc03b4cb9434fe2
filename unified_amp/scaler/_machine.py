"""GradScaler's state machine: what one iteration records, the stages, and ``step``.

A ``GradScaler`` (_grad_scaler.py) holds one ``ScalerMachine`` and delegates to it.
An ``Iteration`` records, until the next ``update()``, each optimizer's ``Stage``
(torch.amp's READY -> UNSCALED -> STEPPED), every ``Check`` (one fused check-and-unscale
over a set of gradients: its device flag and, once read, its verdict) and how the scale
went out (_handout.py). ``step`` reads top to bottom: check the stage, unscale what is
still scaled (``check``, agreed across ranks where needed: distributed.py), read the
verdict, step or skip, record the stage; the usual torch.amp step is written out first,
paying nothing for parts it does not need. The other calls (scale, backward(gm, loss),
unscale, update) are _scaling.py's, on this machine. The parts it holds: ``ScaleState``
(_state.py), the ``GradLedger`` of unscaled gradient generations (_ledger.py),
``Forensics`` (_forensics.py) and the optimizers' parameter lists (_targets.py).
"""

from __future__ import annotations

import enum
import functools
import inspect
import operator
import warnings
import weakref
from typing import Any, Callable, Sequence

from .. import _overflowed, _tracing, distributed
from .._registry import get_backend
from ..errors import ScalerStateError
from ._forensics import Forensics, _user_stacklevel
from ._handout import Handout
from ._ledger import GradLedger
from ._state import Caps, ScaleState
from ._targets import OptimizerParams

__all__: list[str] = []

# Checks kept before the read ones are folded into counts (a loop of megengine.amp's
# manual form that never calls update() would otherwise check without end).
_MAX_CHECKS = 64


class Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class OptState:
    """One optimizer's progress through the iteration (torch.amp's stages)."""

    __slots__ = ("stage", "checks")

    def __init__(self) -> None:
        self.stage = Stage.READY
        self.checks: list[Check] = []  # the checks that covered its gradients


class Iteration:
    """What happened since the last ``update()``: each optimizer's stage (keyed by
    ``id()``: the keys live for one iteration only), every check that ``update()`` must
    count, and how the scale was handed out."""

    __slots__ = ("opt_states", "checks", "folded", "folded_found", "handout")

    def __init__(self) -> None:
        self.opt_states: dict[int, OptState] = {}
        self.checks: list[Check] = []
        self.folded = 0  # read checks folded into counts, and how many found inf/NaN
        self.folded_found = 0
        self.handout = Handout()  # how the scale went out (_handout.py)

    def opt_state(self, optimizer: Any) -> OptState:
        state = self.opt_states.get(id(optimizer))
        if state is None:
            state = self.opt_states[id(optimizer)] = OptState()
        return state

    def add(self, check: Check) -> None:
        checks = self.checks
        checks.append(check)
        if len(checks) > _MAX_CHECKS:
            self._fold()

    def _fold(self) -> None:
        """Folds the read checks into counts (update() needs only whether one found an
        inf/NaN), keeping those an optimizer's stage refers to."""
        kept = {id(c) for st in self.opt_states.values() for c in st.checks}
        folded = [c for c in self.checks if c.found is not None and id(c) not in kept]
        self.folded += len(folded)
        self.folded_found += sum(1 for c in folded if c.found)
        gone = {id(c) for c in folded}
        self.checks = [c for c in self.checks if id(c) not in gone]

    def checked(self) -> bool:
        return bool(self.checks) or bool(self.folded)

    def overflows(self) -> int:
        """Checks of this iteration that found an inf/NaN (read so far)."""
        return self.folded_found + sum(1 for c in self.checks if c.found)


class Check:
    """One fused check (usually with unscale) over a set of gradients: ``flag``, the
    adapter's device-side flag (None: no gradients); ``found``, the host verdict once
    read (None while unread); ``pending``, the handle of a cross-rank all-reduce still
    running on ``flag`` (distributed.py); ``on_overflow``, the overflow report
    (_forensics.py), run once if the read finds an inf/NaN, else dropped unrun."""

    __slots__ = ("flag", "found", "pending", "on_overflow", "__weakref__")

    def __init__(self, flag: Any, found: bool | None, pending: Any = None,
                 on_overflow: Callable[[], None] | None = None) -> None:
        self.flag = flag
        self.found = found
        self.pending = pending
        self.on_overflow = on_overflow

    def ready(self) -> Any:
        """The flag, once any all-reduce on it has completed (on a GPU this orders the
        streams and does not wait on the host)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
        return self.flag

    def verdict(self, read: Callable[[Any], bool]) -> bool:
        """The host verdict, reading the flag (a host sync) the first time only."""
        if self.found is None:
            self.found = bool(read(self.ready()))
            hook, self.on_overflow = self.on_overflow, None
            if self.found and hook is not None:
                hook()  # before anyone drops the gradients it describes
        return self.found


def by_grad(params: list[Any]) -> tuple[list[Any], list[Any], list[Check], list[Any]]:
    """``split`` where the ledger has nothing to say: ``params`` with a gradient and
    those gradients, no checks, and ``params`` without one."""
    grads = list(map(_grad_of, params))
    if not any(map(_is_none, grads)):  # (not `None in`: that calls __eq__)
        return params, grads, [], []
    return ([p for p, g in zip(params, grads) if g is not None],
            [g for g in grads if g is not None], [],
            [p for p, g in zip(params, grads) if g is None])


_is_none = functools.partial(operator.is_, None)
_grad_of = operator.attrgetter("grad")  # (map() with it: no Python frame per parameter)


def refuse_fp16(caps: Caps, grads: list[Any]) -> None:
    """Raises torch.amp's ValueError if a gradient is float16 (each dtype asked once)."""
    for dtype in {g.dtype for g in grads}:
        known = caps.fp16.get(dtype)
        if known is None:
            known = caps.fp16[dtype] = caps.backend.dtype_name(dtype) == "float16"
        if known:
            raise ValueError(
                "Attempting to unscale FP16 gradients. GradScaler needs float32"
                " parameters (and so float32 gradients): keep the model in float32"
                " and let autocast run the low-precision ops."
            )


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler_kwarg(optimizer_class: Any) -> bool:
    # torch's older contract for optimizers that unscale themselves: the scaler passes
    # itself as step(grad_scaler=...). Asked once per class: inspect.signature is slow.
    try:
        return "grad_scaler" in inspect.signature(optimizer_class.step).parameters
    except (TypeError, ValueError):
        return False


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
        self.dropped = _overflowed.Dropped()  # for clip_grad_norm, till the next scale
        # optimizer id -> the checks behind its last step after backward()'s update()
        self.tail: dict[int, list[Check]] = {}
        self.optimizer_params = OptimizerParams()
        self.scaler = weakref.ref(scaler)  # its public get_scale(), for reports
        # An adapter may take the optimizer's own step out of step() (defer_steps): torch
        # does inside a compiled function, so that dynamo compiles the optimizer's step
        # as it does under torch.amp, while the scaler's host work runs eagerly.
        self.defer_steps = False
        self.deferred: tuple[Any, tuple, dict] | None = None
        self.new_iteration()
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

    def new_iteration(self) -> None:
        self.it = Iteration()
        self.forensics.end_iteration()

    # -- traces (_tracing.py has the policy) ----------------------------------------------
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

    # -- a target's gradients, split and recorded by the ledger ------------------------------
    def split(self, params: list[Any]
              ) -> tuple[list[Any], list[Any], list[Check], list[Any]]:
        """``params`` with a gradient that still needs unscaling and those gradients,
        the checks that already covered others (from the ledger), and the params with
        neither."""
        caps = self.caps
        if self.it.handout.records_wait and self.it.handout.late_backward(caps.probes):
            self.ledger.new_backward(caps.version)  # that backward ran after the record
        if self.ledger.empty():  # the usual step: one pass, no lookups
            return by_grad(params)
        return self.ledger.split(params, caps.version)

    def record(self, params: list[Any], grads: list[Any], check: Check,
               weak: bool) -> None:
        it, caps = self.it, self.caps
        if params and it.handout.watched and it.handout.waiting(caps.probes):
            # A backward through a scale() output made before this record may run after
            # it: keep the gradients' versions as they are now, to compare with then.
            it.handout.records_wait = True
            self.ledger.record(params, grads, check, weak=weak, version=caps.version)
        else:
            self.ledger.record(params, grads, check, weak=weak)

    def scaled_or_idle(self, pending: list[Any], idle: list[Any], what: str,
                       solo: bool) -> tuple[Any, bool]:
        """Whether ``pending`` may be unscaled: ``(agreement, unscale)`` for ``check``;
        raises if nothing was scaled since the last update. Except on a rank of a job
        whose checks are agreed across ranks that had no loss this step (an empty
        micro-batch, an expert without tokens): its gradients (zeroed in place) are
        checked as they are, not divided, so that it joins the other ranks' decision."""
        it = self.it
        if it.handout.handed_watched or it.handout.handed_blind:
            self.require_scaled(what)  # raises only if no backward used the scale
            return None if solo else False, True
        agreement = None if solo else self.plan(pending, idle)
        if agreement is None:
            self.require_scaled(what)  # raises
        return agreement, False

    def require_scaled(self, what: str) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        self.it.handout.require_scaled(what, self.s.value, self.caps.probes)

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
        """Checks the gradients of ``params`` (``grads``, where the caller has them) for
        inf/NaN in one fused call, unscaling them too unless a fused optimizer will;
        ``read`` reads the verdict at once (the sync), else it is read when first needed.
        Across ranks the verdict is agreed (distributed.py): ``idle`` (the target's params
        without a gradient here) take part too; ``agreement``: the plan, if made already.
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
                        refuse_fp16(caps, grads)
                    flag = dev.unscale_and_check(grads) if unscale else dev.check(grads)
            except ValueError:
                if not allow_fp16:
                    refuse_fp16(caps, grads)  # float16 gets the core's words
                raise
        handle = None
        if agreement is not None:
            flag, handle = agreement.reduce(flag, params or list(idle))
        check = Check(None, False) if flag is None else Check(flag, None, handle)
        if agreement is not None:
            # Every rank now covers the same parameters, gradient or not.
            self.ledger.record(list(idle), [None] * len(idle), check)
        self.it.add(check)
        if check.found is None:
            check.on_overflow = self.forensics.hook(params, backend, s.steps + 1)
            if read:
                check.verdict(backend.flag_is_set)  # the one sync
        return check

    # -- step: check the stage, unscale, read the verdict, step or skip, record the stage --
    def step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """``scaler.step(optimizer)``; written out where the usual torch.amp step needs
        nothing more: the scale on the host, no trace, no record alive, one process, an
        optimizer that neither skips by itself nor was unscaled this iteration, and
        gradients to check."""
        it, caps, s = self.it, self.caps, self.s
        if (id(optimizer) in it.opt_states or s.dev is not None or caps.tracer is not None
                or it.handout.records_wait or not self.ledger.empty()
                or getattr(optimizer, "_step_supports_amp_scaling", False)):
            return self._step(optimizer, args, kwargs)
        backend = caps.backend
        pending, grads, _, idle = by_grad(self.optimizer_params(optimizer, backend))
        if not pending or not self.solo():
            return self._step(optimizer, args, kwargs)
        if not (it.handout.handed_blind or it.handout.saw_backward):
            self.require_scaled("step()")  # raises unless scaled
        try:
            flag = backend.unscale_and_check(grads, s.inv(), False)
        except ValueError:
            refuse_fp16(caps, grads)
            raise
        check = Check(flag, None, None, self.forensics.hook(pending, backend, s.steps + 1))
        it.add(check)
        self.record(pending, grads, check, weak=False)  # held until update()
        state = it.opt_state(optimizer)
        found = check.verdict(backend.flag_is_set)  # the one sync
        result = None if found else self.call_step(optimizer, args, kwargs)
        state.stage = Stage.STEPPED
        state.checks = [check]
        return result

    def _step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        state = self.it.opt_state(optimizer)
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
            result = optimizer.step(*args, **dict(kwargs, grad_scaler=self.scaler()))
            state.stage = Stage.STEPPED
            return result
        caps = self.caps
        # A fused optimizer skips on the device by itself; inside a trace the adapter's
        # device scale skips for any optimizer (_tracing.py).
        fused = caps.resident is not None and self.steps_on_device(optimizer)
        on_device = fused or (caps.tracer is not None and caps.traced(self.s, "GradScaler.step()"))
        params = self.optimizer_params(optimizer, caps.backend)
        pending, grads, done, idle = self.split(params)
        if state.stage is Stage.READY and not pending and done and not any(
                c is k for c in done for k in self.it.checks):
            # Every gradient was decided by checks that an update() already consumed:
            # scaler.backward(gm, loss) then step(opt). This step ends that iteration.
            return self._tail_step(optimizer, done, on_device, args, kwargs)
        checks = list(state.checks)
        checks += [c for c in done if all(c is not k for k in checks)]
        fused_unscale = False
        agreement = None
        solo = self.solo()
        if state.stage is Stage.READY and not pending and idle and not solo:
            # No gradient here, but another rank may have some: take part in its check.
            agreement = self.plan([], idle)
        if state.stage is Stage.READY and (pending or agreement is not None):
            unscale = True
            if pending:
                agreement, unscale = self.scaled_or_idle(pending, idle, "step()", solo)
                if not solo:
                    distributed.require_synced(caps.backend, pending, "GradScaler.step()")
            # A fused optimizer unscales inside its own kernel (grad_scale), as with
            # torch.amp -- unless some of its gradients were unscaled already.
            fused_unscale = fused and not done and unscale
            check = self.check(pending, grads=grads, idle=idle,
                               agreement=None if solo else agreement or False,
                               unscale=unscale and not fused_unscale, read=False,
                               allow_fp16=fused_unscale)
            if not fused_unscale:
                # held until update(), which torch.amp's loop calls next
                self.record(pending, grads, check, weak=False)
            checks.append(check)
        if not checks and not fused:
            raise ScalerStateError(
                "No inf checks were recorded for this optimizer: none of its parameters"
                " has a gradient. Run the scaled backward pass before"
                " scaler.step(optimizer)."
            )
        result = self._step_unless_found(optimizer, checks, on_device, fused_unscale,
                                         args, kwargs)
        state.stage = Stage.STEPPED
        state.checks = checks  # every check that decided this step
        return result

    def _step_unless_found(self, optimizer: Any, checks: list[Check],
                           on_device: bool, fused_unscale: bool, args: tuple,
                           kwargs: dict) -> Any:
        if any(c.found is True for c in checks):
            return None
        if on_device:
            assert self.s.dev is not None  # steps_on_device() or traced() made it
            resident = self.caps.resident
            if resident is not None and resident.skip_leaves_uninitialised_state(optimizer):
                # Skipped on the device, this step would leave state that the next one
                # reads uninitialised (torch's fused SGD before its first step: torch.amp
                # inherits it). Read the verdict and skip here, as the stock optimizer is
                # skipped: one host read, only until a step is taken.
                read = self.backend.flag_is_set
                if any(c.verdict(read) for c in checks if c.flag is not None):
                    return None
            return self.s.dev.step(optimizer, fused_unscale,
                                   [c.ready() for c in checks if c.flag is not None],
                                   args, kwargs)
        read = self.backend.flag_is_set
        if any(c.verdict(read) for c in checks):  # the one sync per step
            return None
        return self.call_step(optimizer, args, kwargs)

    def _tail_step(self, optimizer: Any, checks: list[Check], on_device: bool,
                   args: tuple, kwargs: dict) -> Any:
        previous = self.tail.get(id(optimizer))
        if previous is not None and len(previous) == len(checks) and all(
                any(c is k for k in previous) for c in checks):
            raise RuntimeError(
                "step() has already been called on these gradients: scaler.backward(gm,"
                " loss) unscaled them and called update(), and scaler.step(optimizer)"
                " then stepped them once. Run the next backward pass first."
            )
        self.tail[id(optimizer)] = checks
        return self._step_unless_found(optimizer, checks, on_device, False, args, kwargs)

    def steps_on_device(self, optimizer: Any) -> bool:
        resident = self.caps.resident
        if resident is None or not resident.steps_on_device(optimizer):
            return False
        s = self.s
        if s.dev is None:
            s.dev = resident.device_scale(optimizer, s.value, s.tracker, s.skipped_steps)
        return True
