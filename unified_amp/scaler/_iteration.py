"""What one iteration of a GradScaler records, from one ``update()`` to the next.

One ``Iteration`` holds it all: each optimizer's stage (torch.amp's READY -> UNSCALED ->
STEPPED) with the checks that decided it, every ``Check`` (one fused check-and-unscale
over a set of gradients) that ``update()`` must count, and how the scale went out, from
which come the "nothing was scaled" errors. The transitions that write it are the state
machine's (_machine.py); ``update()`` starts a new one.
"""

from __future__ import annotations

import collections
import enum
import weakref
from typing import Any

from ..errors import ScalerStateError
from ..capabilities import BackwardProbes

__all__: list[str] = []

# Checks kept before the read ones are folded into counts (a loop of megengine.amp's
# manual form that never calls update() would otherwise check without end).
_MAX_CHECKS = 64
# Outputs of scale() whose backward pass the scaler still asks about, at most: a loop
# that scales without ever stepping (a logged validation loss) must not keep every
# graph alive.
_MAX_AWAITED = 8


class Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class Check:
    """One fused check (usually with unscale) over a set of gradients: ``flag``, the
    adapter's device-side flag (None: no gradients); ``found``, the host verdict once
    read (None while unread); ``reduction``, the handle of a cross-rank all-reduce still
    running on ``flag`` (distributed.py); ``params``, whose gradients it covered, and
    ``step``, the scaler step it decides: what an overflow announces (dropped once the
    verdict is read); ``by_optimizer``, a fused optimizer unscales in its kernel."""

    __slots__ = ("flag", "found", "reduction", "params", "step", "by_optimizer",
                 "__weakref__")

    def __init__(self, flag: Any, found: bool | None, reduction: Any = None,
                 params: list[Any] | None = None, step: int = 0) -> None:
        self.flag = flag
        self.found = found
        self.reduction = reduction
        self.params = params
        self.step = step
        self.by_optimizer = False  # a fused optimizer unscales these in its own kernel

    def ready(self) -> Any:
        """The flag, once any all-reduce on it has completed (on a GPU this orders the
        streams and does not wait on the host)."""
        if self.reduction is not None:
            reduction, self.reduction = self.reduction, None
            reduction.wait()
        return self.flag


class OptimizerStage:
    """One optimizer's progress through the iteration: torch.amp's stage, and the checks
    that covered its gradients."""

    __slots__ = ("stage", "checks")

    def __init__(self) -> None:
        self.stage = Stage.READY
        self.checks: list[Check] = []


class Iteration:
    """What happened since the last ``update()``: each optimizer's stage (keyed by
    ``id()``, as torch.amp's: the keys live for one iteration only), every check that
    ``update()`` must count, and how the scale went out.

    The scale goes out in ``scale()`` outputs whose backward pass the adapter can tell
    apart afterwards (their tokens: BackwardProbes), or in a way it cannot
    (``scale_factor``, ``dy=...``, ``backward(gm, loss)``, an adapter without probes).
    """

    __slots__ = ("optimizers", "checks", "folded_checks", "folded_overflows",
                 "handed_watched", "handed_unwatched", "awaiting_backward",
                 "backward_seen", "recorded_while_awaiting", "scaled_outputs",
                 "overflowed", "overflow_step", "warned_no_update")

    def __init__(self) -> None:
        # keyed by id(), as torch.amp's _per_optimizer_states (a stage made on first use)
        self.optimizers: collections.defaultdict[int, OptimizerStage] = \
            collections.defaultdict(OptimizerStage)
        self.checks: list[Check] = []
        self.folded_checks = 0  # read checks folded into counts, and how many found inf/NaN
        self.folded_overflows = 0
        self.handed_watched = False  # in a scale() output the adapter watches
        self.handed_unwatched = False  # in a way it cannot watch
        self.awaiting_backward: list[Any] = []  # tokens of outputs no backward went through
        self.backward_seen = False  # a backward went through a watched output
        self.recorded_while_awaiting = False  # a ledger record was made while one awaited
        # the last scale() outputs (weakly: an id() could be a new tensor's), for a
        # GradManager's backward of one to mark the gradients it writes (_scaled.py)
        self.scaled_outputs: list[Any] = []
        # id()s of the params whose gradients a check found inf/NaN in, the first such
        # check's step, and whether a later check of them warned (no update() between)
        self.overflowed: set[int] = set()
        self.overflow_step = 0
        self.warned_no_update = False

    def add(self, check: Check) -> None:
        checks = self.checks
        checks.append(check)
        if len(checks) > _MAX_CHECKS:
            # Fold the read checks into counts (update() needs only whether one found an
            # inf/NaN), keeping those an optimizer's stage refers to.
            kept = {id(c) for st in self.optimizers.values() for c in st.checks}
            folded = [c for c in checks if c.found is not None and id(c) not in kept]
            self.folded_checks += len(folded)
            self.folded_overflows += sum(1 for c in folded if c.found)
            gone = {id(c) for c in folded}
            self.checks = [c for c in checks if id(c) not in gone]

    def checks_made(self) -> int:
        return len(self.checks) + self.folded_checks

    def checked(self) -> bool:
        return bool(self.checks) or bool(self.folded_checks)

    def overflows(self) -> int:
        """Checks of this iteration that found an inf/NaN (read so far)."""
        return self.folded_overflows + sum(1 for c in self.checks if c.found)

    # -- how the scale went out ----------------------------------------------------------
    def hand_out(self, token: Any) -> None:
        """The scale went out: in a ``scale()`` output the adapter gave ``token`` for,
        or (None) in a way it cannot watch."""
        if token is None:
            self.handed_unwatched = True
            return
        self.handed_watched = True
        if len(self.awaiting_backward) >= _MAX_AWAITED:
            del self.awaiting_backward[0]
        self.awaiting_backward.append(token)

    def overflow_at(self, params: list[Any], step: int) -> None:
        """A check of ``params``' gradients, deciding ``step``, found an inf/NaN."""
        if not self.overflowed:
            self.overflow_step = step
        self.overflowed.update(map(id, params))

    def scaled(self, output: Any) -> None:
        """``output`` is a ``scale()`` output."""
        outputs = self.scaled_outputs
        if len(outputs) >= _MAX_AWAITED:
            del outputs[0]
        try:
            outputs.append(weakref.ref(output))
        except TypeError:  # not weakly referenceable: not followed
            pass

    def still_awaiting(self, probes: Any) -> bool:
        """Whether a watched output still awaits a backward pass the adapter can see;
        forgets those that have had one (and notes that a backward went through).
        ``probes``: the adapter's BackwardProbes (only outputs it gave a token for are
        watched)."""
        ran = probes.backward_ran
        awaiting = [t for t in self.awaiting_backward if not ran(t)]
        if len(awaiting) < len(self.awaiting_backward):
            self.backward_seen = True
        self.awaiting_backward = awaiting
        return bool(awaiting)

    def backward_since_record(self, probes: Any) -> bool:
        """Whether a backward went through an output that was awaiting one when a record
        was made (``recorded_while_awaiting``): the recorded gradients may hold its part."""
        before = len(self.awaiting_backward)
        if not self.still_awaiting(probes):
            self.recorded_while_awaiting = False
        return len(self.awaiting_backward) < before

    def require_scaled(self, what: str, scale: float, probes: BackwardProbes | None) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs)"
               " earlier in the iteration.")
        if not (self.handed_watched or self.handed_unwatched):
            raise ScalerStateError(
                f"Attempted {what} but nothing was scaled since the last update().  {fix}"
                f" Unscaling now would divide unscaled gradients by the scale"
                f" ({scale:g}); call scaler.scale(loss).backward(),"
                f" gm.backward(scaler.scale(loss)) or scaler.backward(gm, loss) first."
            )
        if self.handed_unwatched or probes is None or self._backward_may_have_run(probes):
            return
        raise ScalerStateError(
            f"Attempted {what} but no backward pass has gone through a scaler.scale()"
            f" output since the last update(): these gradients were not produced by a"
            f" scaled loss, and unscaling would divide them by the scale"
            f" ({scale:g}). Call .backward() on scaler.scale(loss), not on"
            f" the loss itself."
        )

    def _backward_may_have_run(self, probes: BackwardProbes) -> bool:
        """False only where the adapter can tell that a backward ran on what every
        awaiting output was computed from, but not through the output
        (``loss.backward()`` after ``scaler.scale(loss)``)."""
        if self.backward_seen:
            return True
        awaiting = self.still_awaiting(probes)  # (notes a backward that went through one)
        if self.backward_seen or not awaiting:
            return True
        ran = probes.backward_ran
        return any(ran(t) is None for t in self.awaiting_backward)
