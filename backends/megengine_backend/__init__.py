"""The MegEngine adapter: unified_amp's primitives on MegEngine's own kernels.

One module per capability, the same module names as every adapter package
(docs/DESIGN.md): ``basics`` (devices, dtypes), ``autocast``, ``grads``, ``scaling``,
``opt_levels``, ``forensics``, ``distributed``, ``device_scale`` (for traced steps
only); ``scaler`` says why MegEngine has no native scaler subclass.
``MegEngineBackend`` is their sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unified_amp import capabilities, interface

from .autocast import Autocasting
from .basics import Basics
from .device_scale import TracedSteps
from .distributed import Collectives
from .forensics import ForensicsProbes
from .grads import Gradients
from .opt_levels import OptLevelCasting
from .scaling import LossScaling

__all__ = ["MegEngineBackend"]


class MegEngineBackend(Basics, Autocasting, Gradients, LossScaling, OptLevelCasting,
                       ForensicsProbes, TracedSteps, Collectives):
    """unified_amp adapter for MegEngine 1.13 (CPU; CUDA where its CUDA build runs)."""

    name = "megengine"


if TYPE_CHECKING:  # mypy holds the adapter to the interface (make typecheck)
    _backend: interface.Backend = MegEngineBackend()
    _collectives: capabilities.Collectives = MegEngineBackend()
    _tracing: capabilities.Tracing = MegEngineBackend()
