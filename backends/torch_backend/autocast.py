"""Autocasting: torch.autocast per device, and the dtype contract's float32 kernels."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from unified_amp import interface
from unified_amp.errors import UnsupportedPrecisionError

from .basics import DTYPES, LOW, default_dtype, devices

# Ops the dtype contract puts in float32 whatever their input (docs/DTYPE_CONTRACT.md).
# Where torch's autocast already has a kernel for an (op, device) pair -- on CUDA it puts
# softmax, log_softmax, sum, exp, log and layer_norm in float32 -- we leave it alone; where
# it falls through (all of these on CPU; mean and average pooling on CUDA), a float16
# input would give a float16 output, so we register a kernel on that device's Autocast
# key.
_FP32_OPS = (
    "softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "mean", "mean.dim",
    "exp", "log", "layer_norm", "avg_pool2d", "adaptive_avg_pool2d",
)
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


class _Policy(threading.local):
    """Whether the innermost unified autocast block of this thread is enabled.

    The registered kernels consult it so that plain ``torch.autocast`` (not ours) keeps
    torch's own behaviour even after this adapter is loaded.
    """

    def __init__(self) -> None:
        self.stack: list[bool] = []

    @property
    def on(self) -> bool:
        return bool(self.stack) and self.stack[-1]


_policy = _Policy()
_library: torch.library.Library | None = None
_installed: set[str] = set()  # device types whose kernels are registered


def _fp32_kernel(op: Any, key: str) -> Callable[..., Any]:
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _policy.on:
            args = tuple(
                a.float() if isinstance(a, torch.Tensor) and a.dtype in LOW else a
                for a in args
            )
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    return kernel


def _install_policy(device_type: str) -> None:
    """Registers the float32 kernels for one device type, once per process."""
    global _library
    if device_type in _installed:
        return
    _installed.add(device_type)
    key = _AUTOCAST_KEYS[device_type]
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
    for name in _FP32_OPS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
            continue
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        _library.impl(name, _fp32_kernel(op, key), key)


class Autocasting(interface.Autocasting):
    """Switching autocast on and off, and which precisions a device computes."""

    def check_precision(self, dtype: str | None, device: str | None) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise UnsupportedPrecisionError(
                "autocast(device='cuda') was requested, but torch sees no CUDA device"
                f" (torch {torch.__version__}). Use device='cpu' or device=None."
            )
        for dev in devices(device):
            want = dtype or default_dtype(dev)
            if dev == "cuda" and want == "bfloat16" and not torch.cuda.is_bf16_supported():
                raise UnsupportedPrecisionError(
                    f"autocast dtype 'bfloat16' is not supported by this CUDA device"
                    f" ({torch.cuda.get_device_name()}); use dtype='float16'."
                )

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True) -> Any:
        contexts = []
        for dev in devices(device):
            if enabled and contract:
                _install_policy(dev)
            ctx = torch.autocast(
                dev, dtype=DTYPES[dtype or default_dtype(dev)], enabled=enabled
            )
            ctx.__enter__()
            contexts.append(ctx)
        _policy.stack.append(enabled and contract)
        return contexts

    def exit_autocast(self, token: Any) -> None:
        _policy.stack.pop()
        for ctx in reversed(token):
            ctx.__exit__(None, None, None)

    def is_autocast_enabled(self) -> bool:
        return any(torch.is_autocast_enabled(dev) for dev in devices(None))

    def autocast_low_dtype(self, device: str) -> str | None:
        if not torch.is_autocast_enabled(device):
            return None
        return str(torch.get_autocast_dtype(device)).removeprefix("torch.")
