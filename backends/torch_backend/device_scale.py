"""The device-resident scale, for optimizers that skip a step on the device by
themselves (torch's ``fused=True`` Adam, AdamW and SGD)."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch

from unified_amp import capabilities

from .scaling import check_and_unscale


class TorchDeviceScale(capabilities.DeviceScale):
    """The scale and growth tracker as device tensors, updated by torch's own
    ``_amp_update_scale_`` as torch.amp does, so that a fused optimizer (which skips on
    ``found_inf`` inside its kernel) steps with no host sync at all.

    Telemetry comes back through asynchronous copies into pinned memory, read only
    once their CUDA event has completed: ``poll()`` never waits.
    """

    def __init__(self, device: torch.device, scale: float, tracker: int, skipped: int):
        self.device = device
        self.scale_t = torch.full((), scale, dtype=torch.float32, device=device)
        self.tracker_t = torch.full((), tracker, dtype=torch.int32, device=device)
        self.skipped_t = torch.full((), skipped, dtype=torch.float64, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)  # check's factor
        self._in_flight: collections.deque = collections.deque()  # copies not yet landed
        self._latest: tuple | None = None  # the newest snapshot that has landed

    def scale(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.scale_t.to(y.device, non_blocking=True)

    def scaled_cotangents(self, ys: Sequence[torch.Tensor],
                          dys: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        if dys is None:
            return [torch.ones_like(y) * self.scale_t.to(y.device) for y in ys]
        return [dy * self.scale_t.to(dy.device, non_blocking=True) for dy in dys]

    def unscale_and_check(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # the reciprocal in float64, as torch.amp does
        inv = self.scale_t.double().reciprocal().float()
        return check_and_unscale(grads, inv, self.device)

    def check(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return check_and_unscale(grads, self._one, self.device)

    def rescale(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # multiplies by the scale: unscaled gradients back to the scale (no host read)
        return check_and_unscale(grads, self.scale_t, self.device)

    def step(self, optimizer: Any, unscale: bool, flags: Sequence[torch.Tensor],
             args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        # The attributes torch's fused optimizers read, set as torch.amp sets them: a
        # grad_scale the user preset multiplies ours, or stands alone once the gradients
        # were unscaled; both attributes are removed after the step.
        preset = getattr(optimizer, "grad_scale", None)
        if unscale:
            optimizer.grad_scale = self.scale_t if preset is None else self.scale_t * preset
        else:
            optimizer.grad_scale = preset
        optimizer.found_inf = self._combine(flags)
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf

    def _combine(self, flags: Sequence[torch.Tensor], found_host: bool = False
                 ) -> torch.Tensor:
        if not found_host and len(flags) == 1 and flags[0].device == self.device:
            return flags[0]  # the usual step: one check (only read from here on)
        found = torch.full((), float(found_host), dtype=torch.float32, device=self.device)
        for f in flags:
            found = found + f.to(self.device, non_blocking=True)
        return found

    def update(self, found_host: bool, flags: Sequence[torch.Tensor], growth: float,
               backoff: float, interval: int, *, steps: int, count: bool,
               new_scale: float | None) -> None:
        found = self._combine(flags, found_host)
        if new_scale is not None:
            self.scale_t.fill_(new_scale)
        else:
            torch._amp_update_scale_(self.scale_t, self.tracker_t, found, growth, backoff,
                                     interval)
        last = found > 0
        if count:
            self.skipped_t += last
        self._snapshot(steps, last)

    def _snapshot(self, steps: int, last_found: torch.Tensor) -> None:
        if self.device.type == "cpu":
            # Nothing is asynchronous on the CPU: poll() reads the tensors themselves.
            self._latest = (steps, None, last_found)
            return
        values = torch.stack([self.scale_t.double(), self.tracker_t.double(),
                              self.skipped_t, last_found.double()])
        if self.device.type == "cuda":
            buf = torch.empty(4, dtype=torch.float64, pin_memory=True)
            buf.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            buf, event = values.cpu(), None
        self._in_flight.append((steps, buf, event))
        # Drained here too, not only in poll(): a run that never asks for stats() must
        # not keep a buffer per step.
        self._drain()

    def _drain(self) -> None:
        while self._in_flight and (self._in_flight[0][2] is None
                                   or self._in_flight[0][2].query()):
            self._latest = self._in_flight.popleft()

    def poll(self) -> tuple[int, float, int, int, bool] | None:
        """The newest snapshot whose copy has landed, or None; never waits."""
        self._drain()
        if self._latest is None:
            return None
        steps, buf, last_found = self._latest
        if buf is None:  # a CPU snapshot
            return (steps, float(self.scale_t), int(self.tracker_t), int(self.skipped_t),
                    bool(last_found))
        scale, tracker, skipped, last = buf.tolist()
        return steps, scale, int(tracker), int(skipped), bool(last)

    def read(self) -> tuple[float, int]:
        # One copy to the host for both (torch.amp's get_scale() syncs once too); the
        # float64 pair holds the float32 scale and the int32 tracker exactly.
        scale, tracker = torch.stack([self.scale_t.double(),
                                      self.tracker_t.double()]).cpu().tolist()
        return scale, int(tracker)

    def load(self, scale: float, tracker: int | None,
             telemetry: tuple[int, int, bool] | None = None) -> None:
        self.scale_t.fill_(scale)
        if tracker is not None:
            self.tracker_t.fill_(tracker)
        if telemetry is not None:  # a checkpoint's: the snapshots in flight are older
            steps, skipped, last = telemetry
            self.skipped_t.fill_(skipped)
            self._in_flight.clear()
            last_t = torch.tensor(last)
            self._latest = (steps, None, last_t) if self.device.type == "cpu" else (
                steps, torch.tensor([scale, float(self.tracker_t), skipped, float(last)],
                                    dtype=torch.float64), None)


class DeviceResident(capabilities.DeviceResident):
    """Which optimizers step on the device, and the scale that lives there for them."""

    def steps_on_device(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` takes ``grad_scale``/``found_inf`` and skips on the
        device by itself: torch's fused Adam, AdamW and SGD (``fused=True``)."""
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False))

    def skip_leaves_uninitialised_state(self, optimizer: Any) -> bool:
        """torch's fused SGD with momentum, while it has no momentum buffer: its first
        step makes them with ``torch.empty_like``, and a step ``found_inf`` skips leaves
        them unwritten for the next step to read (torch.optim.sgd._fused_sgd). A group's
        buffers are made together, so its first parameter with a gradient tells."""
        if not isinstance(optimizer, torch.optim.SGD):
            return False
        state = optimizer.state
        for group in optimizer.param_groups:
            if not group.get("fused") or group["momentum"] == 0:
                continue
            first = next((p for p in group["params"] if p.grad is not None), None)
            if first is not None and state.get(first, {}).get("momentum_buffer") is None:
                return True
        return False

    def device_scale(self, optimizer: Any, scale: float, tracker: int,
                     skipped: int) -> TorchDeviceScale:
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        return TorchDeviceScale(device, scale, tracker, skipped)
