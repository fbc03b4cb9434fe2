"""One iteration of a GradScaler: what happened since the last ``update()``.

An ``Iteration`` holds each optimizer's stage (torch.amp's READY / UNSCALED / STEPPED,
keyed by ``id()``: the keys live for one iteration only), every check that ``update()``
must count, and how the scale was handed out -- through ``scale()`` outputs whose
backward pass the adapter can tell apart afterwards (their tokens), or in a way it
cannot (``scale_factor``, ``dy=...``, ``backward()``). From that it raises the "nothing
was scaled" and "backward ran on the unscaled loss" errors. ``update()`` starts a new one.
"""

from __future__ import annotations

import enum
from typing import Any

from ._ledger import Check
from ..errors import ScalerStateError

__all__: list[str] = []

# Outputs of scale() whose backward pass the scaler still asks about, at most: a loop
# that scales without ever stepping (a logged validation loss) must not keep every
# graph alive.
_MAX_WATCHED = 8
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
    """What happened since the last ``update()`` (see the module's doc)."""

    __slots__ = ("opt_states", "checks", "folded", "folded_found", "handed_watched",
                 "handed_blind", "watched", "saw_backward", "records_wait")

    def __init__(self) -> None:
        self.opt_states: dict[int, OptState] = {}
        self.checks: list[Check] = []
        self.folded = 0  # read checks folded into counts, and how many found inf/NaN
        self.folded_found = 0
        self.handed_watched = False
        self.handed_blind = False
        self.watched: list[Any] = []  # tokens of outputs still waiting for a backward
        self.saw_backward = False  # a backward went through a watched output
        self.records_wait = False  # a record was made while an output waited

    def opt_state(self, optimizer: Any) -> OptState:
        state = self.opt_states.get(id(optimizer))
        if state is None:
            state = self.opt_states[id(optimizer)] = OptState()
        return state

    # -- checks ---------------------------------------------------------------------------
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

    # -- how the scale was handed out -----------------------------------------------------
    def handed(self, token: Any) -> None:
        """The scale went out: in a ``scale()`` output the adapter gave ``token`` for,
        or (None) in a way it cannot watch."""
        if token is None:
            self.handed_blind = True
            return
        self.handed_watched = True
        if len(self.watched) >= _MAX_WATCHED:
            del self.watched[0]
        self.watched.append(token)

    def waiting(self, probes: Any) -> bool:
        """Whether a watched output still waits for a backward pass the adapter can see
        (drops those that have had one)."""
        ran = probes.backward_ran
        waiting = [t for t in self.watched if not ran(t)]
        if len(waiting) < len(self.watched):
            self.saw_backward = True
        self.watched = waiting
        return bool(waiting)

    def late_backward(self, probes: Any) -> bool:
        """Whether a backward went through an output that was waiting when a record was
        made (``records_wait``) since then: the recorded gradients may hold its part."""
        before = len(self.watched)
        if not self.waiting(probes):
            self.records_wait = False
        return len(self.watched) < before

    def require_scaled(self, what: str, scale: float, probes: Any) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs)"
               " earlier in the iteration.")
        if not (self.handed_watched or self.handed_blind):
            raise ScalerStateError(
                f"Attempted {what} but nothing was scaled since the last update().  {fix}"
                f" Unscaling now would divide unscaled gradients by the scale"
                f" ({scale:g}); call scaler.scale(loss).backward(),"
                f" gm.backward(scaler.scale(loss)) or scaler.backward(gm, loss) first."
            )
        if self.handed_watched and not self.handed_blind and \
                not self._backward_seen(probes):
            raise ScalerStateError(
                f"Attempted {what} but no backward pass has gone through a scaler.scale()"
                f" output since the last update(): these gradients were not produced by a"
                f" scaled loss, and unscaling would divide them by the scale"
                f" ({scale:g}). Call .backward() on scaler.scale(loss), not on"
                f" the loss itself."
            )

    def _backward_seen(self, probes: Any) -> bool:
        """Whether a backward went through a watched output, as far as the adapter can
        tell: False only where it can tell that a backward ran on what every waiting
        output was computed from, but not through the output (``loss.backward()`` after
        ``scaler.scale(loss)``)."""
        if self.saw_backward or not self.waiting(probes) or self.saw_backward:
            return True
        ran = probes.backward_ran
        return any(ran(t) is None for t in self.watched)
