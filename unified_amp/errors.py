"""The errors unified_amp raises on bad input, and its warnings.

Each error subclasses the built-in type a user would already catch (``ValueError``,
``ImportError``, ``RuntimeError``), so code written for torch.amp or megengine.amp keeps
working, and names the bad value, what was expected and the fix. A warning points at
the user's line (``_user_stacklevel``).
"""

from __future__ import annotations

import os
import sys
from types import FrameType

__all__ = [
    "UnifiedAmpError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "UnsupportedPrecisionError",
    "UnsupportedTraceError",
    "TensorTypeError",
    "ScalerStateError",
    "ScalerArgumentError",
    "StateDictError",
    "MissingCapabilityError",
    "PortabilityWarning",
    "ContractWarning",
    "CompileWarning",
]


class UnifiedAmpError(Exception):
    """Base class of every error that unified_amp defines."""


class UnknownBackendError(UnifiedAmpError, ValueError):
    """A backend name that no installed adapter answers to."""

    def __init__(self, name: object, valid: list[str], source: str = "set_backend()"):
        self.name = name
        self.valid = list(valid)
        super().__init__(
            f"Unknown unified_amp backend {name!r} (from {source}). "
            f"Valid names: {', '.join(repr(v) for v in self.valid)}. "
            f"Pick one with amp.set_backend(name) or UNIFIED_AMP_BACKEND=name."
        )


class BackendUnavailableError(UnifiedAmpError, ImportError):
    """A known backend whose framework is not installed in this interpreter."""


class UnsupportedPrecisionError(UnifiedAmpError, RuntimeError):
    """An autocast dtype that the framework cannot compute on the requested device.

    Raised when the ``autocast`` block is entered, before any kernel runs, so the failure
    never surfaces later as an asynchronous error or at interpreter exit.
    """


class UnsupportedTraceError(UnifiedAmpError, RuntimeError):
    """A scaler call that a compiled or traced step cannot run as the eager step does.

    Raised inside ``megengine.jit.trace`` by the calls that need a host read of a device
    value (``backward(gm, loss)`` and ``unscale()``, which drop overflowed gradients;
    ``get_scale()``, ``scale_factor``, ``state_dict()``, ``update(new_scale=...)``), and
    by any scaler call in a trace that replays without running Python
    (``without_host=True``). Raised before the call changes any gradient, weight or
    scale; the message says what to move out of the trace.
    """


class TensorTypeError(UnifiedAmpError, TypeError, ValueError):
    """A value where the active backend's tensors were expected: another framework's
    tensor (with both installed, the other one chose the backend), a NumPy array, or
    anything else that is no tensor.

    Raised by the call that got the value, before it changes anything; the message
    names the value, its framework, and how to select that framework's backend or
    what to pass instead. A ``TypeError`` (what either framework raises for a
    non-tensor) and a ``ValueError`` (what torch.amp's ``GradScaler.scale()`` raises).
    """


class ScalerStateError(UnifiedAmpError, RuntimeError, AssertionError):
    """A GradScaler call out of order where torch.amp raises ``AssertionError``:
    ``unscale_()``, ``step()`` or ``update()`` with nothing scaled since the last
    ``update()``; ``step()`` on an optimizer with no inf checks recorded for it;
    ``update()`` with nothing checked; pickling mid-iteration.

    Also a ``RuntimeError`` (ours always was), so code that catches either keeps working.
    """


class ScalerArgumentError(UnifiedAmpError, ValueError, AssertionError):
    """A bad GradScaler number where torch.amp raises ``AssertionError`` (a growth factor
    not above 1, a backoff factor not below 1, an ``update(new_scale=...)`` tensor that
    holds more than one element). Also a ``ValueError``, naming the value and the fix."""


class StateDictError(UnifiedAmpError, ValueError, RuntimeError, KeyError, TypeError):
    """A state dict that ``GradScaler.load_state_dict()`` cannot load: empty (a disabled
    scaler's), no mapping, a key missing, a value out of range. Raised before anything
    changes, on both backends alike.

    Also every type that torch.amp's or megengine.amp's own ``load_state_dict()``
    raises for such a dict (``RuntimeError`` for an empty one, ``KeyError`` for a missing
    key, ``TypeError`` for no mapping), so code written against either keeps catching
    it, and a ``ValueError`` (ours always was).
    """

    def __str__(self) -> str:
        # KeyError's own str() would quote the message.
        return str(self.args[0]) if self.args else ""


class MissingCapabilityError(UnifiedAmpError, NotImplementedError):
    """A feature the active backend's adapter does not provide: an optional capability
    (``unified_amp.capabilities``: ``amp.initialize`` needs ``OptLevelCasting``,
    ``amp.trace_forward`` needs ``ForensicsProbes``, ...), or, when an adapter is loaded,
    a method of the required core (``unified_amp.interface.Backend``). Names the backend,
    the capability and the methods its adapter lacks."""


class OverflowWarning(RuntimeWarning):
    """A GradScaler keeps skipping steps (every gradient it checks holds an inf/NaN), or
    an overflow found no ``update()`` after it to back the scale off."""


class PortabilityWarning(UserWarning):
    """Code that runs on this backend but not on the other: on torch, gradients that a
    ``with gm:`` block of an ``amp.GradManager`` got from a backward pass the
    GradManager did not run (``loss.backward()`` where portable code calls
    ``gm.backward(loss)``; MegEngine's tensors have no ``backward()``)."""


class ContractWarning(UserWarning):
    """A call that the dtype contract cannot reach, so that it keeps the framework's own
    autocast rule inside ``amp.autocast`` blocks. On MegEngine, whose contract lives in
    wrappers that replace the functions wherever the process binds them, a contract
    function held, when the first block runs, where no binding can be replaced: in a
    list, a tuple, a dict of the program's own, a ``functools.partial``, a local variable
    of another thread's running function. Said once per holder, when that block is entered, naming the
    function and the holder; the fix is to look the function up where it is called
    (``F.softmax(x)``) or to build the holder after the first block."""


class CompileWarning(UserWarning):
    """Compiled code that runs part of its work eagerly because of an ``amp.autocast``
    block: dynamo gave up on the function holding the block (a graph break inside it)
    and runs that function eagerly, compiling only the functions it calls. Said once per
    function, with the torch version and the fix (docs/COMPILE.md)."""


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that points
    at the first frame outside unified_amp and its adapters: the user's line."""
    ours = [os.path.dirname(os.path.abspath(__file__))]
    adapters = sys.modules.get("unified_amp.backends")
    ours += [os.path.abspath(p) for p in getattr(adapters, "__path__", [])]
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            tuple(ours)):
        frame, level = frame.f_back, level + 1
    return level
