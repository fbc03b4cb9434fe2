"""The dtype contract on CUDA, checked on fake CUDA tensors (tests/fake_cuda.py) in every
CI run: torch's AutocastCUDA policy really dispatches; only the kernels' arithmetic is
absent. These check output dtypes and devices, not values (the contract's ``cuda``
cases in tests/contract/test_dtype_table.py check values, on a GPU).

The contract *is* torch's CUDA policy (unified_amp/dtype_contract/): every row's rule
is what ``torch.autocast("cuda")`` gives its sample call, and a unified block that
covers only CUDA pushes nothing, so a GPU step makes no Python call into unified_amp.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp
from unified_amp import dtype_contract as table
from unified_amp.backends.torch_backend import dtype_contract as adapter

from ..contract.dtype_table import (ROWS, call_of, expected, inputs, on_this_torch, row,
                                   spelling_calls)
from ..fake_cuda import FakeCudaKit, fc, report_a_gpu  # noqa: F401 (fc is a fixture)

pytestmark = pytest.mark.fake_cuda

LOWS = ["float16", "bfloat16"]


def cuda_kinds(r):
    """The input kinds a row's CUDA cell is checked with: float32 only where torch's
    CUDA kernels take no low-precision input (fake CUDA's meta kernels accept one for
    most of them), except the rows that refuse one everywhere (``refuse_low``: fake CUDA
    shows torch refusing it, as the adapters do on the CPU and on MegEngine)."""
    return r.kinds() if r.sample.cuda_low or r.refuse_low else ("float32",)


def cuda_expected(r, kind, low):
    if (r.sample.no_bfloat16 and low == "bfloat16" or r.refuse_low) and kind != "float32":
        return "error"
    return expected(r, kind, low, r.sample.torch)


def run(fc, r, kind, low, block, call=None):
    """``block``'s dtype for the row's torch call (or ``call``) on fake CUDA, or "error"."""
    try:
        with block:
            out = FakeCudaKit(fc).run_call(call or r.sample.torch, "cuda", low, kind, inputs())
    except RuntimeError:
        return "error"
    assert out.device.type == "cuda"
    return str(out.dtype).removeprefix("torch.")


# (rows from a later torch than this one: test_dtype_table.py checks their op is absent)
RUNNABLE = [r.name for r in ROWS if call_of(r, "torch") and not r.sample.fake_cuda]
# Whether this torch's AutocastCUDA keeps the whole contract by itself (torch 2.13, the
# table's torch: yes). An older torch's registrations may differ: then a CUDA block
# pushes the contract's mode for those rows (docs/DTYPE_CONTRACT.md, "Devices").
MODE_ON_CUDA = "cuda" in adapter.MODE_DEVICES


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", [n for n in RUNNABLE if not adapter.drifted(row(n), "cuda")])
def test_each_rule_is_torch_cuda_autocasts_own(fc, name, low):
    """The table's rule for a row is measured, not read from a list: plain
    torch.autocast("cuda") gives every row its rule's dtype (with unified_amp imported
    and its blocks used before: nothing of ours reaches torch.autocast). On an older
    torch, the rows it registers otherwise are the mode's (the test below)."""
    r = row(name)
    with amp.autocast(dtype=low, device="cuda"):
        pass
    for kind in cuda_kinds(r):
        got = run(fc, r, kind, low, torch.autocast("cuda", dtype=getattr(torch, low)))
        assert got == cuda_expected(r, kind, low), (name, kind, low)


# Spellings of runnable rows that fake CUDA cannot run (their rows' first spellings it
# can), and why: checked on a GPU only (tests/run_gpu_half.sh), and checked here to
# still fail, so that a torch that lets fake CUDA run them has them join the test.
FAKE_CUDA_CANNOT = {
    "torch.geqrf": "geqrf's fake kernel falls back to a real CUDA one, which a CPU build lacks",
    "torch.orgqr": "its geqrf (above)",
    "torch.ormqr": "its geqrf (above)",
    "torch.linalg.householder_product": "its geqrf (above)",
    "torch.polar": "its inputs are views of the sample (pair[..., 0]), which fake CUDA"
                   " cannot copy without a CUDA device guard",
    "torch.complex": "as torch.polar",
    "torch.linalg.lstsq": "under autocast on fake CUDA its output shape depends on the"
                          " values (DynamicOutputShapeException)",
}


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", RUNNABLE)
def test_every_spelling_on_cuda_is_torch_cuda_autocasts_own_and_the_contracts(fc, name, low):
    """Every spelling of the row (tests/contract/test_namespaces.py proves them on the
    CPU and on MegEngine), not only its first: plain torch.autocast("cuda") gives it the
    row's dtype (so the rule holds for every spelling, measured), and so does
    amp.autocast(device="cuda")."""
    r = row(name)
    drifted = adapter.drifted(r, "cuda")  # then the contract's mode keeps it on CUDA
    wrong = {}
    for spelling, call in spelling_calls(r, "torch"):
        if spelling in FAKE_CUDA_CANNOT and not torch.backends.cuda.is_built():
            assert _cannot(fc, low, call), (
                f"{spelling} runs on fake CUDA now: drop it from FAKE_CUDA_CANNOT")
            continue
        if spelling in FAKE_CUDA_CANNOT and _cannot(fc, low, call):
            continue  # a CUDA build (make test-oldest) may run it: then it is checked
        for kind in cuda_kinds(r):
            want = cuda_expected(r, kind, low)
            blocks = [("amp.autocast", amp.autocast(dtype=low, device="cuda"))]
            if not drifted:  # an older torch's own rule for the row is not the table's
                blocks.append(("torch.autocast", torch.autocast("cuda", dtype=getattr(torch, low))))
            for label, block in blocks:
                got = run(fc, r, kind, low, block, call)
                if got != want:
                    wrong[(spelling, kind, label)] = (got, want)
    assert not wrong, wrong


def _cannot(fc, low, call):
    """Whether fake CUDA fails to run ``call`` (a float32 input, under torch.autocast)."""
    try:
        with torch.autocast("cuda", dtype=getattr(torch, low)):
            FakeCudaKit(fc).run_call(call, "cuda", low, "float32", inputs())
    except (NotImplementedError, RuntimeError, AssertionError):
        return True
    return False


@pytest.mark.parametrize("name", [r.name for r in ROWS if r.sample.fake_cuda])
def test_rows_fake_cuda_cannot_run_still_cannot(fc, name):
    """The rows checked on a GPU only (their note says why): on a CPU build (make
    test's), a torch that gains the missing meta kernel fails this, so that they join
    the test above. A CUDA build (make test-oldest, the matrix) has some of what a CPU
    build lacks (grid sample's device guard: it runs there from torch 2.10 on); where a
    row runs, its dtypes are the rule's."""
    r = row(name)
    ran = {}
    for kind in cuda_kinds(r):
        try:
            with torch.autocast("cuda", dtype=torch.float16):
                out = FakeCudaKit(fc).run_call(r.sample.torch, "cuda", "float16", kind, inputs())
        except (NotImplementedError, RuntimeError, AssertionError):
            continue
        ran[kind] = str(out.dtype).removeprefix("torch.")
    if not torch.backends.cuda.is_built():
        assert ran == {}, f"{name} runs on fake CUDA now: drop its fake_cuda note"
    assert ran == {kind: cuda_expected(r, kind, "float16") for kind in ran}, name


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", RUNNABLE)
def test_the_contract_on_cuda_is_torch_cuda_autocast_with_no_mode(fc, name, low):
    """Inside ``amp.autocast(device="cuda")`` every row has its rule's dtype, and no
    function mode is on torch's stack: on this torch, torch's CUDA kernels keep the
    whole contract."""
    r = row(name)
    for kind in cuda_kinds(r):
        block = amp.autocast(dtype=low, device="cuda")
        stack = []

        class Probe:
            def __enter__(self):
                block.__enter__()
                stack.append(torch._C._len_torch_function_stack())

            def __exit__(self, *exc):
                block.__exit__(*exc)

        assert run(fc, r, kind, low, Probe()) == cuda_expected(r, kind, low), (name, kind)
        assert stack == [int(MODE_ON_CUDA)]


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", ["softmax", "batch norm", "layer norm"])
def test_the_module_spellings_on_cuda(fc, name, low):
    with amp.autocast(dtype=low, device="cuda"):
        out = FakeCudaKit(fc).run_module(name, inputs(), "cuda", low)
    assert out.device.type == "cuda"
    assert str(out.dtype).removeprefix("torch.") == cuda_expected(row(name), "low", low)


def test_autocast_with_no_device_covers_cuda_where_torch_sees_a_gpu(fc):
    """``amp.autocast()`` is ``torch.autocast("cuda")`` on a GPU machine: CUDA in
    float16, the CPU left alone, no mode pushed (docs/API.md, "Devices"). A nested
    ``amp.autocast(device="cpu")`` adds the CPU, with the contract's mode for it; a
    disabled block turns every device off."""
    kit = FakeCudaKit(fc)
    inp = inputs()
    with amp.autocast():
        assert torch._C._len_torch_function_stack() == int(MODE_ON_CUDA)
        on_cuda = kit.run_op("matmul", inp, "cuda", "float16", "float32")
        on_cpu = kit.run_op("matmul", inp, "cpu", "float16", "float32")
        assert (on_cuda.dtype, on_cpu.dtype) == (torch.float16, torch.float32)
        with amp.autocast(device="cpu"):
            assert torch._C._len_torch_function_stack() == 1
            on_cpu = kit.run_op("matmul", inp, "cpu", "bfloat16", "float32")
            exp_cpu = kit.run_op("exp", inp, "cpu", "bfloat16", "low")
            assert (on_cpu.dtype, exp_cpu.dtype) == (torch.bfloat16, torch.float32)
        with amp.autocast(enabled=False):
            assert not amp.is_autocast_enabled()
        assert amp.is_autocast_enabled()
    assert not amp.is_autocast_enabled()


# -- a GPU step makes no Python call into unified_amp ------------------------------------

def _ours() -> tuple[str, ...]:
    backend_dir = os.path.dirname(os.path.dirname(sys.modules[adapter.__name__].__file__))
    return (os.path.dirname(amp.__file__) + os.sep, backend_dir + os.sep)


@contextlib.contextmanager
def counting_calls():
    """Counts Python calls into unified_amp's files (the core and the adapters), and all
    calls, while the block runs."""
    ours = _ours()
    counts = {"ours": 0, "all": 0, "mode": 0}

    def profile(frame, event, arg):
        if event == "call":
            counts["all"] += 1
            if frame.f_code.co_filename.startswith(ours):
                counts["ours"] += 1
                counts["mode"] += frame.f_code.co_filename == adapter.__file__

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def conv_net(fc):
    return fc.module(lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8, track_running_stats=False),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16, track_running_stats=False),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10)))


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (one head: fake CUDA cannot copy the
    permuted views that splitting heads makes, tests/fake_cuda.py bypass 5), an MLP, and
    a classifier head on the mean over positions."""

    def __init__(self, d=16):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        h = self.ln1(x)
        q, k, v = (f(h).unsqueeze(1) for f in (self.q, self.k, self.v))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(1))


def transformer_block(fc):
    return fc.module(Block)


STEPS = {
    "conv net": (conv_net, lambda fc: fc.tensor((4, 3, 8, 8)),
                 lambda out, y: F.cross_entropy(out, y)),
    "transformer block": (transformer_block, lambda fc: fc.tensor((4, 6, 16)),
                          lambda out, y: F.cross_entropy(out, y)),
}


@pytest.mark.parametrize("device", [None, "cuda"])
@pytest.mark.parametrize("model", list(STEPS))
def test_a_gpu_step_makes_no_python_call_into_unified_amp(fc, model, device):
    build, data, loss_of = STEPS[model]
    net, x = build(fc), data(fc)
    y = torch.zeros(4, dtype=torch.long, device="cuda")
    with amp.autocast(device=device):
        with counting_calls() as counts:
            loss = loss_of(net(x), y)
    assert loss.dtype == torch.float32
    assert counts["all"] > 0  # the count sees the forward's own Python calls
    if MODE_ON_CUDA:  # an older torch: only the mode runs, for the rows it needs
        assert counts["ours"] == counts["mode"], counts
    else:
        assert counts["ours"] == 0, counts


# -- the table's registrations, the running torch's, and ours ---------------------------

def _registrations(key):
    """torch's own (aten's) registrations on ``key``: a custom op's
    ``torch.library.register_autocast`` is the program's, not torch's lists
    (tests/native/test_torch_rules.py registers one)."""
    return {op.removeprefix("aten::") for op in
            torch._C._dispatch_get_registrations_for_dispatch_key(key) if op.startswith("aten::")}


def _keys(op):
    return {key for key in ("AutocastCPU", "AutocastCUDA")
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)}


def _a_named_twin(op, ops):
    """Whether ``op`` is a named-tensor overload (its dims by name: torch 2.7 registers
    ``softmax.Dimname``, ``sum.dim_DimnameList``, ... where 2.13 does not) of an op whose
    row holds an overload that autocast registers on the same devices: the same Python
    spelling, under the same policy."""
    name, _, overload = op.partition(".")
    schema = torch._C._get_schema(f"aten::{name}", overload)
    by_name = any(a.name == "dim" and str(a.type) in ("str", "List[str]") for a in schema.arguments)
    return by_name and any(
        other.partition(".")[0] == name and _keys(other) == _keys(op) for other in ops)


def test_every_autocast_registration_lands_in_a_row():
    """Each op that torch's CPU or CUDA autocast names is in some row of the table (so
    its dtype is the contract's), or is a named-dims twin of one; on the table's own
    torch, the recorded sets are the dispatcher's."""
    ops = {op for r in ROWS for op in r.aten}
    registered = _registrations("AutocastCPU") | _registrations("AutocastCUDA")
    assert {op for op in registered - ops if not _a_named_twin(op, ops)} == set()
    if torch.__version__.split("+")[0] == table.TABLE_TORCH and not torch.backends.cuda.is_built():
        assert _registrations("AutocastCUDA") == table.CUDA_REGISTRATIONS
        assert _registrations("AutocastCPU") == table.CPU_REGISTRATIONS
        assert len(registered) == 207


@pytest.mark.parametrize("name", [r.name for r in ROWS if r.torch_since])
def test_a_row_from_a_later_torch_is_registered_as_recorded_from_that_torch_on(name):
    """A row that exists from ``torch_since`` on: on that torch and later, each of its
    ops has the Autocast kernels ``LATER_REGISTRATIONS`` records (so the adapter counts
    it as the table's, not drifted); on an earlier torch, the dispatcher has no such op."""
    r = row(name)
    for op in r.aten:
        if on_this_torch(r):
            assert _keys(op) == table.LATER_REGISTRATIONS[op], op
            assert not adapter.drifted(r, "cpu") and not adapter.drifted(r, "cuda")
        else:
            with pytest.raises(RuntimeError, match="no matching schema"):
                torch._C._get_schema(f"aten::{op.partition('.')[0]}", op.partition(".")[2])


def test_the_mode_covers_cuda_only_where_this_torch_registers_differently(monkeypatch):
    """Decision for older torches: a row whose ops AutocastCUDA registers otherwise than
    the table's torch did is the mode's on CUDA too (so a CUDA block pushes it there).
    Here: this torch as it is (on the table's torch, nothing on CUDA), and as if
    rms_norm lost its CUDA kernel (its row on CUDA)."""
    drifted = [r.name for r in ROWS if adapter.drifted(r, "cuda")]
    assert MODE_ON_CUDA == bool(drifted)
    if torch.__version__.split("+")[0] == table.TABLE_TORCH:
        assert drifted == []
    real = adapter._registered
    monkeypatch.setattr(adapter, "_registered",
                        lambda op, key: False if op == "rms_norm" else real(op, key))
    assert adapter.handled_devices(row("RMS norm")) == {"cpu", "cuda"}
    assert adapter.handled_devices(row("linear")) == frozenset()


def test_the_contract_registers_nothing_in_torchs_dispatcher(fc):
    with amp.autocast(dtype="float16", device="cuda"):
        pass
    with amp.autocast(dtype="bfloat16", device="cpu"):
        pass
    ours = _ours()
    for op in sorted({op for r in ROWS for op in r.aten}):
        try:
            dump = torch._C._dispatch_dump(f"aten::{op}")
        except RuntimeError:  # an op of another torch's table (_cudnn_rnn on a CPU build)
            continue
        assert not any(path in dump for path in ours), op


def test_the_adapters_mode_is_the_only_python_on_a_cpu_block(monkeypatch):
    """The CPU side, for contrast: a CPU block pushes the contract's mode (torch's CPU
    policy is another one), and a GPU machine's default block does not."""
    with amp.autocast(device="cpu"):
        assert isinstance(torch._C._get_function_stack_at(0), adapter.ContractMode)
    report_a_gpu(monkeypatch)
    with amp.autocast():
        assert torch._C._len_torch_function_stack() == int(MODE_ON_CUDA)
        assert torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
