"""What the scaler may do inside a traced step (``megengine.jit.trace``): the policy.

A trace records a step's ops and replays them, so nothing inside may depend on a value
read back to the host: the read cannot be replayed (MegEngine raises "data unreadable"
or kills the process), and a number read while recording is frozen into every replay.
Inside a trace the scaler therefore keeps its scale on the device (the adapter's
``device_scale``, as for torch's fused optimizers) and checks, skips and updates with
device ops only, so that a traced step trains as the eager one does. The calls whose
meaning is a host decision raise ``UnsupportedTraceError`` before they change anything.

The adapter only says whether a trace is running (``trace_mode()``: None outside one,
``RERUN`` in a trace that runs the Python function on every call, ``ONCE`` in one that
runs it once and then replays the graph alone) and names it (``trace_name``).
"""

from __future__ import annotations

from typing import Any

from ._scale_rule import f32
from .errors import UnsupportedTraceError
from .capabilities import Tracing, capability

RERUN = "rerun"
ONCE = "once"

_MOVE_OUT = ("Or trace only the forward pass and the loss, and call the scaler and"
             " optimizer.step() outside the trace.")

# call -> (why it needs the host, what to write inside the trace instead)
_HOST_CALLS = {
    "backward": (
        "unscales the gradients and drops them on an overflow (megengine.amp's automatic"
        " mode), which needs the overflow flag on the host, and a trace cannot replay"
        " a host read (MegEngine fails with 'data unreadable' or crashes)",
        "write scaler.backward(gm, loss, unscale_grad=False) (or"
        " gm.backward(scaler.scale(loss))), then scaler.step(optimizer) and"
        " scaler.update(): they check, skip and update on the device",
    ),
    "unscale": (
        "drops the gradients on an overflow, which needs the overflow flag on the host,"
        " and a trace cannot replay a host read (MegEngine fails with 'data unreadable'"
        " or crashes)",
        "write scaler.unscale_(optimizer) (it leaves the decision to step()), then"
        " scaler.step(optimizer) and scaler.update(): they skip and update on the device",
    ),
    "read": (
        "reads the scale back to the host as a Python number, which the trace would"
        " freeze at its first value",
        "scale with scaler.scale(loss) or scaler.backward(gm, loss, unscale_grad=False),"
        " which keep the scale on the device; read get_scale(), scale_factor and"
        " state_dict() between traced calls",
    ),
    "clip": (
        "returns the total norm as a Python number, a host read, and a trace cannot"
        " replay a host read (MegEngine fails with 'data unreadable' or crashes)",
        "clip with megengine.optimizer.clip_grad_norm(params, max_norm), which returns the"
        " norm as a tensor (after scaler.unscale_(optimizer), as eagerly)",
    ),
    "write": (
        "sets the scale from a Python number, which the trace would freeze at its first"
        " value",
        "set it between traced calls (update(new_scale=...), scale_factor = ...,"
        " load_state_dict())",
    ),
}


def supported(backend: Any) -> bool:
    """Whether the adapter has traces at all (the Tracing capability)."""
    return capability(backend, Tracing) is not None


def mode(backend: Any) -> str | None:
    """The adapter's answer: None (no trace), RERUN or ONCE."""
    tracer = capability(backend, Tracing)
    return None if tracer is None else tracer.trace_mode()


def _name(backend: Any) -> str:
    tracer = capability(backend, Tracing)
    return "a trace" if tracer is None else str(tracer.trace_name)


def refuse(backend: Any, what: str, kind: str) -> UnsupportedTraceError:
    """The error for ``what`` (a call whose meaning is a host decision) in a trace."""
    why, fix = _HOST_CALLS[kind]
    return UnsupportedTraceError(
        f"{what} was called inside {_name(backend)}: it {why}. Inside the trace, {fix}."
        f" {_MOVE_OUT} This call changed nothing."
    )


def enter(backend: Any, what: str, factors: tuple[float, float]) -> bool:
    """Whether ``what`` runs inside a trace, raising where it cannot run there as it
    does eagerly. True means: keep the scale on the device for this call."""
    current = mode(backend)
    if current is None:
        return False
    if current == ONCE:
        raise UnsupportedTraceError(
            f"{what} was called inside {_name(backend)} with without_host=True, which runs"
            f" the Python step once and then replays its graph alone: the scaler's stage"
            f" checks and step counts would not run again. Use the trace's default"
            f" (without_host=False), which checks, skips and updates the scale on the"
            f" device. {_MOVE_OUT} This call changed nothing."
        )
    tracer = capability(backend, Tracing)
    why = None if tracer is None else tracer.trace_refusal()
    if why:
        raise UnsupportedTraceError(
            f"{what} was called inside {_name(backend)}: {why} {_MOVE_OUT} This call"
            f" changed nothing."
        )
    for name, value in zip(("growth_factor", "backoff_factor"), factors):
        if not _exact_f32(value):
            raise UnsupportedTraceError(
                f"{what} was called inside {_name(backend)} with {name}={value!r}, which"
                f" float32 cannot hold exactly: the device-side scale update would round"
                f" differently from the eager one. Inside a trace use factors exact in"
                f" float32 (2.0 and 0.5, the defaults, or other powers of two)."
                f" {_MOVE_OUT} This call changed nothing."
            )
    return True


def follow(tracer: Any, flush: Any) -> None:
    """Has the adapter call ``flush()`` (a scaler's bound method, held weakly) right
    before each traced call starts, outside the trace, so that the scaler's trace copy
    holds the host's values when a trace starts from it. The copy is then written only
    when a trace is about to use it, never on an eager step."""
    capability(tracer, Tracing).before_traces(flush)  # type: ignore[union-attr]


def mirror(backend: Any, copy: Any, scale: float, tracker: int, skipped: int) -> Any:
    """The adapter's device copy of the scale, made (outside a trace) or brought up to
    date; None where the adapter has no traces.

    MegEngine's trace only accepts device state that holds its value when the traced
    call starts (a tensor made or loaded part-way through the first call breaks the
    replays: "expect external node, got internal"), so the copy is made and written
    right before a traced call starts (``follow``), outside it.
    """
    tracer = capability(backend, Tracing)
    if tracer is None:
        return None
    if copy is None:
        if mode(backend) is not None:
            return None
        return tracer.device_scale(None, scale, tracker, skipped)
    copy.write(scale, tracker, skipped)
    return copy


def take_copy(backend: Any, what: str, copy: Any) -> Any:
    """The device copy that a trace starts from, or the error if there is none."""
    if copy is None:
        raise UnsupportedTraceError(
            f"{what} was called inside {_name(backend)} on a GradScaler made (or"
            f" unpickled) inside the trace: its scale has no device copy that the trace"
            f" could have started from. Make the GradScaler before the traced function"
            f" runs (and unpickle it before, too). This call changed nothing."
        )
    return copy


def _exact_f32(x: float) -> bool:
    return f32(x) == x
