"""The MegEngine side of the benchmarks: megengine.amp's own step, device hooks and
figures.

The workloads and everything else framework-specific come from the construction kit
(``examples.frameworks.MegEngineKit``) and ``benchmarks.workloads``. Imported only when
the active backend is megengine, so the torch environment never needs MegEngine. Tensors
are made on the default device only: on the CPU build that is "xpux", a different comp
node from "cpux", and ops cannot mix the two.
"""

from __future__ import annotations

from typing import Any, Callable

import megengine
import megengine.amp
import megengine.autodiff
import megengine.device
import numpy as np

from examples.frameworks import MegEngineKit

from .workloads import BenchKit, Workload


class Kit(BenchKit, MegEngineKit):
    """Everything framework-specific that the benchmark needs from MegEngine."""

    native_description = ("megengine.amp.autocast inside megengine.autodiff.GradManager;"
                          " megengine.amp.GradScaler.backward(gm, loss);"
                          " opt.step().clear_grad()")

    def __init__(self, device: str) -> None:
        """Args: device: "auto" (CUDA if MegEngine sees one), "cpu" or "cuda"."""
        if device == "cuda" and not megengine.is_cuda_available():
            raise SystemExit("python -m benchmarks: --device cuda: MegEngine sees no CUDA"
                             " device (CPU build, or no driver).")
        super().__init__(device)

    # -- description ------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        info = {"framework": "megengine", "framework_version": megengine.__version__,
                "default_device": megengine.get_default_device()}
        if self.device == "cpu":
            info["threads"] = 1  # the default CPU comp node is single-threaded
        if self.device == "cuda":
            props = megengine.device.get_cuda_device_property(0)
            info.update(device_name=getattr(props, "name", "CUDA device 0"),
                        device_memory_bytes=getattr(props, "total_memory", None),
                        cuda_version=megengine.device.get_cuda_version(),
                        cudnn_version=megengine.device.get_cudnn_version())
        return info

    # -- the native step --------------------------------------------------------------
    def native_autocast(self, dtype: str) -> Any:
        return megengine.amp.autocast(enabled=True, low_prec_dtype=dtype)

    def native_step(self, w: Workload, dtype: str, *,
                    autocast: Callable[[], Any] | None = None, scaler: Any = None,
                    fp32_sensitive: bool = False) -> Callable[[], megengine.Tensor]:
        """megengine.amp's training step: its autocast inside its GradManager,
        ``scaler.backward(gm, loss)`` (scaled backward, unscale, update), then
        ``opt.step().clear_grad()``.

        Args:
            autocast: a factory for the autocast context to use instead of
                ``megengine.amp.autocast`` (the benchmark passes unified_amp's).
            scaler: a GradScaler to use instead of a new ``megengine.amp.GradScaler``.
            fp32_sensitive: cast the sensitive ops' inputs to float32 by hand (see
                ``Workload.loss``), to match unified_amp's dtype contract natively.
        """
        if autocast is None:
            def autocast() -> Any:
                return self.native_autocast(dtype)
        if scaler is None:
            scaler = megengine.amp.GradScaler()
        gm = megengine.autodiff.GradManager().attach(w.params)
        opt = w.optimizer

        def step() -> megengine.Tensor:
            with gm:
                with autocast():
                    loss = w.loss(fp32_sensitive)
                scaler.backward(gm, loss)
            opt.step().clear_grad()
            return loss

        return step

    # -- device hooks -----------------------------------------------------------------
    def tensor_bytes(self, tensors: Any) -> int:
        return sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in tensors)
