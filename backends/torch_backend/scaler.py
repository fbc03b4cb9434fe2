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

    # torch.amp keeps the values its lazily made _scale/_growth_tracker tensors start
    # from; load_state_dict() and unpickling set them. There is no lazy start here, so
    # they read (and write) the scale and tracker the next step uses -- the same values
    # wherever torch.amp's have not yet been overtaken by its tensors.
    @property
    def _init_scale(self) -> float:
        self._sync_from_device()
        return self._scale_value

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._set_scale(self._valid_scale(value, "_init_scale"))

    @property
    def _init_growth_tracker(self) -> int:
        return self._get_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"GradScaler _init_growth_tracker must be an int >= 0;"
                             f" got {value!r}.")
        self._sync_from_device()
        self._tracker = value
        if self._dev is not None:
            self._dev.load(self._scale_value, value)

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
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if not allow_fp16 and g.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
                    # As torch.amp: duplicate indices summed first, since their float16
                    # sum may overflow where each value alone does not.
                    g = p.grad = g.coalesce()
                grads.append(g)
        found = check_and_unscale_per_device(grads, inv_scale)
        # torch.amp's kernel sets the flag it is given (a copy per device) to 1 on a find
        return {device: torch.maximum(flag, found_inf.to(device))
                for device, flag in found.items()}


class TorchCudaGradScaler(TorchGradScaler, torch.cuda.amp.GradScaler):
    """The same, made for CUDA: also a ``torch.cuda.amp.GradScaler`` (older runners
    check that class)."""


# Pickles record a class by module and name: keep the path they had before the adapter
# was split into modules, where the package re-exports both classes, so that scalers
# pickled by either version load in the other.
TorchGradScaler.__module__ = TorchCudaGradScaler.__module__ = "unified_amp.backends.torch_backend"
