"""How one iteration handed the scale out, and the misuse that tells.

The scale goes out through ``scale()`` outputs whose backward pass the adapter can tell
apart afterwards (their tokens), or in a way it cannot (``scale_factor``, ``dy=...``,
``backward()``). From that come the "nothing was scaled" and "backward ran on the
unscaled loss" errors. An ``Iteration`` (_machine.py) holds one; ``update()`` starts a
new one.
"""

from __future__ import annotations

from typing import Any

from ..errors import ScalerStateError

__all__: list[str] = []

# Outputs of scale() whose backward pass the scaler still asks about, at most: a loop
# that scales without ever stepping (a logged validation loss) must not keep every
# graph alive.
_MAX_WATCHED = 8


class Handout:
    """How the scale went out since the last ``update()`` (see the module's doc)."""

    __slots__ = ("handed_watched", "handed_blind", "watched", "saw_backward",
                 "records_wait")

    def __init__(self) -> None:
        self.handed_watched = False
        self.handed_blind = False
        self.watched: list[Any] = []  # tokens of outputs still waiting for a backward
        self.saw_backward = False  # a backward went through a watched output
        self.records_wait = False  # a record was made while an output waited

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
