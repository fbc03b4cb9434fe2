"""Framework basics: MegEngine's dtypes, devices, tensors, modules and casts, as the
core names them."""

from __future__ import annotations

from typing import Any

import numpy as np

import megengine
from megengine.core.tensor.dtype import bfloat16, is_bfloat16
from megengine.module import Module as _Module

from unified_amp import interface

LOW = (np.dtype("float16"),)


def is_low(dtype: Any) -> bool:
    return dtype in LOW or is_bfloat16(dtype)


CPU_ONLY = not megengine.is_cuda_available()  # then "xpux", the default, is the CPU


def on_cpu(t: Any) -> bool:
    device = str(t.device)
    return device.startswith("cpu") or (CPU_ONLY and device.startswith("xpu"))


def dtype_name(dtype: Any) -> str | None:
    """'float16', 'bfloat16', 'float32', ... for a numpy or MegEngine dtype, else None."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return "bfloat16" if is_bfloat16(dt) else dt.name


def cast(tensor: Any, dtype: str) -> Any:
    if dtype_name(tensor.dtype) == dtype:
        return tensor
    return tensor.astype(bfloat16 if dtype == "bfloat16" else dtype)


class Basics(interface.Basics):
    """Devices, dtypes, tensors, modules, casts."""

    def cuda_available(self) -> bool:
        return bool(megengine.is_cuda_available())

    def dtype_name(self, dtype: Any) -> str | None:
        return dtype_name(dtype)

    def device_type(self, tensor: Any) -> str:
        return "cpu" if on_cpu(tensor) else "cuda"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, megengine.Tensor)

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, _Module)

    def named_modules(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def cast(self, tensor: Any, dtype: str) -> Any:
        return cast(tensor, dtype)
