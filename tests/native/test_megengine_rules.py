"""A block's own rules under ``megengine.jit.trace``: a traced function runs with the
rules it was traced with, as its eager run does; a call under other rules is refused
by the trace (MegEngine's own TraceError, "operator mismatch"), never served by the
graph of the old ones, and the traced rules keep working after it."""

from __future__ import annotations

import numpy as np
import pytest

import megengine  # noqa: E402
import megengine.functional as F  # noqa: E402
from megengine.jit import trace  # noqa: E402

import unified_amp as amp  # noqa: E402


def scaled(h):
    """A function of the program's own, which rules name."""
    return F.exp(h) * 0.5


def forward(x, w):
    return F.softmax(scaled(F.matmul(x, w)), -1)


RULES = {"A": {"softmax": "low", "matmul": "float32"}, "B": {"softmax": "float32", scaled: "low"}}


def _data():
    rng = np.random.RandomState(0)
    return (megengine.tensor(rng.randn(4, 8).astype("float32")),
            megengine.tensor(rng.randn(8, 8).astype("float32")))


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("first", ["A", "B"])
def test_a_traced_block_keeps_its_rules_and_refuses_others(first, symbolic):
    x, w = _data()
    current = {"rules": RULES[first]}

    def step(x, w):
        with amp.autocast(dtype="float16", rules=current["rules"]):
            return forward(x, w)

    traced = trace(step, symbolic=symbolic)
    with amp.autocast(dtype="float16", rules=RULES[first]):
        want = forward(x, w)
    for _ in range(3):  # the recording call, then replays
        got = traced(x, w)
        assert str(got.dtype) == str(want.dtype)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    other = "B" if first == "A" else "A"
    current["rules"] = RULES[other]
    with pytest.raises(Exception, match="mismatch"):
        traced(x, w).numpy()
    current["rules"] = RULES[first]
    np.testing.assert_array_equal(traced(x, w).numpy(), want.numpy())
