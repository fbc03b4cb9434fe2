"""The PyTorch adapter: unified_amp's primitives on torch's own kernels.

One module per capability, the same module names as every adapter package
(docs/DESIGN.md): ``basics`` (devices, dtypes), ``autocast``, ``grads``, ``scaling``,
``device_scale`` (fused optimizers), ``opt_levels``, ``forensics``, ``distributed``
and ``scaler`` (the ``torch.amp.GradScaler`` subclass). ``TorchBackend`` is their sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from unified_amp import interface

from .autocast import Autocasting
from .basics import Basics
from .device_scale import DeviceResident, TorchDeviceScale
from .distributed import Collectives
from .forensics import ForensicsProbes
from .grads import Gradients
from .opt_levels import OptLevelCasting
from .scaler import NativeScaler, TorchCudaGradScaler, TorchGradScaler
from .scaling import LossScaling

__all__ = ["TorchBackend", "TorchGradScaler", "TorchCudaGradScaler", "TorchDeviceScale"]


class TorchBackend(Basics, Autocasting, Gradients, LossScaling, OptLevelCasting,
                   ForensicsProbes, DeviceResident, Collectives, NativeScaler):
    """unified_amp adapter for PyTorch (CPU and CUDA)."""

    name = "torch"

    def __init__(self) -> None:
        self._scale_cache: dict[torch.device, tuple[float, torch.Tensor]] = {}
        self._inv_cache: dict[torch.device, tuple[float, torch.Tensor]] = {}


if TYPE_CHECKING:  # mypy holds the adapter to the interface (make typecheck)
    _backend: interface.Backend = TorchBackend()
    _versions: interface.GradVersions = TorchBackend()
    _probes: interface.BackwardProbes = TorchBackend()
    _resident: interface.DeviceResident = TorchBackend()
    _native: interface.NativeScalerClass = TorchBackend()
    _collectives: interface.Collectives = TorchBackend()
    _data_parallel: interface.DataParallelHooks = TorchBackend()
