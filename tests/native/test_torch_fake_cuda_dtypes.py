"""The dtype contract on CUDA, checked on fake CUDA tensors (tests/fake_cuda.py) in every
CI run: torch's AutocastCUDA policy and unified_amp's contract (a function mode) really
dispatch; only the kernels' arithmetic is absent. These
check output dtypes and devices, not values (the contract's ``cuda`` cases in
tests/contract/test_dtype_table.py check values, on a GPU).
"""

import os
import pathlib
import re
import sys

import pytest
import torch

import unified_amp as amp

from ..contract.dtype_table import ROWS, expected, input_kinds, inputs
from ..fake_cuda import FakeCudaKit, fc  # noqa: F401 (fc is a fixture)

pytestmark = pytest.mark.fake_cuda

CASES = [(row, kind) for row, _ in ROWS for kind in input_kinds(row)]
IDS = [f"{row}[{kind}]" for row, kind in CASES]
LOWS = ["float16", "bfloat16"]
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "DTYPE_CONTRACT.md"


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("row,kind", CASES, ids=IDS)
def test_fake_cuda_dtype_table(fc, row, kind, low):
    """Every (row, input) cell of the contract, inside ``amp.autocast(device="cuda")``."""
    with amp.autocast(dtype=low, device="cuda"):
        out = FakeCudaKit(fc).run_op(row, inputs(), "cuda", low, kind)
    assert out.device.type == "cuda"
    assert str(out.dtype).removeprefix("torch.") == expected(row, kind, low)


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("row", ["softmax", "batch norm", "layer norm"])
def test_fake_cuda_module_spellings(fc, row, low):
    with amp.autocast(dtype=low, device="cuda"):
        out = FakeCudaKit(fc).run_module(row, inputs(), "cuda", low)
    assert out.device.type == "cuda"
    assert str(out.dtype).removeprefix("torch.") == expected(row, "low", low)


def test_fake_cuda_default_dtype_is_float16_on_cuda(fc):
    """``autocast()`` with no device covers both devices where torch sees a GPU, each
    with its own default low dtype (SPEC §2)."""
    kit = FakeCudaKit(fc)
    inp = inputs()
    with amp.autocast():
        on_cuda = kit.run_op("matmul", inp, "cuda", "float16", "float32")
        on_cpu = kit.run_op("matmul", inp, "cpu", "float16", "float32")
        mean = kit.run_op("mean", inp, "cuda", "float16", "low")
    assert (on_cuda.dtype, on_cpu.dtype, mean.dtype) == \
        (torch.float16, torch.bfloat16, torch.float32)
    assert not amp.is_autocast_enabled()


def _native_cuda_column():
    """The doc table's "torch native, CUDA" cell of each row."""
    column, cells = None, {}
    for line in DOC.read_text().splitlines():
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None and "torch native, CUDA" in row:
            column = row.index("torch native, CUDA")
        elif column is not None and len(row) > column and row[0].strip("`") in dict(ROWS):
            cells[row[0].strip("`")] = row[column]
    assert set(cells) == set(dict(ROWS)), f"{DOC.name}: a row lacks its CUDA column"
    return cells


NATIVE_CUDA = _native_cuda_column()


def _native_dtype(cell, kind, low):
    words = re.sub(r"\W+", " ", cell).split()
    if words == ["low"]:
        return low
    if words == ["float32"]:
        return "float32"
    assert words in (["low", "input", "low"], ["input", "dtype"]), cell
    return low if kind == "low" else "float32"


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("row,kind", CASES, ids=IDS)
def test_fake_cuda_plain_torch_autocast_matches_the_docs_native_column(fc, row, kind, low):
    """docs/DTYPE_CONTRACT.md's "torch native, CUDA" column is what torch.autocast alone
    gives, and stays so after unified_amp has registered its CUDA kernels (they are
    inert outside a unified block)."""
    with amp.autocast(dtype=low, device="cuda"):  # the kernels are registered by now
        pass
    with torch.autocast("cuda", dtype=getattr(torch, low)):
        out = FakeCudaKit(fc).run_op(row, inputs(), "cuda", low, kind)
    assert str(out.dtype).removeprefix("torch.") == \
        _native_dtype(NATIVE_CUDA[row], "low" if kind == "mixed" else kind, low)


# The aten ops behind the table's float32 rows. The contract is a function mode
# (docs/COMPILE.md), never a kernel in torch's dispatcher: where torch's CUDA autocast
# has a float32 kernel the mode leaves the op alone, and it casts the inputs of the rest.
FLOAT32_OPS = ["softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "mean",
               "mean.dim", "exp", "log", "layer_norm", "avg_pool2d", "adaptive_avg_pool2d"]
OURS_ON_CUDA = {"mean", "mean.dim", "avg_pool2d", "adaptive_avg_pool2d"}


def test_fake_cuda_contract_registers_nothing_on_the_autocast_cuda_key(fc):
    with amp.autocast(dtype="float16", device="cuda"):
        pass
    adapter = os.path.dirname(sys.modules[type(amp.get_backend()).__module__].__file__)
    torchs = set()
    for name in FLOAT32_OPS:
        for line in torch._C._dispatch_dump(f"aten::{name}").splitlines():
            assert adapter not in line, line
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCUDA"):
            torchs.add(name)
    assert torchs == set(FLOAT32_OPS) - OURS_ON_CUDA
