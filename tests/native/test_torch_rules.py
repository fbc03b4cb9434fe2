"""A block's own rules on torch: compiled (the rules are part of what a graph was traced
with: changing them recompiles, and a cached graph never serves other rules), custom
ops (``torch.library``), with and without ``torch.library.register_autocast``, and on
fake CUDA (every rule kind x sample row, and the mode a rule needs there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp
from unified_amp.backends.torch_backend import dtype_contract as adapter

from ..contract import rules_table
from ..contract.dtype_table import call_of, inputs, row
from ..fake_cuda import FakeCudaKit, fc  # noqa: F401 (fc is a fixture)

LOW = torch.bfloat16


def scaled(h):
    """A function of the program's own, which rules name."""
    return torch.exp(h) * 0.5


def forward(x, w):
    return F.softmax(scaled(torch.matmul(x, w)), -1)


RULE_SETS = {
    "none": None,
    "A": {"softmax": "low", "matmul": "float32"},
    "B": {"softmax": "float32", scaled: "low"},
    "C": {scaled: "float32", "exp": "low"},
}
ORDERINGS = [("A", "B", "A"), ("none", "A", "none"), ("B", "none", "C", "B"),
             ("C", "A", "B", "none")]


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)


def _eager(rules, x, w):
    with amp.autocast(dtype="bfloat16", rules=rules):
        return forward(x, w)


@pytest.mark.parametrize("ordering", ORDERINGS, ids="-".join)
def test_a_compiled_forward_in_a_block_with_rules_is_the_eager_one(ordering):
    """The block outside the compiled function: each call's result is the eager one
    under the same rules (dtype and bits, aot_eager), whatever ran before."""
    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    x, w = _data()
    for name in ordering:
        want = _eager(RULE_SETS[name], x, w)
        with amp.autocast(dtype="bfloat16", rules=RULE_SETS[name]):
            got = compiled(x, w)
        assert got.dtype == want.dtype, (ordering, name)
        assert torch.equal(got, want), (ordering, name)


CURRENT: dict = {}


def _block_inside(x, w):
    with amp.autocast(dtype="bfloat16", rules=CURRENT["rules"]):
        return forward(x, w)


@pytest.mark.parametrize("ordering", ORDERINGS, ids="-".join)
def test_a_block_with_rules_inside_a_compiled_function_recompiles_when_they_change(ordering):
    """The block made inside the compiled function from rules that change between
    calls: one graph per rule set, each call the eager result of its own rules."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_block_inside, backend=counter, fullgraph=True)
    x, w = _data()
    for name in ordering:
        _eager(RULE_SETS[name], x, w)  # an own function's wrapper is swapped in eagerly
    for name in ordering:
        CURRENT["rules"] = RULE_SETS[name]
        got = compiled(x, w)
        want = _eager(RULE_SETS[name], x, w)
        assert got.dtype == want.dtype and torch.equal(got, want), (ordering, name)
    assert counter.frame_count == len(set(ordering)), (ordering, counter.frame_count)


def test_inductor_keeps_each_rule_sets_dtypes():
    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="inductor", fullgraph=True)
    x, w = _data()
    for name in ("A", "B", "A", "none"):
        want = _eager(RULE_SETS[name], x, w)
        with amp.autocast(dtype="bfloat16", rules=RULE_SETS[name]):
            got = compiled(x, w)
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def own_only_seen_compiled(h):
    return h * 3


def test_an_own_function_first_named_inside_compile_is_refused_naming_the_fix():
    """Where dynamo traces the block's entry (torch >= 2.9) it cannot swap the wrapper in,
    and says so; where the entry runs eagerly (2.7-2.8, autocast.py's
    SKIPS_RECURSIVELY) the wrapper is swapped in there, and the rule holds."""
    torch._dynamo.reset()

    def fn(x):
        with amp.autocast(dtype="bfloat16", rules={own_only_seen_compiled: "low"}):
            return own_only_seen_compiled(x)

    from unified_amp.backends.torch_backend.autocast import SKIPS_RECURSIVELY

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=SKIPS_RECURSIVELY)
    if SKIPS_RECURSIVELY:
        with pytest.raises(Exception, match="for the first time inside torch.compile"):
            compiled(torch.ones(2))
    else:
        assert compiled(torch.ones(2)).dtype == LOW
    # a block object made outside (its rules resolved then) is entered inside
    block = amp.autocast(dtype="bfloat16", rules={own_only_seen_compiled: "low"})

    def inside(x):
        with block:
            return own_only_seen_compiled(x)

    torch._dynamo.reset()
    out = torch.compile(inside, backend="aot_eager", fullgraph=True)(torch.ones(2))
    assert out.dtype == LOW


# -- custom ops ---------------------------------------------------------------------------

def _doubling_op(name):
    """A ``torch.library`` custom op ``unified_amp_test::name`` that doubles its input."""

    @torch.library.custom_op(f"unified_amp_test::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op.register_fake(lambda x: torch.empty_like(x))
    return op


twice = _doubling_op("twice")
twice_cast = _doubling_op("twice_cast")


# (On torch's AutocastCPU key for the rest of the process: test_torch_fake_cuda_dtypes.py
# holds torch's own, aten's, registrations to the table.)
torch.library.register_autocast("unified_amp_test::twice_cast", "cpu", torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
def test_a_custom_op_with_no_rule_follows_its_input(dtype):
    x = torch.ones(3, dtype=dtype)
    with amp.autocast(dtype="bfloat16"):
        assert twice(x).dtype == dtype
    with torch.autocast("cpu", dtype=LOW):
        assert twice(x).dtype == dtype  # torch's own: the same


def test_register_autocast_keeps_torchs_behaviour_and_a_rule_wins_under_the_contract():
    x = torch.ones(3)
    with torch.autocast("cpu", dtype=LOW):
        native = twice_cast(x).dtype
    assert native == torch.float16  # what torch.library.register_autocast asked for
    with amp.autocast(dtype="bfloat16", contract=False):
        assert twice_cast(x).dtype == native
    with amp.autocast(dtype="bfloat16"):  # the contract, no rule: the registration's
        assert twice_cast(x).dtype == native
    for key in (twice_cast, torch.ops.unified_amp_test.twice_cast,
                torch.ops.unified_amp_test.twice_cast.default):
        with amp.autocast(dtype="bfloat16", rules={key: "float32"}):
            assert twice_cast(x).dtype == torch.float32, key  # the rule wins
        with amp.autocast(dtype="bfloat16", rules={key: "low"}):
            assert twice_cast(x).dtype == LOW, key


def test_a_rule_on_a_custom_op_compiled_is_the_eager_one():
    x = torch.ones(3)

    def fn(x):
        return twice(x) + 1

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for rules in ({twice: "low"}, None, {twice: "float32"}, {twice: "low"}):
        with amp.autocast(dtype="bfloat16", rules=rules):
            want = fn(x)
            got = compiled(x)
        assert got.dtype == want.dtype and torch.equal(got, want), rules


# -- fake CUDA ----------------------------------------------------------------------------

FAKE_ROWS = [n for n in rules_table.SAMPLE_ROWS if not row(n).sample.fake_cuda]


@pytest.mark.fake_cuda
@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", FAKE_ROWS)
@pytest.mark.parametrize("kind", rules_table.KINDS)
def test_a_rule_gives_its_dtype_on_fake_cuda(fc, kind, name, low):
    call = call_of(row(name), "torch")
    for input_kind in rules_table.input_kinds(name):
        want = rules_table.expected(kind, call, input_kind, low)
        block = amp.autocast(dtype=low, device="cuda", rules={name: kind})
        if want is None:
            with pytest.raises(RuntimeError, match="refused inside this block"):
                with block:
                    FakeCudaKit(fc).run_call(call, "cuda", low, input_kind, inputs())
            continue
        with block:
            out = FakeCudaKit(fc).run_call(call, "cuda", low, input_kind, inputs())
        assert out.device.type == "cuda"
        assert str(out.dtype).removeprefix("torch.") == want, (name, kind, input_kind)


@pytest.mark.fake_cuda
def test_a_cuda_block_pushes_a_mode_only_when_it_has_rules(fc):
    """Without rules a CUDA block leaves torch's mode stack alone (torch's kernels keep
    the contract: zero calls per op, tests/native/test_torch_fake_cuda_dtypes.py); with
    rules it pushes their mode, nested blocks without rules keep it."""
    # an older torch whose CUDA registrations differ from the table's: the contract's
    # mode for those rows (test_torch_fake_cuda_dtypes.py)
    without = adapter.CONTRACT if "cuda" in adapter.MODE_DEVICES else None
    with amp.autocast(device="cuda"):
        assert adapter.top_mode() is without
    with amp.autocast(device="cuda", rules={"softmax": "low"}):
        top = adapter.top_mode()
        assert isinstance(top, adapter.RulesMode)
        with amp.autocast(device="cuda"):
            assert adapter.top_mode() is top
    assert adapter.top_mode() is None
