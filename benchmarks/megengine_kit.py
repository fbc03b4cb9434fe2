"""The MegEngine side of the benchmarks: models, data, megengine.amp's own step, device
hooks.

Imported only when the active backend is megengine, so the torch environment never
needs MegEngine. Tensors are made on the default device only: on the CPU build that is
"xpux", a different comp node from "cpux", and ops cannot mix the two.
"""

from __future__ import annotations

import gc
import math
from typing import Any, Callable

import megengine
import megengine.amp
import megengine.autodiff
import megengine.device
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as O
import numpy as np

from .common import Workload


class BasicBlock(M.Module):
    """ResNet's basic block: two 3x3 conv-BN pairs and a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = M.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = M.BatchNorm2d(cout)
        self.conv2 = M.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = M.BatchNorm2d(cout)
        self.shortcut = M.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = M.Sequential(M.Conv2d(cin, cout, 1, stride, bias=False),
                                         M.BatchNorm2d(cout))

    def forward(self, x: megengine.Tensor) -> megengine.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(M.Module):
    """A small ResNet: stem, three stages (width, 2x, 4x; stride 1, 2, 2), pool, linear."""

    def __init__(self, width: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = M.Sequential(M.Conv2d(3, width, 3, 1, 1, bias=False),
                                 M.BatchNorm2d(width), M.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
                cin = cout
        self.layers = M.Sequential(*layers)
        self.head = M.Linear(cin, classes)

    def forward(self, x: megengine.Tensor,
                fp32_sensitive: bool = False) -> megengine.Tensor:
        x = self.layers(self.stem(x))
        if fp32_sensitive:
            x = x.astype("float32")
        # Not F.nn.adaptive_avg_pool2d: MegEngine 1.13's float16 CPU kernel returns zeros
        # (then NaN losses) for a 2x2 input, the size --quick ends with.
        return self.head(x.mean(axis=(2, 3)))


class TransformerBlock(M.Module):
    """A pre-LayerNorm encoder block, then mean pooling and a linear classifier.

    The same ops as the torch model (spelled-out attention), in MegEngine's modules.
    """

    def __init__(self, d_model: int, heads: int, classes: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = M.LayerNorm(d_model)
        self.qkv = M.Linear(d_model, 3 * d_model)
        self.proj = M.Linear(d_model, d_model)
        self.ln2 = M.LayerNorm(d_model)
        self.fc1 = M.Linear(d_model, 4 * d_model)
        self.fc2 = M.Linear(4 * d_model, d_model)
        self.head = M.Linear(d_model, classes)

    def attention(self, x: megengine.Tensor, fp32_sensitive: bool) -> megengine.Tensor:
        b, s, d = x.shape
        h = self.heads
        qkv = self.qkv(x).reshape(b, s, 3, h, d // h).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = F.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(d // h))
        if fp32_sensitive:
            scores = scores.astype("float32")
        out = F.matmul(F.softmax(scores, axis=-1), v)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(b, s, d))

    def forward(self, x: megengine.Tensor,
                fp32_sensitive: bool = False) -> megengine.Tensor:
        x = x + self.attention(self.ln1(x), fp32_sensitive)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(axis=1))


class Kit:
    """Everything framework-specific that the benchmark needs from MegEngine."""

    name = "megengine"
    native_description = ("megengine.amp.autocast inside megengine.autodiff.GradManager;"
                          " megengine.amp.GradScaler.backward(gm, loss);"
                          " opt.step().clear_grad()")

    def __init__(self, device: str) -> None:
        """Args: device: "auto" (CUDA if MegEngine sees one), "cpu" or "cuda"."""
        cuda = bool(megengine.is_cuda_available())
        if device == "auto":
            device = "cuda" if cuda else "cpu"
        if device == "cuda" and not cuda:
            raise SystemExit("--device cuda: MegEngine sees no CUDA device (CPU build, or"
                             " no driver).")
        if device == "cpu" and cuda:
            # A CUDA build defaults to the GPU; every tensor below lands on the default.
            megengine.set_default_device("cpux")
        self.device = device

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

    def threads(self, n: int) -> str | None:
        """MegEngine's default CPU comp node runs one thread; returns a note saying so."""
        if self.device != "cpu":
            return None
        return ("MegEngine runs CPU kernels on one thread: its default CPU comp node is"
                f" single-threaded (--threads {n} applies to torch only).")

    # -- building ---------------------------------------------------------------------
    def build(self, name: str, size: dict[str, int], seed: int) -> Workload:
        """The named workload at ``size``, with data drawn from ``seed``."""
        megengine.random.seed(seed)
        rng = np.random.default_rng(seed)
        b, classes = size["batch"], size["classes"]
        if name == "convnet":
            model = ConvNet(size["width"], size["blocks"], classes)
            x = rng.standard_normal((b, 3, size["image"], size["image"]), dtype=np.float32)
        else:
            model = TransformerBlock(size["d_model"], size["heads"], classes)
            x = rng.standard_normal((b, size["seq"], size["d_model"]), dtype=np.float32)
        x = megengine.tensor(x)
        y = megengine.tensor(rng.integers(0, classes, b).astype(np.int32))
        model.train()
        params = list(model.parameters())
        opt = O.SGD(params, lr=0.01, momentum=0.9)

        def loss(fp32_sensitive: bool = False) -> megengine.Tensor:
            return F.nn.cross_entropy(model(x, fp32_sensitive), y)

        return Workload(name, params, opt, loss, b, dict(size), model)

    # -- the native step --------------------------------------------------------------
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
                return megengine.amp.autocast(enabled=True, low_prec_dtype=dtype)
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
    def read(self, loss: megengine.Tensor) -> float:
        # Kernel errors surface at the next read, so every step reads its loss.
        return float(loss.item())

    def sync(self) -> None:
        megengine._full_sync()

    def tf32(self, on: bool) -> str | None:
        """TF32 is a torch switch; returns the note that it does not apply here."""
        return ("--tf32 sets torch.backends flags; MegEngine has no such switch, so the"
                " setting is ignored on this backend.")

    def reset_peak_memory(self) -> None:
        self.sync()
        megengine.device.reset_max_memory_stats()

    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, how it was measured); bytes is None where MegEngine reports nothing."""
        self.sync()
        peak = int(megengine.device.get_max_allocated_memory())
        if peak == 0 and self.device == "cpu":
            return None, ("megengine.device.get_max_allocated_memory() returns 0 on the CPU"
                          " build, also after steps that allocate; there is no framework"
                          " figure on CPU")
        return peak, "megengine.device.get_max_allocated_memory() after megengine._full_sync()"

    def tensor_bytes(self, tensors: Any) -> int:
        return sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in tensors)

    def optimizer_state(self, opt: Any) -> list[megengine.Tensor]:
        """The optimizer's per-parameter state tensors (momentum buffers, ...)."""
        return [v for st in opt._state.values() for v in st.values()
                if isinstance(v, megengine.Tensor)]

    def release(self, w: Workload) -> None:
        """Frees the workload's memory before the next one is built."""
        w.model = w.params = w.optimizer = w.loss = None
        gc.collect()  # anything cyclic that still holds tensors goes now, not later
