"""Each row of the dtype contract, on each backend, device and low-precision dtype."""

import pathlib
import re

import numpy as np
import pytest

import unified_amp as amp

from .dtype_table import ROWS, expected, input_kinds, inputs, round_through

CASES = [(row, kind) for row, _ in ROWS for kind in input_kinds(row)]
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "DTYPE_CONTRACT.md"

# The one combination a backend cannot compute (documented in docs/DTYPE_CONTRACT.md):
# MegEngine's CPU build has no bfloat16 matmul/conv kernels.
UNSUPPORTED = {("megengine", "cpu", "bfloat16")}


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("row,kind", CASES, ids=[f"{r}[{k}]" for r, k in CASES])
def test_output_dtype(kit, device, row, kind, low):
    inp = inputs()
    block = amp.autocast(dtype=low, device=device)
    if (kit.name, device, low) in UNSUPPORTED:
        with pytest.raises(amp.UnsupportedPrecisionError):
            block.__enter__()
        return
    with block:
        out = kit.run_op(row, inp, device, low, kind)
    assert kit.dtype_name(out) == expected(row, kind, low)
    assert np.all(np.isfinite(kit.numpy(out)))


TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2}


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("row", [r for r, _ in ROWS])
def test_values_match_float32_within_low_precision_tolerance(kit, device, row, low):
    """The right dtype is not enough: each row's values under autocast must agree with
    float32 on the same (pre-rounded) inputs. This is what catches a framework's broken
    low-precision kernel (MegEngine's float16 pooling on CPU)."""
    if (kit.name, device, low) in UNSUPPORTED:
        return  # test_output_dtype checks that the block refuses to start
    inp = {k: round_through(v, low) for k, v in inputs().items()}
    kind = input_kinds(row)[-1]
    reference = kit.numpy(kit.run_op(row, inp, device, low, "float32"))
    with amp.autocast(dtype=low, device=device):
        got = kit.numpy(kit.run_op(row, inp, device, low, kind))
    tol = TOLERANCE[low]
    np.testing.assert_allclose(got, reference, rtol=tol, atol=tol)


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("row", ["softmax", "batch norm", "layer norm"])
def test_module_spellings_follow_the_same_rows(kit, device, row, low):
    if (kit.name, device, low) in UNSUPPORTED:
        with pytest.raises(amp.UnsupportedPrecisionError):
            with amp.autocast(dtype=low, device=device):
                kit.run_module(row, inputs(), device, low)
        return
    with amp.autocast(dtype=low, device=device):
        out = kit.run_module(row, inputs(), device, low)
    assert kit.dtype_name(out) == expected(row, "low", low)
    assert np.all(np.isfinite(kit.numpy(out)))


@pytest.mark.parametrize("row", [r for r, _ in ROWS])
def test_outside_autocast_float32_inputs_stay_float32(kit, device, row):
    # float32 data (or, for the add row, float16 + float32 promoting to float32)
    assert kit.dtype_name(kit.run_op(row, inputs(), device, "float16", input_kinds(row)[0])) \
        == "float32"
    # the contract's wrappers are inert outside a unified block: softmax keeps float16
    assert kit.dtype_name(kit.run_op("softmax", inputs(), device, "float16", "low")) == "float16"


def test_disabled_block_inside_enabled_block_computes_in_float32(kit, device):
    inp = inputs()

    def dtype_of(row):
        out = kit.run_op(row, inp, device, "float16", "float32")
        # Reading the values makes an asynchronous kernel failure surface here.
        assert np.all(np.isfinite(kit.numpy(out)))
        return kit.dtype_name(out)

    with amp.autocast(dtype="float16", device=device):
        assert dtype_of("matmul") == "float16"
        with amp.autocast(enabled=False):
            assert not amp.is_autocast_enabled()
            assert [dtype_of(r) for r in ("matmul", "linear", "conv2d", "batch norm")] \
                == ["float32"] * 4
        assert amp.is_autocast_enabled()
        assert dtype_of("matmul") == "float16"
    assert not amp.is_autocast_enabled()


def test_docs_table_matches_the_contract():
    text = DOC.read_text()
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].strip("`") in dict(ROWS):
            table[cells[0].strip("`")] = (cells[1], cells[2])
    words = {"low": "low", "float32": "float32"}
    for row, _ in ROWS:
        assert row in table, f"row {row!r} missing from {DOC.name}"
        for kind, cell in zip(("float32", "low"), table[row]):
            k = "mixed" if row == "add low+float32" else kind
            want = expected(row, k, "low")
            assert re.sub(r"\W", "", cell.lower()).startswith(words[want]), (row, kind, cell)
