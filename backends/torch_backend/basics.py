"""Framework basics: torch's dtypes and devices, as the core names them."""

from __future__ import annotations

from typing import Any

import torch

from unified_amp import interface

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ALL_DTYPES = dict(DTYPES, float32=torch.float32)
LOW = (torch.float16, torch.bfloat16)


def devices(device: str | None) -> list[str]:
    """The device types an autocast block for ``device`` touches (None: every one here)."""
    if device is not None:
        return [device]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def default_dtype(device: str) -> str:
    # bfloat16 on CPU: on these avx512_bf16 CPUs it runs faster than fp32, while
    # float16 runs slower (SPEC §2). float16 on CUDA, the classic AMP choice.
    return "bfloat16" if device == "cpu" else "float16"


class Basics(interface.Basics):
    """Devices and dtypes."""

    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def dtype_name(self, dtype: Any) -> str | None:
        if isinstance(dtype, torch.dtype):
            return str(dtype).removeprefix("torch.")
        return None
