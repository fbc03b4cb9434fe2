"""unified_amp: one automatic-mixed-precision API for PyTorch and MegEngine.

    import unified_amp as amp

    gm = amp.GradManager(model.parameters())
    scaler = amp.GradScaler()
    with gm:
        with amp.autocast():                # the device's fast low precision
            loss = loss_fn(model(x), y)
        scaler.backward(gm, loss)           # scaled backward, unscale, update
    optimizer.step(); gm.zero_grad()

apex.amp's API is here too, on both frameworks: ``amp.initialize(model, optimizer,
opt_level="O2")`` and ``with amp.scale_loss(loss, optimizer) as scaled: ...``
(docs/APEX.md).

The backend is chosen by ``amp.set_backend()``, else ``UNIFIED_AMP_BACKEND``, else the
first installed of torch, megengine. Importing this package imports no framework.
"""

from ._registry import available_backends, get_backend, register_backend, set_backend
from .autocast import autocast, is_autocast_enabled
from .apex.cast_registry import (
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .errors import (
    BackendUnavailableError,
    CompileWarning,
    ContractWarning,
    MissingCapabilityError,
    PortabilityWarning,
    ScalerArgumentError,
    ScalerStateError,
    StateDictError,
    TensorTypeError,
    UnifiedAmpError,
    UnknownBackendError,
    UnsupportedPrecisionError,
    UnsupportedTraceError,
)
from .forensics import OverflowReport, OverflowWarning, trace_forward
from .grad import GradManager, clip_grad_norm
from .apex.opt_levels import (
    OptProperties,
    initialize,
    load_state_dict,
    loss_scaler,
    master_params,
    opt_properties,
    scale_loss,
    state_dict,
)
from .pinning import keep_float32
from .scaler import GradScaler
from .scaler._grad_scaler import subscribe_forensics
from .forensics import ScalerForensics

# Each GradScaler's overflow reports listen to its state machine; subscribed here, where
# the public API is assembled, so that the scaler imports no forensics.
subscribe_forensics(ScalerForensics)

# The modules' paths before apex/ was a package: `from unified_amp import opt_levels`.
from .apex import cast_registry, opt_levels  # noqa: F401

__version__ = "0.5.0"

__all__ = [
    "autocast",
    "is_autocast_enabled",
    "keep_float32",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "GradScaler",
    "GradManager",
    "clip_grad_norm",
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "loss_scaler",
    "opt_properties",
    "OptProperties",
    "trace_forward",
    "OverflowReport",
    "OverflowWarning",
    "set_backend",
    "get_backend",
    "available_backends",
    "register_backend",
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
