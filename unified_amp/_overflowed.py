"""Gradients a GradScaler dropped on an overflow, marked on their parameters.

megengine.amp's forms (``scaler.backward(gm, loss)``, ``scaler.unscale(gm)``) drop the
gradients of a step that overflowed (``.grad = None``), so that any optimizer step skips
it. ``clip_grad_norm`` asks here, so that it reports such a step's norm as inf, as
torch's ``clip_grad_norm_`` reports the inf/NaN gradients torch.amp keeps, not as the
0.0 of no gradients. The mark is the parameter's own (no state that two scalers could
share); it counts while the gradient is still None, and the scaler that set it clears it
when it hands its scale out again (the next iteration), as ``GradManager.zero_grad()``
does.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__: list[str] = []

_MARK = "_unified_amp_overflowed"


def mark(params: Iterable[Any]) -> None:
    for p in params:
        setattr(p, _MARK, True)


def unmark(params: Iterable[Any]) -> None:
    for p in params:
        if getattr(p, _MARK, False):
            delattr(p, _MARK)


class Dropped:
    """The parameters one scaler marked, until it hands its scale out again."""

    __slots__ = ("params",)

    def __init__(self) -> None:
        self.params: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self.params)

    def add(self, params: list[Any]) -> None:
        mark(params)
        self.params.extend(params)

    def forget(self) -> None:
        """The scale goes out for new gradients: the dropped ones are no longer news."""
        unmark(self.params)
        self.params = []


def dropped(params: Iterable[Any]) -> bool:
    """Whether an overflow dropped the gradient of one of ``params`` (still None)."""
    return any(p.grad is None and getattr(p, _MARK, False) for p in params)
