"""The PyTorch side of the benchmarks: models, data, torch.amp's own step, device hooks.

Imported only when the active backend is torch, so the MegEngine environment never
needs torch.
"""

from __future__ import annotations

import gc
import math
import os
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import Workload

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN pairs and a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(nn.Module):
    """A small ResNet: stem, three stages (width, 2x, 4x; stride 1, 2, 2), pool, linear."""

    def __init__(self, width: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, fp32_sensitive: bool = False) -> torch.Tensor:
        x = self.layers(self.stem(x))
        if fp32_sensitive:
            x = x.float()
        return self.head(x.mean(dim=(2, 3)))  # global average pooling


class TransformerBlock(nn.Module):
    """A pre-LayerNorm encoder block, then mean pooling and a linear classifier.

    Attention is spelled out (linear, matmul, softmax) rather than fused, so that both
    frameworks run the same ops and autocast's per-op dtype rules apply to each.
    """

    def __init__(self, d_model: int, heads: int, classes: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.head = nn.Linear(d_model, classes)

    def attention(self, x: torch.Tensor, fp32_sensitive: bool) -> torch.Tensor:
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        if fp32_sensitive:
            scores = scores.float()
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor, fp32_sensitive: bool = False) -> torch.Tensor:
        # The residual stream stays float32 (float32 + low is float32), so the layer
        # norms and the mean see float32 inputs in every variant; only the softmax
        # input differs.
        x = x + self.attention(self.ln1(x), fp32_sensitive)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(dim=1))


class Kit:
    """Everything framework-specific that the benchmark needs from torch."""

    name = "torch"
    native_description = ("torch.autocast; scaler.scale(loss).backward(); scaler.step(opt);"
                          " scaler.update() with torch.amp.GradScaler;"
                          " opt.zero_grad(set_to_none=True)")

    def __init__(self, device: str) -> None:
        """Args: device: "auto" (CUDA if torch sees one), "cpu" or "cuda"."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device"
                             f" (torch {torch.__version__}).")
        self.device = device
        self._dev = torch.device(device)
        if device == "cuda":
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

    def threads(self, n: int) -> str | None:
        """Sets torch's intra-op CPU threads (0: torch's default); returns a note."""
        if self.device != "cpu":
            return None
        if n:
            torch.set_num_threads(n)
        return (f"torch runs CPU kernels on {torch.get_num_threads()} thread(s) of"
                f" {os.cpu_count()} (--threads {n}).")

    # -- building ---------------------------------------------------------------------
    def build(self, name: str, size: dict[str, int], seed: int) -> Workload:
        """The named workload at ``size``, with data drawn from ``seed``."""
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        b, classes = size["batch"], size["classes"]
        if name == "convnet":
            model = ConvNet(size["width"], size["blocks"], classes)
            x = rng.standard_normal((b, 3, size["image"], size["image"]), dtype=np.float32)
        else:
            model = TransformerBlock(size["d_model"], size["heads"], classes)
            x = rng.standard_normal((b, size["seq"], size["d_model"]), dtype=np.float32)
        model = model.to(self._dev)
        x = torch.from_numpy(x).to(self._dev)
        if name == "convnet" and self.device == "cuda":
            # NHWC is what tensor-core convolutions want.
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.from_numpy(rng.integers(0, classes, b)).to(self._dev)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

        def loss(fp32_sensitive: bool = False) -> torch.Tensor:
            return F.cross_entropy(model(x, fp32_sensitive), y)

        return Workload(name, params, opt, loss, b, dict(size), model)

    # -- the native step --------------------------------------------------------------
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
                return torch.autocast(self.device, dtype=_DTYPES[dtype])
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
    def read(self, loss: torch.Tensor) -> float:
        return float(loss.item())

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def tf32(self, on: bool) -> str | None:
        """Sets TF32 for float32 matmuls and convolutions; a note where it does not apply."""
        if self.device != "cuda":
            return "TF32 is a CUDA (Ampere+) feature: the --tf32 setting is ignored on CPU."
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
        return None

    def reset_peak_memory(self) -> None:
        if self.device == "cuda":
            self.sync()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, how it was measured); bytes is None where torch reports nothing."""
        if self.device != "cuda":
            return None, ("torch reports peak memory for CUDA only"
                          " (torch.cuda.max_memory_allocated); there is no framework"
                          " figure on CPU")
        self.sync()
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated()"

    def tensor_bytes(self, tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def optimizer_state(self, opt: Any) -> list[torch.Tensor]:
        """The optimizer's per-parameter state tensors (momentum buffers, ...)."""
        return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]

    def release(self, w: Workload) -> None:
        """Frees the workload's memory before the next one is built."""
        w.model = w.params = w.optimizer = w.loss = None
        gc.collect()  # anything cyclic that still holds tensors goes now, not later
        if self.device == "cuda":
            torch.cuda.empty_cache()
