"""Framework basics: torch's dtypes, devices, tensors, modules and casts, as the core
names them."""

from __future__ import annotations

from typing import Any

import torch

from unified_amp import interface

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ALL_DTYPES = dict(DTYPES, float32=torch.float32)
LOW = (torch.float16, torch.bfloat16)


def devices(device: str | None, enabled: bool) -> list[str]:
    """The device types an autocast block for ``device`` touches.

    None: an enabled block covers the device where torch puts the work, CUDA where torch
    sees a GPU (as ``torch.autocast("cuda")`` does) and otherwise the CPU; a disabled one
    turns autocast off on every device here. docs/API.md, "Devices"."""
    if device is not None:
        return [device]
    if not torch.cuda.is_available():
        return ["cpu"]
    return ["cuda"] if enabled else ["cpu", "cuda"]


def default_dtype(device: str) -> str:
    # bfloat16 on CPU: on these avx512_bf16 CPUs it runs faster than fp32, while
    # float16 runs slower (SPEC §2). float16 on CUDA, the classic AMP choice.
    return "bfloat16" if device == "cpu" else "float16"


class Basics(interface.Basics):
    """Devices, dtypes, tensors, modules, casts."""

    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def dtype_name(self, dtype: Any) -> str | None:
        if isinstance(dtype, torch.dtype):
            return str(dtype).removeprefix("torch.")
        return None

    def device_type(self, tensor: torch.Tensor) -> str:
        return "cuda" if tensor.device.type == "cuda" else "cpu"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def named_modules(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def cast(self, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
        return tensor.to(ALL_DTYPES[dtype])
