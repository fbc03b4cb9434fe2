"""The dtype contract under autocast, as data. docs/DTYPE_CONTRACT.md shows the same table
(a test keeps the two in step).

Rules:
  "low"      the autocast dtype (float16 or bfloat16), whatever the input
  "float32"  float32, whatever the input: numerically sensitive ops
  "input"    the dtype of the data input (batch norm: statistics are accumulated in float32
             by both frameworks' kernels; a float32 output after every low-precision conv
             would make AMP keep more activation memory than fp32 training; max pooling
             only selects values)
"""

import numpy as np

ROWS = [
    ("matmul", "low"),
    ("linear", "low"),
    ("conv2d", "low"),
    ("batched matmul", "low"),
    ("softmax", "float32"),
    ("log-softmax", "float32"),
    ("cross-entropy", "float32"),
    ("binary cross-entropy with logits", "float32"),
    ("MSE", "float32"),
    ("sum", "float32"),
    ("mean", "float32"),
    ("exp", "float32"),
    ("log", "float32"),
    ("batch norm", "input"),
    ("max pool", "input"),
    ("average pool", "float32"),
    ("global average pool", "float32"),
    ("layer norm", "float32"),
    ("add low+float32", "float32"),
]
RULE = dict(ROWS)


def input_kinds(row):
    """Which data-input dtypes a row is checked with."""
    return ("mixed",) if row == "add low+float32" else ("float32", "low")


def expected(row, kind, low):
    rule = RULE[row]
    if rule == "low":
        return low
    if rule == "float32":
        return "float32"
    return low if kind == "low" else "float32"


def inputs(seed=0):
    rng = np.random.RandomState(seed)
    f = lambda *shape: rng.randn(*shape).astype(np.float32)
    x = f(4, 8)
    return {
        "x": x, "w": f(6, 8), "b": f(6), "img": f(2, 3, 8, 8), "cw": f(4, 3, 3, 3),
        "cb": f(4), "a3": f(2, 4, 8), "b3": f(2, 8, 5),
        "labels": np.array([0, 3, 5, 7], dtype=np.int32), "pos": np.abs(x) + 0.1,
        "targets": (rng.rand(4, 8) > 0.5).astype(np.float32),
        "bn_mean": np.zeros(3, np.float32), "bn_var": np.ones(3, np.float32),
        "bn_w": np.ones(3, np.float32), "bn_b": np.zeros(3, np.float32),
        "ln_w": np.ones(8, np.float32), "ln_b": np.zeros(8, np.float32),
    }


def round_through(a, low):
    """``a`` rounded to the low dtype and back to float32 (numpy has no bfloat16:
    round-to-nearest-even on the top 16 bits of the float32 pattern)."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        return a
    if low == "float16":
        return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)
