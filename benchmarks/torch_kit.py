"""The PyTorch side of the benchmarks: torch.amp's own step, device hooks and figures.

The workloads and everything else framework-specific come from the construction kit
(``examples.frameworks.TorchKit``) and ``benchmarks.workloads``. Imported only when the
active backend is torch, so the MegEngine environment never needs torch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from examples.frameworks import TorchKit

from .workloads import BenchKit, Workload

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Kit(BenchKit, TorchKit):
    """Everything framework-specific that the benchmark needs from torch."""

    native_description = ("torch.autocast; scaler.scale(loss).backward(); scaler.step(opt);"
                          " scaler.update() with torch.amp.GradScaler;"
                          " opt.zero_grad(set_to_none=True)")

    def __init__(self, device: str) -> None:
        """Args: device: "auto" (CUDA if torch sees one), "cpu" or "cuda"."""
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("python -m benchmarks: --device cuda: torch sees no CUDA device"
                             f" (torch {torch.__version__}).")
        super().__init__(device)
        if self.device == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick kernels

    # -- description ------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        info = {"framework": "torch", "framework_version": torch.__version__,
                "threads": torch.get_num_threads()}
        if self.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            info.update(device_name=torch.cuda.get_device_name(0),
                        device_memory_bytes=props.total_memory,
                        cuda_version=torch.version.cuda,
                        cudnn_version=torch.backends.cudnn.version())
        return info

    def layout(self, name: str, model: Any, x: Any) -> tuple[Any, Any]:
        if name == "convnet" and self.device == "cuda":
            # NHWC is what tensor-core convolutions want.
            return (model.to(memory_format=torch.channels_last),
                    x.contiguous(memory_format=torch.channels_last))
        return model, x

    # -- the native step --------------------------------------------------------------
    def native_autocast(self, dtype: str) -> Any:
        return torch.autocast(self.device, dtype=_DTYPES[dtype])

    def native_step(self, w: Workload, dtype: str, *,
                    autocast: Callable[[], Any] | None = None, scaler: Any = None,
                    fp32_sensitive: bool = False) -> Callable[[], torch.Tensor]:
        """torch.amp's training step: torch.autocast, loss.backward() on the scaled loss,
        scaler.step(opt), scaler.update().

        Args:
            autocast: a factory for the autocast context to use instead of
                ``torch.autocast`` (the benchmark passes unified_amp's).
            scaler: a GradScaler to use instead of a new ``torch.amp.GradScaler``.
            fp32_sensitive: cast the sensitive ops' inputs to float32 by hand (see
                ``Workload.loss``), to match unified_amp's dtype contract natively.
        """
        if autocast is None:
            def autocast() -> Any:
                return self.native_autocast(dtype)
        if scaler is None:
            scaler = torch.amp.GradScaler(self.device)
        opt = w.optimizer

        def step() -> torch.Tensor:
            with autocast():
                loss = w.loss(fp32_sensitive)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    # -- device hooks -----------------------------------------------------------------
    def tf32(self, on: bool) -> None:
        """Sets TF32 for float32 matmuls and convolutions (on CUDA)."""
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on

    def tensor_bytes(self, tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self, w: Workload) -> None:
        super().release(w)
        if self.device == "cuda":
            torch.cuda.empty_cache()
