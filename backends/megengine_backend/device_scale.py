"""The scale on the device for MegEngine, so that a step runs inside ``megengine.jit.trace``.

No MegEngine 1.13 optimizer skips a step on the device by itself (torch's fused ones
do: backends/torch_backend/device_scale.py), so eagerly every step is decided on the
host, with the one flag read per step, and there is no ``steps_on_device``. A traced
step is the exception.

A trace records the step's ops once and replays them; a host read of a traced value
cannot be replayed (MegEngine raises "data unreadable" or crashes). So inside a trace
the scaler keeps the scale, the growth tracker and the telemetry in tensors that live
outside the trace (as parameters do: ops inside the trace rewrite them), and decides
everything with device ops: the check is MegEngine's fused kernel, the skip selects
each parameter's and optimizer state's old value where an overflow was found (a select,
not a multiply, so an inf/NaN update never leaks through), and the scale follows
``next_scale``'s rule with ``where``. Every op runs whatever the values, so each call
replays the same op sequence.

Bit for bit the same as the host path: the unscale multiplies by the float32
reciprocal (the one float32 division is correctly rounded, as the host's float64
reciprocal rounded to float32 is, since 53 >= 2*24+2 bits), the kernel checks each
gradient before scaling it, as here, and the scale's products are exact in float32 for
factors that float32 holds exactly (the core refuses the others inside a trace).

And the same bits at MegEngine's default ``opt_level`` (2). Its graph optimizer
rewrites elementwise chains: one pass normalizes some (a division becomes a power, the
scaled loss's seed merges into the backward's first product), which remakes every
variable downstream, and a later pass sums each chain of additions in the order its
terms' variables were made. SGD's update is such a chain (``momentum * buf + (grad +
decay * param)``); in a plain traced step the gradient is older than the update's
products and the sum keeps eager's order, but a gradient remade downstream of a
rewrite is summed last, which changes the last bits (a conv net with BatchNorm and
weight decay: ``weight_decay`` in tests/native/megengine_trace_scenarios.py). So
``step`` runs the gradients, the parameters and their optimizer state through the
fused kernel, unchanged (``_settle``), just before the update: whatever was rewritten
upstream, the gradient is then an output of that kernel and the update's products are
made after it, as in eager order. The kernel also ends the multiply chains there, so a
clip between the unscale and the step (``lr * (grad * coef)``) keeps eager's order too,
which MegEngine's own traced step does not (test_megengine_trace.py).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Sequence

import numpy as np

import megengine
import megengine.functional as F
from megengine.functional.math import _check_non_finite
from megengine.jit import exclude_from_trace
from megengine.jit import tracing as _tracing

from unified_amp import capabilities

from .scaling import require_float32


def _settle(tensors: Sequence[Any]) -> None:
    """Rebinds the float32 ``tensors`` to the outputs of one call of MegEngine's fused
    kernel, times 1.0 (the same values; its flag unused): inside a trace, an op the
    graph optimizer cannot see into, whose outputs are made together (module
    docstring)."""
    same = [t for t in tensors if t.dtype == np.float32]
    if same:
        _check_non_finite(same, 1.0)


class DeviceScale(capabilities.TracedScale):
    """The scaler's scale, growth tracker, skipped-step count and last verdict as
    MegEngine tensors, with the step's check, skip and scale update as device ops."""

    def __init__(self, scale: float, tracker: int, skipped: int):
        # The core makes this right before a traced call starts, outside it: a tensor
        # made part-way through a traced call breaks the next calls ("expect external
        # node, got internal"). exclude_from_trace() only guards a call from inside one.
        with exclude_from_trace():
            self.scale_t = megengine.tensor(scale, dtype="float32")
            self.tracker_t = megengine.tensor(tracker, dtype="int32")
            self.skipped_t = megengine.tensor(skipped, dtype="int32")
            self.last_t = megengine.tensor(0, dtype="int32")
        self._steps = 0  # the update count the tensors describe
        self._written = (scale, tracker, skipped)

    def write(self, scale: float, tracker: int, skipped: int) -> None:
        """Copies the host's values in (outside a trace), writing only what changed."""
        old, self._written = self._written, (scale, tracker, skipped)
        for t, dtype, before, now in zip((self.scale_t, self.tracker_t, self.skipped_t),
                                         ("float32", "int32", "int32"), old,
                                         self._written):
            if before != now:
                t._reset(megengine.tensor(now, dtype=dtype))

    def scale(self, y: Any) -> Any:
        return y * self.scale_t

    def scaled_cotangents(self, ys: Sequence[Any], dys: Sequence[Any] | None) -> list[Any]:
        if dys is None:
            return [F.ones_like(y) * self.scale_t for y in ys]
        return [dy * self.scale_t for dy in dys]

    def check(self, grads: Sequence[Any]) -> list[Any]:
        """The overflow flag of ``grads`` as they are (one fused kernel)."""
        require_float32(grads)
        # The kernel rewrites its inputs with its outputs (times 1.0 here: the same values).
        return [_check_non_finite(list(grads), 1.0)]

    def unscale_and_check(self, grads: Sequence[Any]) -> list[Any]:
        # The flag first: the kernel judges each gradient before it scales it, so a
        # finite gradient that the unscale turns into inf passes, as on the host path.
        flag = self.check(grads)
        inv = 1.0 / self.scale_t
        for g in grads:
            g._reset(g * inv)
        return flag

    def rescale(self, grads: Sequence[Any]) -> None:
        for g in grads:  # as unscale_and_check, by the scale instead of its reciprocal
            g._reset(g * self.scale_t)

    @staticmethod
    def _found(flags: Sequence[Any], found_host: bool = False) -> Any:
        total = None
        for flag in flags:
            for f in flag:
                total = f if total is None else total + f
        if total is None:  # nothing checked on the device
            return megengine.tensor(found_host)
        return (total + 1 > 0) if found_host else total > 0

    def step(self, optimizer: Any, unscale: bool, flags: Sequence[Any],
             args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        found = self._found(flags)
        params = [p for g in optimizer.param_groups for p in g["params"]
                  if p.grad is not None]
        if unscale:
            inv = 1.0 / self.scale_t
            for p in params:
                p.grad = p.grad * inv
        # What the step may rewrite: the parameters and their optimizer state. detach()
        # keeps the old values: MegEngine's in-place ops rebind the tensor objects.
        state = optimizer._state
        live = params + [t for p in params for t in state.get(p, {}).values()
                         if isinstance(t, megengine.Tensor)]
        old = [t.detach() for t in live]
        _settle([p.grad for p in params] + live)
        result = optimizer.step(*args, **kwargs)
        for t, before in zip(live, old):
            t._reset(F.where(found, before, t))
        return result

    def update(self, found_host: bool, flags: Sequence[Any], growth: float,
               backoff: float, interval: int, *, steps: int, count: bool,
               new_scale: float | None) -> None:
        found = self._found(flags, found_host)
        if new_scale is not None:
            self.scale_t._reset(megengine.tensor(new_scale, dtype="float32"))
        else:
            zero = F.zeros_like(self.tracker_t)
            tracker = F.where(found, zero, self.tracker_t + 1)
            grow = tracker == interval
            grown = self.scale_t * growth
            grown = F.where(F.isinf(grown), self.scale_t, grown)  # never past float32
            scale = F.where(found, self.scale_t * backoff,
                            F.where(grow, grown, self.scale_t))
            self.tracker_t._reset(F.where(grow, zero, tracker))
            self.scale_t._reset(scale)
        found_i = found.astype("int32")
        if count:
            self.skipped_t._reset(self.skipped_t + found_i)
        self.last_t._reset(found_i)
        self._steps = steps

    def poll(self) -> tuple[int, float, int, int, bool]:
        """The telemetry (a host read: call it outside a trace only)."""
        values = F.stack([self.scale_t, self.tracker_t.astype("float32"),
                          self.skipped_t.astype("float32"),
                          self.last_t.astype("float32")]).numpy()
        scale, tracker, skipped, last = (float(v) for v in values)
        return self._steps, scale, int(tracker), int(skipped), bool(last)

    def read(self) -> tuple[float, int]:
        return float(self.scale_t.item()), int(self.tracker_t.item())

    def load(self, scale: float, tracker: int | None,
             telemetry: tuple[int, int, bool] | None = None) -> None:
        self.scale_t._reset(megengine.tensor(scale, dtype="float32"))
        if tracker is not None:
            self.tracker_t._reset(megengine.tensor(tracker, dtype="int32"))
        if telemetry is not None:
            self._steps, skipped, last = telemetry
            self.skipped_t._reset(megengine.tensor(skipped, dtype="int32"))
            self.last_t._reset(megengine.tensor(int(last), dtype="int32"))


# Run right before each traced call starts (TracedSteps.before_traces): the live
# scalers' own callbacks, held weakly. A fact about which scalers are alive, as
# forensics' set of readers is; no scaler's state is shared through it.
_before_traces: list[weakref.WeakMethod] = []


def _call_before_traces(call: Any) -> Any:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _tracing.is_tracing():  # (a trace called inside a trace: already done)
            live = []
            for ref in _before_traces:
                callback = ref()
                if callback is not None:
                    callback()
                    live.append(ref)
            _before_traces[:] = live
        return call(self, *args, **kwargs)

    __call__.__wrapped_by_unified_amp__ = call  # type: ignore[attr-defined]
    return __call__


class TracedSteps(capabilities.Tracing):
    """Whether a ``megengine.jit.trace`` is running, and the scale that lives on the
    device for it (unified_amp/_tracing.py has the policy)."""

    trace_name = "megengine.jit.trace"

    def trace_mode(self) -> str | None:
        """None outside ``megengine.jit.trace`` (and inside its exclude_from_trace());
        "rerun" where the trace runs the Python function on every call; "once" where it
        runs it once and replays the graph alone (``without_host=True``)."""
        if not _tracing.is_tracing():
            return None
        return "once" if getattr(_tracing.active_trace, "without_host", False) else "rerun"

    def trace_refusal(self) -> str | None:
        """Why a step traced now cannot train as the eager one, or None."""
        if int(os.getenv("MEGENGINE_INPLACE_UPDATE", "0")):
            # Measured: a plain SGD step (no amp) traced in this mode already ends with
            # other weights than eagerly, and symbolic=True fails MegEngine's assertion
            # `src.valid()`; the optimizers' _inplace_add_ also writes into the
            # buffers the skip would restore from.
            return ("MEGENGINE_INPLACE_UPDATE=1 makes MegEngine's optimizers update in"
                    " place, and a step traced in that mode does not train as the eager"
                    " one even without amp. Unset it for traced steps.")
        return None

    def device_scale(self, optimizer: Any, scale: float, tracker: int,
                     skipped: int) -> DeviceScale:
        # On the default device, where MegEngine's optimizers put their state too.
        return DeviceScale(scale, tracker, skipped)

    def before_traces(self, callback: Any) -> None:
        # Every traced call goes through trace.__call__ (looked up on the class at each
        # call, so traces made before this are covered too); wrapped once per process.
        trace = megengine.jit.trace
        if not hasattr(trace.__call__, "__wrapped_by_unified_amp__"):
            trace.__call__ = _call_before_traces(trace.__call__)
        _before_traces.append(weakref.WeakMethod(callback))
