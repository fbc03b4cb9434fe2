"""The benchmark workloads, written once for both frameworks on the construction kit
(``examples.frameworks``): a small ResNet, a transformer block and an MLP, their sizes,
and the training steps written once against unified_amp.

The models use only what both frameworks spell the same way (the kit's ``nn`` modules and
its ops), so the two frameworks run the same ops in the same order and autocast's per-op
dtype rules apply to each.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import unified_amp as amp

WORKLOADS = ("convnet", "transformer")


@dataclass
class Workload:
    """A model with its optimizer and one fixed batch, ready to train on.

    Attributes:
        name: "convnet", "transformer" or "mlp".
        params: the trainable parameters, in a stable order.
        optimizer: SGD with momentum over ``params``.
        loss: ``loss(fp32_sensitive=False)`` runs the forward pass on the fixed batch
            and returns the loss; ``fp32_sensitive=True`` casts the inputs of the
            model's numerically sensitive ops (softmax, global average pooling) to
            float32 by hand, as unified_amp's dtype contract does inside autocast.
        batch: samples per step (throughput is batch / step time).
        size: the hyper-parameters the model was built with.
    """

    name: str
    params: list[Any]
    optimizer: Any
    loss: Callable[..., Any]
    batch: int
    size: dict[str, int]
    model: Any = field(repr=False, default=None)


# Sizes per (backend, device, mode). "full" on CPU is bounded by a few minutes per section
# on a 2-core machine; MegEngine's float16 CPU kernels are 3-20x slower than its float32
# ones, so it gets smaller models. "full" on CUDA is sized to keep an H100 busy: per-step
# Python overhead must not dominate the kernels (the CPU sizes are the launch-bound case).
SIZES: dict[tuple[str, str, str], dict[str, dict[str, int]]] = {
    ("torch", "cpu", "full"): {
        "convnet": dict(batch=32, image=32, width=32, blocks=1, classes=10),
        "transformer": dict(batch=8, seq=128, d_model=256, heads=4, classes=10),
    },
    ("megengine", "cpu", "full"): {
        "convnet": dict(batch=16, image=16, width=8, blocks=1, classes=10),
        "transformer": dict(batch=4, seq=32, d_model=64, heads=4, classes=10),
    },
    ("any", "cuda", "full"): {
        "convnet": dict(batch=256, image=64, width=64, blocks=2, classes=100),
        "transformer": dict(batch=32, seq=512, d_model=1024, heads=16, classes=10),
    },
    ("any", "any", "quick"): {
        "convnet": dict(batch=4, image=8, width=8, blocks=1, classes=10),
        "transformer": dict(batch=2, seq=16, d_model=32, heads=2, classes=10),
    },
}
MLP = dict(width=256, depth=6, batch=64)  # issue 27's launch-bound step


def lookup(table: dict, *key: str) -> Any:
    """``table[key]``, where a key part may be stored as the wildcard "any"."""
    for candidate in table:
        if all(c in (k, "any") for c, k in zip(candidate, key)):
            return table[candidate]
    raise KeyError(key)


def _models(kit: Any) -> tuple[type, type]:
    """The ``ConvNet`` and ``TransformerBlock`` classes on ``kit``'s framework."""
    nn = kit.nn

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

        def forward(self, x: Any) -> Any:
            out = kit.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return kit.relu(out + self.shortcut(x))

    class ConvNet(nn.Module):
        """A small ResNet: stem, three stages (width, 2x, 4x; stride 1, 2, 2), pool,
        linear."""

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

        def forward(self, x: Any, fp32_sensitive: bool = False) -> Any:
            x = self.layers(self.stem(x))
            if fp32_sensitive:
                x = kit.float32(x)
            # Global average pooling as a mean, not MegEngine's adaptive_avg_pool2d:
            # MegEngine 1.13's float16 CPU kernel returns zeros (then NaN losses) for a
            # 2x2 input, the size --quick ends with.
            return self.head(x.mean((2, 3)))

    class TransformerBlock(nn.Module):
        """A pre-LayerNorm encoder block, then mean pooling and a linear classifier.

        Attention is spelled out (linear, matmul, softmax) rather than fused, so that
        both frameworks run the same ops and autocast's per-op dtype rules apply to each.
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

        def attention(self, x: Any, fp32_sensitive: bool) -> Any:
            b, s, d = x.shape
            h = self.heads
            qkv = kit.permute(self.qkv(x).reshape(b, s, 3, h, d // h), (2, 0, 3, 1, 4))
            q, k, v = qkv[0], qkv[1], qkv[2]
            scores = kit.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(d // h))
            if fp32_sensitive:
                scores = kit.float32(scores)
            out = kit.matmul(kit.softmax(scores, -1), v)
            return self.proj(kit.permute(out, (0, 2, 1, 3)).reshape(b, s, d))

        def forward(self, x: Any, fp32_sensitive: bool = False) -> Any:
            # The residual stream stays float32 (float32 + low is float32), so the layer
            # norms and the mean see float32 inputs in every variant; only the softmax
            # input differs.
            x = x + self.attention(self.ln1(x), fp32_sensitive)
            x = x + self.fc2(kit.gelu(self.fc1(self.ln2(x))))
            return self.head(x.mean(1))

    return ConvNet, TransformerBlock


class BenchKit:
    """What the benchmarks add to a framework kit, written once: the workloads and the
    hooks both frameworks spell the same way. Mixed into ``TorchKit``/``MegEngineKit``
    by ``benchmarks/<framework>_kit.py``."""

    def build(self, name: str, size: dict[str, int], seed: int) -> Workload:
        """The named workload at ``size``, with data drawn from ``seed``."""
        kit: Any = self
        kit.seed(seed)
        rng = np.random.default_rng(seed)
        b, classes = size["batch"], size["classes"]
        convnet, transformer = kit.define(_models)
        if name == "convnet":
            model = convnet(size["width"], size["blocks"], classes)
            x = rng.standard_normal((b, 3, size["image"], size["image"]), dtype=np.float32)
        else:
            model = transformer(size["d_model"], size["heads"], classes)
            x = rng.standard_normal((b, size["seq"], size["d_model"]), dtype=np.float32)
        model, x = self.layout(name, kit.place(model), kit.tensor(x))
        y = kit.labels(rng.integers(0, classes, b))
        model.train()
        params = kit.trainable(model)
        opt = kit.sgd(params, lr=0.01, momentum=0.9)

        def loss(fp32_sensitive: bool = False) -> Any:
            return kit.cross_entropy(model(x, fp32_sensitive), y)

        return Workload(name, params, opt, loss, b, dict(size), model)

    def mlp_workload(self, seed: int) -> Workload:
        """The MLP (``MLP``: 6 Linear(256, 256), batch 64) regressing a fixed batch."""
        kit: Any = self
        kit.seed(seed)
        rng = np.random.default_rng(seed)
        width, batch = MLP["width"], MLP["batch"]
        model = kit.mlp([width] * (MLP["depth"] + 1))
        x = kit.tensor(rng.standard_normal((batch, width), dtype=np.float32))
        y = kit.tensor(rng.standard_normal((batch, width), dtype=np.float32))
        params = kit.trainable(model)
        opt = kit.sgd(params, lr=1e-3, momentum=0.9)

        def loss(fp32_sensitive: bool = False) -> Any:
            return kit.mse(kit.float32(model(x)), y)

        return Workload("mlp", params, opt, loss, batch, dict(MLP), model)

    def layout(self, name: str, model: Any, x: Any) -> tuple[Any, Any]:
        """The model and its input in the memory layout the device wants (as they are)."""
        return model, x

    def read(self, loss: Any) -> float:
        # Every step reads its loss: MegEngine surfaces kernel errors at the next read.
        return float(loss.item())

    def clock(self) -> float:
        """What a block of steps is timed by: on a CPU the process's CPU time (all its
        threads, MegEngine's kernel worker included; what other processes on a shared
        machine do is not counted), on a GPU wall time (the host waits for the device)."""
        kit: Any = self
        return time.process_time() if kit.device == "cpu" else time.perf_counter()

    def block(self, step: Callable[[], Any]) -> Any:
        """``step`` as a ``timing.Block``: synced, its loss read, on this kit's clock."""
        from .timing import Block

        kit: Any = self
        return Block(step, sync=kit.synchronize, read=self.read, clock=self.clock)

    def optimizer_tensors(self, opt: Any) -> list[Any]:
        """The optimizer's per-parameter state tensors (momentum buffers, ...)."""
        kit: Any = self
        return [v for _, v in kit.optimizer_state(opt) if kit.is_tensor(v)]

    def release(self, w: Workload) -> None:
        """Frees the workload's memory before the next one is built."""
        w.model = w.params = w.optimizer = w.loss = None
        gc.collect()  # anything cyclic that still holds tensors goes now, not later


# -- the training steps, written once against unified_amp ---------------------------------
def unified_step(w: Workload, gm: amp.GradManager, dtype: str | None,
                 device: str) -> tuple[Callable[[], Any], amp.GradScaler]:
    """One training step of ``w`` in unified_amp's automatic mode.

    ``dtype`` None is the float32 baseline: the same code with autocast and the scaler
    disabled, so fp32 and AMP differ only in those two switches.

    Returns:
        (step, scaler): ``step()`` trains once and returns the loss tensor.
    """
    enabled = dtype is not None
    scaler = amp.GradScaler(enabled=enabled)
    opt = w.optimizer

    def step() -> Any:
        with gm:
            with amp.autocast(enabled=enabled, dtype=dtype, device=device):
                loss = w.loss()
            scaler.backward(gm, loss)  # scaled backward, unscale + inf check, update
        opt.step()  # after an overflow the scaler dropped the grads: nothing moves
        gm.zero_grad()
        return loss

    return step, scaler


def apex_step(w: Workload, gm: amp.GradManager) -> Callable[[], Any]:
    """One apex-style step of ``w`` after ``amp.initialize``: forward, loss,
    ``scale_loss`` + ``gm.backward``, the optimizer's step (skipped on overflow)."""
    opt = w.optimizer

    def step() -> Any:
        with gm:
            loss = w.loss()
            with amp.scale_loss(loss, opt) as scaled_loss:
                gm.backward(scaled_loss)
        opt.step()
        gm.zero_grad()
        return loss

    return step


def precision_supported(dtype: str, device: str) -> str | None:
    """None if the backend computes ``dtype`` on ``device``, else the library's reason."""
    try:
        with amp.autocast(dtype=dtype, device=device):
            pass
    except amp.UnsupportedPrecisionError as exc:
        return str(exc)
    return None
