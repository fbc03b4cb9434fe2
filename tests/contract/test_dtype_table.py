"""Each row of the dtype contract (unified_amp/dtype_contract/), on each backend,
device and low-precision dtype: the output dtype, the values, what the framework's own
autocast gives (the natives the adapters act on), and MegEngine's missing ops.

torch's CUDA cells are checked on fake CUDA in every CI run
(tests/native/test_torch_fake_cuda_dtypes.py), where they are also checked to be
torch.autocast("cuda")'s own; with a GPU, the ``cuda`` device here checks them too.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import unified_amp as amp
from unified_amp import dtype_contract
from unified_amp.dtype_contract import natives

from .dtype_table import (NOT_TRAINED, ROWS, call_of, dtypes, expected, inputs, label,
                          names, round_through, row, torch_has)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "DTYPE_CONTRACT.md"
LOWS = ["float16", "bfloat16"]

# The one combination a backend cannot compute (documented in docs/DTYPE_CONTRACT.md):
# MegEngine's CPU build has no bfloat16 matmul/conv kernels.
UNSUPPORTED = {("megengine", "cpu", "bfloat16")}


def refused(r, device):
    """Whether a low-precision input to the row raises on ``device``: everywhere for a
    row that refuses one (``refuse_low``), on CUDA where torch's kernels take none
    (``cuda_low``; torch raises there, docs/DTYPE_CONTRACT.md)."""
    return r.refuse_low or (device == "cuda" and not r.sample.cuda_low)


def want(r, kind, low, call, device="cpu"):
    """The contract's dtype for a cell, or "error"."""
    if (r.sample.no_bfloat16 and low == "bfloat16" or refused(r, device)) and kind != "float32":
        return "error"  # no complex bfloat16; no low-precision kernel on torch's CUDA
    return expected(r, kind, low, call)


def cell(kit, call, device, low, kind, inp):
    """What ``amp.autocast`` gives the call: its dtype (values read, so that an
    asynchronous kernel failure surfaces here), or "error" with the exception."""
    try:
        with amp.autocast(dtype=low, device=device):
            out = kit.run_call(call, device, low, kind, inp)
        values = kit.numpy(out)
    except (RuntimeError, ValueError) as exc:
        return "error", exc
    return kit.dtype_name(out), values


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", [r.name for r in ROWS])
def test_output_dtype(kit, device, name, low):
    """Every input kind of the row: float32, low-precision (and mixed for promote
    rows). Where the framework lacks the op, that it is absent."""
    r = row(name)
    call = call_of(r, kit.name)
    if call is None:
        if kit.name == "torch" and r.sample.torch:  # a row from a later torch than this one
            present = torch_has(r)
            assert not present, (f"this torch has {present}: {name!r} exists before"
                                 f" torch {r.torch_since}, its torch_since")
            return
        if kit.name == "torch":
            import torch

            absent = tuple(s.rpartition(".")[2] for s in r.megengine)
            spaces = (torch, torch.nn.functional)
        else:
            import megengine.functional as F

            absent = r.sample.megengine_absent or tuple(s.rpartition(".")[2] for s in r.torch)
            spaces = (F, F.nn)
        present = [n for n in absent if any(hasattr(space, n) for space in spaces)]
        assert absent and not present, f"{kit.name} has {present}: give {name!r} its call"
        return
    block = amp.autocast(dtype=low, device=device)
    if (kit.name, device, low) in UNSUPPORTED:
        with pytest.raises(amp.UnsupportedPrecisionError):
            block.__enter__()
        return
    inp = inputs()
    for kind in r.kinds():
        got, detail = cell(kit, call, device, low, kind, inp)
        wanted = want(r, kind, low, call, device)
        assert got == wanted, (name, kind, low, detail)
        if got == "error":
            assert isinstance(detail, RuntimeError), detail
            if r.rule == "refuse":
                assert "with_logits" in str(detail), detail
            elif r.refuse_low and device == "cpu":  # CUDA's error is torch's own
                assert str(detail) == dtype_contract.low_refusal(name), detail
        else:
            assert np.all(np.isfinite(detail)), (name, kind, low)


TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2}


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", [r.name for r in ROWS if r.rule != "refuse"])
def test_values_match_float32_within_low_precision_tolerance(kit, device, name, low):
    """The right dtype is not enough: under autocast each row's values (with its most
    low-precision input) agree with float32 on the same (pre-rounded) inputs. This is
    what catches a framework's broken low-precision kernel (MegEngine's float16
    pooling on CPU) and a float32 computation cast back wrongly."""
    r = row(name)
    call = call_of(r, kit.name)
    if call is None or (kit.name, device, low) in UNSUPPORTED:
        return  # test_output_dtype checks the absence / that the block refuses
    kind = "low"
    if r.sample.no_bfloat16 and low == "bfloat16" or refused(r, device):
        kind = "float32"  # a low-precision input raises (test_output_dtype)
    inp = {k: round_through(v, low) for k, v in inputs().items()}
    reference = kit.numpy(kit.run_call(call, device, low, "float32", inp))
    with amp.autocast(dtype=low, device=device):
        got = kit.numpy(kit.run_call(call, device, low, kind, inp))
    tol = TOLERANCE[low]
    np.testing.assert_allclose(got, reference, rtol=tol, atol=tol, err_msg=name)


# Rows with no gradient to check: torch has no derivative for floor_divide ("derivative
# for aten::floor_divide is not implemented"), with autocast or without.
NO_GRADIENT = {"floor division"}


@pytest.mark.parametrize("name", [r.name for r in ROWS if r.rule != "refuse"
                                  and r.name not in NO_GRADIENT])
def test_gradients_keep_their_inputs_dtypes(kit, device, name):
    """A backward pass through each row under the contract (float16 data, float32
    weights) gives every input a gradient of its own dtype: MegEngine's own autocast
    does not for square, and its batch norm of mixed inputs does not without it."""
    r = row(name)
    call = call_of(r, kit.name)
    if call is None:
        return
    # a float16 input is refused (test_output_dtype): float32 data
    kind = "float32" if refused(r, device) else "low"
    wrong = {n: g for n, (want, g) in _gradient_dtypes(kit, device, call, inputs(), kind).items()
             if g not in (None, want)}
    assert not wrong, (name, wrong)


def _gradient_dtypes(kit, device, call, inp, kind):
    """Each trained input of ``call`` (``kind`` data, float32 weights) -> (its dtype, its
    gradient's dtype) after a backward pass under the contract in float16."""
    with kit.on_device(device):
        scope, leaves = dict(kit.call_scope()), {}
        for n, dtype in dtypes(call, kind, "float16").items():
            if dtype == "int":
                scope[n] = kit.labels(inp[n], device)
            elif n in NOT_TRAINED:
                scope[n] = kit.tensor(inp[n], device, dtype)
            else:
                scope[n] = leaves[n] = kit.param(inp[n], device, dtype)
        grads = kit.grads_of(lambda: eval(call, scope), list(leaves.values()),  # noqa: S307
                             lambda: amp.autocast(dtype="float16", device=device))
    return {n: (kit.dtype_name(t), g) for (n, t), g in zip(leaves.items(), grads)}


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", ["softmax", "batch norm", "layer norm"])
def test_module_spellings_follow_the_same_rows(kit, device, name, low):
    if (kit.name, device, low) in UNSUPPORTED:
        with pytest.raises(amp.UnsupportedPrecisionError):
            with amp.autocast(dtype=low, device=device):
                kit.run_module(name, inputs(), device, low)
        return
    with amp.autocast(dtype=low, device=device):
        out = kit.run_module(name, inputs(), device, low)
    r = row(name)
    assert kit.dtype_name(out) == expected(r, "low", low, call_of(r, kit.name))
    assert np.all(np.isfinite(kit.numpy(out)))


@pytest.mark.parametrize("name", ["sqrt", "softmax", "sum", "divide", "batch norm",
                                  "mean", "exp"])
def test_outside_autocast_every_op_is_the_frameworks_own(kit, device, name):
    """The wrappers and the mode are inert outside a unified block: float32 stays
    float32, and a low-precision input gives what the framework gives by itself."""
    r = row(name)
    call = call_of(r, kit.name)
    inp = inputs()
    assert kit.dtype_name(kit.run_call(call, device, "float16", "float32", inp)) == "float32"
    native = kit.dtype_name(kit.run_call(call, device, "float16", "low", inp))
    own = {"megengine": {"mean": "float32"}}.get(kit.name, {})  # MegEngine's mean: float32
    assert native == own.get(name, "float16")


def test_disabled_block_inside_enabled_block_computes_in_float32(kit, device):
    inp = inputs()

    def dtype_of(name):
        out = kit.run_op(name, inp, device, "float16", "float32")
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


@pytest.mark.parametrize("name", ["linear", "matmul", "conv2d", "layer norm", "group norm",
                                  "dot"])
def test_a_low_precision_activation_fed_to_a_disabled_block_gets_the_widest_dtype(
        kit, device, name):
    """Issue 38, 1: ``h = l1(x)`` in an enabled block, then ``l2(h)`` in a nested
    ``amp.autocast(enabled=False)``: the float16 activation meets float32 weights.
    torch alone raises ("mat1 and mat2 must have the same dtype"), MegEngine promotes;
    with the contract both promote mixed inputs to the widest dtype, float32, and the
    values are float32's on the float16 activation."""
    r = row(name)
    call = call_of(r, kit.name)
    inp = {k: round_through(v, "float16") for k, v in inputs().items()}
    reference = kit.numpy(kit.run_call(call, device, "float16", "float32", inp))
    with amp.autocast(dtype="float16", device=device):
        with amp.autocast(enabled=False):
            out = kit.run_call(call, device, "float16", "mixed" if r.rule == "promote"
                               else "low", inp)
    assert kit.dtype_name(out) == "float32"
    np.testing.assert_allclose(kit.numpy(out), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [r.name for r in ROWS if r.rule == "input"
                                  and call_of(r, "torch") and call_of(r, "megengine")
                                  and not r.adapt.float32_compute and r.sample.cuda_low])
def test_an_input_row_in_a_disabled_block_keeps_a_low_precision_input(kit, device, name):
    """In a disabled block nested in an enabled one, an op with one low-precision input
    gives that dtype on both backends, as the "input" rows do under the contract
    (MegEngine's mean is float32 even without autocast; torch's is float16: a loss
    computed there parted, as the cross-backend fuzz found). Rows with no low-precision
    kernel somewhere (``float32_compute``, ``cuda_low``) are left out: without autocast
    the frameworks' own kernels refuse such an input."""
    r = row(name)
    inp = {k: round_through(v, "float16") for k, v in inputs().items()}
    with amp.autocast(dtype="float16", device=device):
        with amp.autocast(enabled=False):
            out = kit.run_call(call_of(r, kit.name), device, "float16", "low", inp)
    assert kit.dtype_name(out) == "float16"


def test_a_disabled_block_without_the_contract_is_the_frameworks_own(kit, device):
    """contract=False keeps the framework's behaviour in the disabled block: torch
    refuses the mixed matmul, MegEngine promotes it."""
    inp = inputs()
    with amp.autocast(dtype="float16", device=device, contract=False):
        with amp.autocast(enabled=False, contract=False):
            if kit.name == "torch":
                with pytest.raises(RuntimeError, match="dtype"):
                    kit.run_call(row("linear").sample.torch, device, "float16", "low", inp)
            else:
                out = kit.run_call(row("linear").sample.megengine, device, "float16", "low",
                                   inp)
                assert kit.dtype_name(out) == "float32"


# -- what each framework's own autocast gives: the natives the adapters act on -----------

_NATIVES = textwrap.dedent("""
    import json, sys
    import unified_amp as amp
    from tests.contract.dtype_table import ROWS, call_of, inputs, label
    from tests.kits import load_kit

    kit = load_kit(amp.get_backend().name)
    names = json.loads(sys.argv[1])
    inp = inputs()

    def native(low):
        if kit.name == "torch":
            import torch
            return torch.autocast("cpu", dtype=getattr(torch, low))
        import megengine.amp
        return megengine.amp.autocast(True, low_prec_dtype=low)

    def outcome(call, kind, low):
        try:
            with native(low):
                out = kit.run_call(call, "cpu", low, kind, inp)
            kit.numpy(out)
            kit.synchronize()  # an asynchronous failure is this call's
            return kit.dtype_name(out)
        except Exception:
            return "error"

    found = {}
    with kit.on_device("cpu"):
        # unified blocks first: the mode has run and MegEngine's wrappers are installed,
        # and the framework's own autocast must still be its own
        with amp.autocast(dtype="float16", device="cpu"):
            with amp.autocast(enabled=False):
                pass
        for r in ROWS:
            call = call_of(r, kit.name)
            if r.name in names:
                lows = ("float16", "bfloat16") if kit.name == "torch" else ("float16",)
                outs = {low: {kind: outcome(call, kind, low) for kind in r.kinds()}
                        for low in lows}
                found[r.name] = label(r, outs, call)
    print("NATIVES " + json.dumps(found))
""")


def _natives(kit, names):
    """Each named row's label under the framework's own autocast, measured in a fresh
    interpreter on the CPU (MegEngine's own autocast can end the process)."""
    env = dict(os.environ, UNIFIED_AMP_BACKEND=kit.name, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _NATIVES, json.dumps(names)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("NATIVES ")]
    return proc, json.loads(lines[-1][len("NATIVES "):]) if lines else None


def _trusted_rows(kit):
    """The rows whose native the adapter takes from the table here: on torch, those
    whose ops this torch registers as the table's torch did (the others the adapter
    handles whatever torch does); MegEngine: every row, on the table's version."""
    if kit.name == "megengine":
        import megengine

        assert megengine.__version__ == dtype_contract.TABLE_MEGENGINE, (
            f"the table's MegEngine natives were measured on {dtype_contract.TABLE_MEGENGINE};"
            f" measure them on {megengine.__version__} (this test prints them)")
        return [r for r in ROWS if r.sample.megengine and not r.native("megengine").startswith(
            "crashes")]
    from unified_amp.backends.torch_backend import dtype_contract as adapter

    return [r for r in ROWS if call_of(r, "torch") and not adapter.drifted(r, "cpu")]


def test_the_tables_natives_are_what_each_framework_gives_by_itself(kit):
    """What the adapters act on is measured: each row's label under the framework's own
    autocast (torch.autocast("cpu"), megengine.amp.autocast), after unified blocks ran
    in the same process, is the table's. On a torch other than the table's, a row whose
    own behaviour changed must be one the adapter keeps by itself (test_output_dtype
    checks that it does)."""
    rows = _trusted_rows(kit)
    proc, found = _natives(kit, [r.name for r in rows])
    assert found is not None, proc.stderr[-3000:]
    framework = "torch-cpu" if kit.name == "torch" else "megengine"
    # A row whose native depends on the CPU may give what oneDNN's AVX2 path gives.
    elsewhere = natives.TORCH_CPU_AVX2 if kit.name == "torch" else {}
    wrong = {r.name: found[r.name] for r in rows if found[r.name] != r.native(framework)
             and found[r.name] != elsewhere.get(r.name)}
    if kit.name == "torch" and _torch_version() != dtype_contract.TABLE_TORCH:
        from unified_amp.backends.torch_backend import dtype_contract as adapter

        wrong = {name: got for name, got in wrong.items() if got != row(name).rule
                 and "cpu" not in adapter.handled_devices(row(name))}
    assert not wrong, f"measured natives that differ from the table: {wrong}"


def test_a_native_that_depends_on_the_cpu_is_one_the_adapter_does_not_act_on():
    """The adapter computes such a row in float32 on the CPU in both low dtypes, so every
    CPU gives the same outcome, whatever oneDNN has there."""
    for name in natives.TORCH_CPU_AVX2:
        assert "torch-cpu" in row(name).adapt.float32_compute, name


def _torch_version():
    import torch

    return torch.__version__.split("+")[0]


def test_a_native_that_ends_the_process_does(kit):
    crashing = [r for r in ROWS if kit.name == "megengine"
                and r.native("megengine").startswith("crashes")]
    for r in crashing:
        proc, found = _natives(kit, [r.name])
        assert found is None and proc.returncode != 0, (r.name, proc.returncode)


# -- the table itself ------------------------------------------------------------------

def test_each_spelling_belongs_to_rows_of_one_rule():
    """A Python function the adapters wrap keeps one rule, unless the table says which
    calls are which row (``megengine_when``)."""
    for framework in ("torch", "megengine"):
        seen: dict[str, set] = {}
        for r in ROWS:
            for spelling in getattr(r, framework):
                seen.setdefault(spelling, set()).add(
                    (r.rule, r.adapt.megengine_when if framework == "megengine" else ""))
        mixed = {s: rules for s, rules in seen.items()
                 if len({rule for rule, when in rules if not when}) > 1}
        assert not mixed, (framework, mixed)


def test_every_sample_call_names_known_tensors_and_a_data_input():
    from unified_amp.dtype_contract import RULES, SAMPLES

    for r in ROWS:
        assert r.rule in RULES, r.name
        for call in (r.sample.torch, r.sample.megengine):
            if call is not None:
                assert any(SAMPLES[n][1] == "data" for n in names(call)), (r.name, call)


def test_docs_table_is_generated_from_the_data():
    """docs/DTYPE_CONTRACT.md's table is what tools/dtype_contract_page.py writes."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import dtype_contract_page
    finally:
        sys.path.pop(0)
    assert dtype_contract_page.table_section() in DOC.read_text(), (
        "docs/DTYPE_CONTRACT.md is out of step with unified_amp/dtype_contract/:"
        " run python tools/dtype_contract_page.py")
