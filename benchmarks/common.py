"""What the framework kits share: the workload record and the benchmark sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

WORKLOADS = ("convnet", "transformer")
TARGET = 1.02  # the most a unified step may cost over the native one (step-time ratio)


@dataclass
class Workload:
    """A model with its optimizer and one fixed batch, ready to train on.

    Attributes:
        name: "convnet" or "transformer".
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


# Sizes per (backend, device, mode). "full" on CPU is bounded by the ~8 minute budget per
# backend on a 2-core machine; MegEngine's float16 CPU kernels are 3-20x slower than its
# float32 ones (a float16 step of the torch sizes took ~0.4 s), so it gets smaller
# models. "full" on CUDA is sized to keep an H100 busy: per-step Python overhead must not
# dominate the kernels.
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

# Rounds x steps per section. Every round times each variant for `steps` steps, in an
# order rotated from round to round; ratios are taken within a round.
# Short blocks and many rounds: on a shared machine the background load changes every
# second or so, and a ratio is only fair when both of its blocks saw the same load.
SCHEDULE: dict[tuple[str, str, str], dict[str, int]] = {
    ("torch", "cpu", "full"): dict(warmup=3, rounds=7, steps=3, overhead_rounds=61,
                                   overhead_steps=4),
    ("megengine", "cpu", "full"): dict(warmup=3, rounds=7, steps=3, overhead_rounds=75,
                                       overhead_steps=2),
    ("any", "cuda", "full"): dict(warmup=10, rounds=10, steps=10, overhead_rounds=20,
                                  overhead_steps=10),
    ("any", "any", "quick"): dict(warmup=1, rounds=2, steps=2, overhead_rounds=3,
                                  overhead_steps=2),
}


def lookup(table: dict, *key: str) -> Any:
    """``table[key]``, where a key part may be stored as the wildcard "any"."""
    for candidate in table:
        if all(c in (k, "any") for c, k in zip(candidate, key)):
            return table[candidate]
    raise KeyError(key)
