"""The PyTorch adapter: unified_amp's primitives on torch's own kernels.

One module per capability, the same module names as every adapter package
(docs/DESIGN.md): ``basics`` (devices, dtypes), ``autocast``, ``grads``, ``scaling``,
``device_scale`` (fused optimizers), ``opt_levels``, ``forensics``, ``distributed``
and ``scaler`` (the ``torch.amp.GradScaler`` subclass). ``TorchBackend`` is their sum.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from unified_amp import capabilities, interface


def _import_parts() -> None:
    """Imports the adapter's modules with dynamo's frame evaluation off.

    The first use of the library may be inside a compiled call, in a frame dynamo runs
    eagerly (one it gave up on): there dynamo compiles every function called from it,
    those that the modules below run at import included, and the autocast block's
    entry, which runs before its marks (autocast_dynamo.py's ``never_a_frame_of_its_own``)
    are set. Imported here first, nothing of them is compiled; the imports below find
    them in ``sys.modules``.
    """
    for part in ("basics", "dtype_contract", "autocast", "device_scale", "distributed",
                 "forensics", "grads", "opt_levels", "scaler", "scaling"):
        importlib.import_module(f"{__name__}.{part}")


torch.compiler.disable(_import_parts)()

from .autocast import Autocasting  # noqa: E402
from .basics import Basics  # noqa: E402
from .device_scale import DeviceResident, TorchDeviceScale  # noqa: E402
from .distributed import Collectives  # noqa: E402
from .forensics import ForensicsProbes  # noqa: E402
from .grads import Gradients  # noqa: E402
from .opt_levels import OptLevelCasting  # noqa: E402
from .scaler import NativeScaler, TorchCudaGradScaler, TorchGradScaler  # noqa: E402
from .scaling import LossScaling  # noqa: E402

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
    _versions: capabilities.GradVersions = TorchBackend()
    _probes: capabilities.BackwardProbes = TorchBackend()
    _resident: capabilities.DeviceResident = TorchBackend()
    _native: capabilities.NativeScalerClass = TorchBackend()
    _collectives: capabilities.Collectives = TorchBackend()
    _data_parallel: capabilities.DataParallelHooks = TorchBackend()
