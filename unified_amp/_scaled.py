"""Gradients a scaled backward pass wrote and no check has unscaled yet, marked on their
parameters, for ``clip_grad_norm`` to refuse.

``amp.clip_grad_norm`` on such gradients would clip a norm ``scale`` times too large and
shrink the true gradients to almost nothing, without a word. A backward pass of
``amp.GradManager`` (or ``scaler.backward(gm, loss, unscale_grad=False)``) that the
scaler's scale went into marks the parameters it wrote: with the scaler's state machine
(weakly) and its iteration. ``clip_grad_norm`` then asks that machine whether a check
unscaled those gradients since; an ``update()`` (a new iteration) ends every mark. The
mark is the parameter's own, as _overflowed.py's is, so no state of one scaler is
another's.

Which scaler handed its scale out last is the one fact of the process kept here (weakly):
a backward pass given ``dy=scaler.scale_factor`` carries the scale as a number, so the
GradManager asks that scaler whether the scale went out that way.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

__all__: list[str] = []

_MARK = "_unified_amp_scaled_by"


class Scaling(Protocol):
    """What the marks ask of a scaler's state machine (scaler/_machine.py)."""

    iteration: Any

    def scaled_backward(self, ys: list[Any], dys: list[Any] | None) -> bool:
        """Whether a backward pass of ``ys`` (with cotangents ``dys``) carries the scale."""

    def unscaled(self, params: list[Any]) -> bool:
        """Whether a check unscaled every gradient ``params`` hold now."""

    def current_scale(self) -> float: ...


class _Last:
    """The state machine of the scaler that handed its scale out last (weakly)."""

    ref: "weakref.ref[Any] | None" = None


def handed_out(ref: "weakref.ref[Any]") -> None:
    _Last.ref = ref


def note_backward(params: list[Any], ys: list[Any], dys: list[Any] | None) -> None:
    """A GradManager's backward pass of ``ys`` wrote ``params``' gradients."""
    ref = _Last.ref
    if ref is None:
        return
    machine = ref()
    if machine is not None and machine.scaled_backward(ys, dys):
        mark(params, machine, ref)


def mark(params: list[Any], machine: Scaling, ref: "weakref.ref[Any]") -> None:
    token = (ref, machine.iteration)
    for p in params:
        setattr(p, _MARK, token)


def scale_held(params: list[Any]) -> float | None:
    """The scale that some of ``params``' gradients still hold, or None."""
    owners: dict[int, tuple[Any, list[Any]]] = {}
    for p in params:
        token = getattr(p, _MARK, None)
        if token is None or p.grad is None:
            continue
        machine = token[0]()
        if machine is None or machine.iteration is not token[1]:
            continue  # that scaler is gone, or update() ended the iteration
        owners.setdefault(id(machine), (machine, []))[1].append(p)
    for machine, marked in owners.values():
        if not machine.unscaled(marked):
            return float(machine.current_scale())
    return None
