"""The benchmark workloads, written once for both frameworks on the construction kit
(``examples.frameworks``): a small ResNet and a transformer block, their data and SGD.

The models use only what both frameworks spell the same way (the kit's ``nn`` modules and
its ops), so the two frameworks run the same ops in the same order and autocast's per-op
dtype rules apply to each.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import numpy as np

from .common import Workload


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

    def layout(self, name: str, model: Any, x: Any) -> tuple[Any, Any]:
        """The model and its input in the memory layout the device wants (as they are)."""
        return model, x

    def read(self, loss: Any) -> float:
        # Every step reads its loss: MegEngine surfaces kernel errors at the next read.
        return float(loss.item())

    def optimizer_tensors(self, opt: Any) -> list[Any]:
        """The optimizer's per-parameter state tensors (momentum buffers, ...)."""
        kit: Any = self
        return [v for _, v in kit.optimizer_state(opt) if kit.is_tensor(v)]

    def release(self, w: Workload) -> None:
        """Frees the workload's memory before the next one is built."""
        w.model = w.params = w.optimizer = w.loss = None
        gc.collect()  # anything cyclic that still holds tensors goes now, not later
