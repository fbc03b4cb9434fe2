"""The numbers a GradScaler keeps, and where they live.

``ScaleState``: the scale (a float32 value), the growth tracker, the hyper-parameters
and the telemetry, as plain Python numbers on the host; once a fused optimizer steps
(or a trace runs) the adapter's device-resident scale (``device_scale``) holds the scale
and tracker instead, and only where the arithmetic runs changes. It also keeps the
adapter's device copy of the scale that a ``megengine.jit.trace`` step starts from
(``trace_copy``, _tracing.py), and checkpoints: ``state_dict`` / ``load``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import _tracing
from ..errors import StateDictError
from .._scale_rule import check_factors, f32, next_scale
from ..capabilities import DeviceScale, Tracing

__all__: list[str] = []

_STATE_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# stats()'s counters, which the frameworks' own load_state_dict() do not read.
_COUNTERS = ("steps", "skipped_steps", "last_step_skipped")


class ScaleState:
    """The scale, growth tracker, hyper-parameters and telemetry (see the module's doc)."""

    __slots__ = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                 "growth_tracker", "steps", "skipped_steps", "last_step_skipped", "as_of_step",
                 "device_scale", "trace_copy")

    def __init__(self, scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, growth_tracker: int = 0, steps: int = 0,
                 skipped_steps: int = 0, last_step_skipped: bool = False,
                 as_of_step: int | None = None) -> None:
        self.scale = f32(float(scale))
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.growth_tracker = growth_tracker
        self.steps = steps  # updates that followed a check
        self.skipped_steps = skipped_steps
        self.last_step_skipped = last_step_skipped
        # the step the telemetry describes (lags only in device mode)
        self.as_of_step = steps if as_of_step is None else as_of_step
        self.device_scale: DeviceScale | None = None  # the adapter's device-resident scale
        self.trace_copy: Any = None  # its copy of the scale for traced steps

    def numbers(self) -> tuple[Any, ...]:
        """The constructor's arguments that remake this state (pickling)."""
        return (self.scale, self.growth_factor, self.backoff_factor, self.growth_interval,
                self.growth_tracker, self.steps, self.skipped_steps, self.last_step_skipped,
                self.as_of_step)

    def inverse(self) -> float:
        """1 / scale in float64, rounded to float32 by the adapter: torch.amp's "FP32
        division can be imprecise" recipe, and what megengine.amp computes too."""
        return 1.0 / self.scale if self.scale else math.inf

    def advance(self, found: bool, counted: bool) -> None:
        """One update() on the host: torch's float32 rule (_scale_rule.py), and, if
        ``counted`` (a check preceded it), one step more in the telemetry."""
        tracker = self.growth_tracker + 1
        if found or tracker == self.growth_interval:
            self.scale, self.growth_tracker = next_scale(
                self.scale, self.growth_tracker, found, self.growth_factor,
                self.backoff_factor, self.growth_interval)
        else:  # the usual clean step: only the tracker moves
            self.growth_tracker = tracker
        if counted:
            self.count(found)

    def count(self, skipped: bool) -> None:
        """One step more in the telemetry."""
        self.steps += 1
        self.skipped_steps += skipped
        self.last_step_skipped = skipped
        self.as_of_step = self.steps

    def set(self, value: float) -> None:
        """Sets the scale (``scale_factor = ...``), on the device too."""
        self.scale = value
        if self.device_scale is not None:
            self.device_scale.load(value, None)

    def sync_from_device(self) -> None:
        """Reads the device-resident scale and tracker back (a sync, as torch.amp's
        get_scale() is)."""
        if self.device_scale is not None:
            self.scale, self.growth_tracker = self.device_scale.read()

    def poll(self) -> None:
        """Takes the newest telemetry that reached the host from the device (no wait)."""
        snapshot = self.device_scale.poll() if self.device_scale is not None else None
        if snapshot is not None:
            (self.as_of_step, self.scale, self.growth_tracker, self.skipped_steps,
             self.last_step_skipped) = snapshot

    # -- traces --------------------------------------------------------------------------
    def enter_trace(self, tracer: Tracing, what: str) -> None:
        """Inside a trace the scale lives on the device from then on, starting from the
        copy brought up to date when the trace started."""
        _tracing.enter(tracer, what, (self.growth_factor, self.backoff_factor))
        if self.device_scale is None:
            self.device_scale = _tracing.take_copy(tracer, what, self.trace_copy)

    def mirror(self, tracer: Tracing) -> None:
        """Brings the trace copy up to date with the host's values (outside a trace)."""
        if self.device_scale is None:
            self.trace_copy = _tracing.mirror(tracer, self.trace_copy, self.scale,
                                              self.growth_tracker, self.skipped_steps)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.amp's five keys in its order, megengine.amp's "scale_factor" (the same
        number) after "scale", and the telemetry's counters: the same dict on both
        backends, which either framework's own scaler loads (each reads its keys).
        Reads the device-resident values back (a sync, as torch.amp's is)."""
        if self.device_scale is not None:
            # The read waits for the device, so every telemetry copy queued before it
            # has landed: the counters come from the newest, the scale and tracker from
            # the read (a scale set since the last update has no telemetry copy).
            self.sync_from_device()
            value, tracker = self.scale, self.growth_tracker
            self.poll()
            self.scale, self.growth_tracker = value, tracker
        return {
            "scale": self.scale,
            "scale_factor": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "last_step_skipped": self.last_step_skipped,
        }

    def load(self, state_dict: Any) -> None:
        """Loads a dict from ``state_dict()``, torch.amp's or megengine.amp's (no
        counters: those stay as they are); raises StateDictError, and changes nothing,
        for a malformed one."""
        if not isinstance(state_dict, Mapping):
            raise StateDictError(
                f"GradScaler.load_state_dict() expects a state dict (a mapping, from"
                f" state_dict()); got {type(state_dict).__name__}."
            )
        if len(state_dict) == 0:
            raise StateDictError(
                "The source state dict is empty, possibly because it was saved from a"
                " disabled instance of GradScaler."
            )
        has_t, has_m = "scale" in state_dict, "scale_factor" in state_dict
        if not (has_t or has_m):
            raise StateDictError(
                f"GradScaler state dict has no 'scale' (torch.amp) or 'scale_factor'"
                f" (megengine.amp) entry; its keys are {sorted(map(str, state_dict))}."
            )
        if has_t and has_m and state_dict["scale"] != state_dict["scale_factor"]:
            raise StateDictError(
                f"GradScaler state dict has both 'scale' ({state_dict['scale']!r}) and"
                f" 'scale_factor' ({state_dict['scale_factor']!r}) and they disagree."
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise StateDictError(
                f"GradScaler state dict is missing {missing}; expected the keys 'scale',"
                f" {', '.join(repr(k) for k in _STATE_KEYS)} from state_dict()."
            )
        scale = state_dict["scale"] if has_t else state_dict["scale_factor"]
        tracker = state_dict["_growth_tracker"]
        counters = [state_dict[k] for k in _COUNTERS if k in state_dict]
        try:
            check_factors(scale, state_dict["growth_factor"], state_dict["backoff_factor"],
                          state_dict["growth_interval"], scale_name="scale")
            if not _count(tracker):
                raise ValueError(f"_growth_tracker must be an int >= 0; got {tracker!r}.")
            if counters:
                _check_counters(state_dict, len(counters))
        except (TypeError, ValueError) as exc:
            raise StateDictError(f"GradScaler state dict is malformed: {exc}") from None
        self.scale = f32(float(scale))
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = state_dict["growth_interval"]
        self.growth_tracker = tracker
        if counters:
            self.steps, self.skipped_steps, self.last_step_skipped = counters
            self.as_of_step = self.steps
        if self.device_scale is not None:
            self.device_scale.load(self.scale, tracker, (self.steps, self.skipped_steps,
                                                self.last_step_skipped) if counters else None)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_counters(state_dict: Mapping[str, Any], present: int) -> None:
    if present != len(_COUNTERS):
        raise ValueError(f"it holds some of the counters {list(_COUNTERS)} but not all;"
                         f" give all three (from state_dict()) or none.")
    steps, skipped, last = (state_dict[k] for k in _COUNTERS)
    if not (_count(steps) and _count(skipped) and skipped <= steps):
        raise ValueError(f"steps and skipped_steps must be ints with 0 <= skipped_steps"
                         f" <= steps; got steps={steps!r}, skipped_steps={skipped!r}.")
    if not isinstance(last, bool) or (last and skipped == 0):
        raise ValueError(f"last_step_skipped must be a bool, and True only if"
                         f" skipped_steps > 0; got {last!r} with skipped_steps={skipped!r}.")
