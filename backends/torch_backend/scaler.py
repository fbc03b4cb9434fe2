"""The native scaler class: a unified_amp GradScaler that is also torch's own."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
from torch.amp.grad_scaler import OptState

from unified_amp import scaler as _core

from .scaling import by_device, check_and_unscale_per_device


class NativeScaler:
    """Which GradScaler subclass ``amp.GradScaler(...)`` makes on torch."""

    def scaler_class(self, device: str | None) -> type:
        """A subclass of unified_amp.GradScaler that is also torch's own GradScaler
        (torch.cuda.amp's when made for CUDA), for runners that check isinstance."""
        cuda = device.split(":")[0] == "cuda" if device else torch.cuda.is_available()
        return TorchCudaGradScaler if cuda else TorchGradScaler


class TorchGradScaler(_core.GradScaler, torch.amp.GradScaler):
    """``unified_amp.GradScaler`` on the torch backend; also a ``torch.amp.GradScaler``.

    All behaviour is the core's (torch.amp's ``__init__`` never runs). The private
    attributes below are the ones code in the wild reads from torch.amp's scaler
    (docs/DROP_IN.md lists them); each is derived from the core's state on demand.
    """

    def _torch_device(self) -> torch.device:
        if self._dev is not None:
            return self._dev.device
        if self._device:
            return torch.device(self._device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # torch.amp's scaler keeps these as plain attributes; here they are read-only views
    # of the core's state, on purpose (docs/DROP_IN.md), hence the ignored overrides.
    @property
    def _scale(self) -> torch.Tensor | None:  # type: ignore[override]
        """The scale as a float32 0-dim tensor (a copy, except in device mode)."""
        if not self._enabled:
            return None
        if self._dev is not None:
            return self._dev.scale_t
        return torch.full((), self._scale_value, dtype=torch.float32,
                          device=self._torch_device())

    @property
    def _growth_tracker(self) -> torch.Tensor | None:  # type: ignore[override]
        if not self._enabled:
            return None
        if self._dev is not None:
            return self._dev.tracker_t
        return torch.full((), self._tracker, dtype=torch.int32, device=self._torch_device())

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        self._sync_from_device()
        return self._tracker if self._enabled else 0

    def _flags_of(self, checks: Sequence[Any]) -> list[torch.Tensor]:
        flags = []
        for check in checks:
            if check.flag is not None:
                flags.append(check.ready())
            elif check.found is not None:
                flags.append(torch.full((), float(check.found), device=self._torch_device()))
        return flags

    # torch annotates these two as dict[str, Any]; its own implementation, which these
    # mirror, keys them by torch.device.
    def _found_inf_per_device(  # type: ignore[override]
            self, optimizer: Any) -> dict[torch.device, torch.Tensor]:
        state = self._opt_states.get(id(optimizer))
        return by_device(self._flags_of(state.checks if state is not None else []))

    def _check_inf_per_device(  # type: ignore[override]
            self, optimizer: Any) -> dict[torch.device, torch.Tensor]:
        # What optimizers with the older step(grad_scaler=...) contract call: check
        # without unscaling (they unscale inside), counted by the next update().
        params = [p for g in optimizer.param_groups for p in g["params"]]
        check = self._check(params, unscale=False, read=False, allow_fp16=True)
        self._opt_state(optimizer).checks.append(check)
        return self._found_inf_per_device(optimizer)

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:  # type: ignore[override]
        """A read-only snapshot in torch.amp's shape (writing to it changes nothing)."""
        stages = {_core._Stage.READY: OptState.READY, _core._Stage.UNSCALED: OptState.UNSCALED,
                  _core._Stage.STEPPED: OptState.STEPPED}
        snapshot: dict[int, dict[str, Any]] = defaultdict(
            lambda: {"stage": OptState.READY, "found_inf_per_device": {}})
        for key, state in self._opt_states.items():
            snapshot[key] = {"stage": stages[state.stage],
                             "found_inf_per_device": by_device(self._flags_of(state.checks))}
        return snapshot

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch.amp's helper, for code that calls it directly: unscales the optimizer's
        gradients by ``inv_scale`` and returns a found-inf flag per device. The scaler's
        own methods do not go through it, so overriding it changes nothing."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        if not allow_fp16 and any(g.dtype == torch.float16 for g in grads):
            raise ValueError("Attempting to unscale FP16 gradients.")
        found = check_and_unscale_per_device(grads, inv_scale)
        return {device: flag + found_inf.to(device) for device, flag in found.items()}


class TorchCudaGradScaler(TorchGradScaler, torch.cuda.amp.GradScaler):
    """The same, made for CUDA: also a ``torch.cuda.amp.GradScaler`` (older runners
    check that class)."""


# Pickles record a class by module and name: keep the path they had before the adapter
# was split into modules, where the package re-exports both classes, so that scalers
# pickled by either version load in the other.
TorchGradScaler.__module__ = TorchCudaGradScaler.__module__ = "unified_amp.backends.torch_backend"
