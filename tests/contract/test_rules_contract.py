"""A block's own rules (``amp.autocast(rules={op: kind})``), on each backend and device:
generated over rule kind x sample op x key form (row, framework function, a function
of the program's own) x low dtype x input kind, each cell's dtype and values checked;
nesting, threads and the errors. torch's CUDA cells run on fake CUDA in every CI run
(tests/native/test_torch_fake_cuda_rules.py), compiled ones in
tests/native/test_torch_compiled_rules.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import unified_amp as amp

from . import rules_table
from .dtype_table import call_of, dtypes, inputs, row
from .dtype_table import expected as table_expected
from .rules_table import KEY_FORMS, KINDS, SAMPLE_ROWS

LOWS = ["float16", "bfloat16"]
UNSUPPORTED = {("megengine", "cpu", "bfloat16")}  # as in test_dtype_table.py


def _in(kit, t, device, to):
    """``t`` in ``to``, through its values (what a rule's cast hands the op)."""
    if kit.dtype_name(t) == to:
        return t
    return kit.tensor(kit.numpy(t).astype(np.float32), device, to)


def _reference(kit, call, device, low, kind, inp, to):
    """The op outside autocast on the call's tensors as ``kit.run_call`` makes them,
    each floating one then in ``to``, and its output in ``to``."""
    scope = dict(kit.call_scope())
    for name, dtype in dtypes(call, kind, low).items():
        scope[name] = kit.labels(inp[name], device) if dtype == "int" else \
            _in(kit, kit.tensor(inp[name], device, dtype), device, to)
    return _in(kit, eval(call, scope), device, to)  # noqa: S307 -- the table's own calls


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("form", KEY_FORMS)
@pytest.mark.parametrize("name", SAMPLE_ROWS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_rule_gives_its_dtype_and_the_ops_own_values(kit, device, kind, name, form, low):
    """Inside ``amp.autocast(dtype=low, rules={op: kind})`` the op returns the rule's
    dtype for every input kind, with the values of the op computed outside autocast
    on its inputs in that dtype, bit for bit; "refuse" raises, naming the fix."""
    if (kit.name, device, low) in UNSUPPORTED:
        pytest.skip("MegEngine's CPU build computes no bfloat16 (docs/DTYPE_CONTRACT.md)")
    call = call_of(row(name), kit.name)
    key = rules_table.key_for(form, name, kit.name)
    block = amp.autocast(dtype=low, device=device, rules={key: kind})
    ran = rules_table.through_own(call) if form == "own" else call
    inp = inputs()
    for input_kind in rules_table.input_kinds(name):
        want = rules_table.expected(kind, call, input_kind, low)
        own = {"own": rules_table.own}  # the wrapper, once the block named it
        if want is None:
            with pytest.raises(RuntimeError, match="refused inside this block by its rules"):
                with block:
                    kit.run_call(ran, device, low, input_kind, inp, names=own)
            continue
        with block:
            out = kit.run_call(ran, device, low, input_kind, inp, names=own)
        got = kit.dtype_name(out)
        assert got == want, (name, form, kind, input_kind, got, want)
        reference = _reference(kit, call, device, low, input_kind, inp, want)
        np.testing.assert_array_equal(kit.numpy(out), kit.numpy(reference),
                                      err_msg=f"{name} {form} {kind} {input_kind}")


def _dtype_of(kit, name, device, low, kind="float32"):
    out = kit.run_call(call_of(row(name), kit.name), device, low, kind, inputs())
    return kit.dtype_name(out)


def test_nested_blocks_merge_their_rules_and_the_inner_wins(kit, device):
    low = "float16"
    if (kit.name, device, low) in UNSUPPORTED:
        pytest.skip("no float16 here")
    with amp.autocast(dtype=low, device=device, rules={"softmax": "low", "exp": "low"}):
        assert _dtype_of(kit, "softmax", device, low) == low
        with amp.autocast(dtype=low, device=device, rules={"softmax": "float32",
                                                           "matmul": "float32"}):
            assert _dtype_of(kit, "softmax", device, low) == "float32"  # the inner's
            assert _dtype_of(kit, "exp", device, low) == low  # the outer's, merged
            assert _dtype_of(kit, "matmul", device, low) == "float32"
        assert _dtype_of(kit, "softmax", device, low) == low  # the outer's again
        assert _dtype_of(kit, "matmul", device, low) == low  # the row's again
        with amp.autocast(dtype=low, device=device):  # no rules: the outer's stay
            assert _dtype_of(kit, "exp", device, low) == low
        with amp.autocast(enabled=False):  # autocast off: no rule, the op as it is
            assert _dtype_of(kit, "exp", device, low, "low") == low
            assert _dtype_of(kit, "exp", device, low) == "float32"
        with amp.autocast(dtype=low, device=device, contract=False):  # the framework's own
            assert _dtype_of(kit, "matmul", device, low) == low
    with amp.autocast(dtype=low, device=device):
        assert _dtype_of(kit, "softmax", device, low) == "float32"  # nothing left behind


def test_the_decorator_carries_its_rules(kit, device):
    low = "float16"
    if (kit.name, device, low) in UNSUPPORTED:
        pytest.skip("no float16 here")

    @amp.autocast(dtype=low, device=device, rules={"softmax": "low"})
    def forward():
        return _dtype_of(kit, "softmax", device, low)

    assert forward() == low
    assert "rules={'softmax': 'low'}" in repr(amp.autocast(rules={"softmax": "low"}))


def test_two_threads_do_not_see_each_others_rules(kit, device):
    """While another thread holds a block with its rules open, this thread's blocks
    see only their own. (The other thread runs no op: MegEngine runs ops on the
    thread that imported it only.)"""
    low = "float16"
    if (kit.name, device, low) in UNSUPPORTED:
        pytest.skip("no float16 here")
    opened, done = threading.Event(), threading.Event()

    def hold():
        with amp.autocast(dtype=low, device=device, rules={"softmax": "low", "exp": "low"}):
            opened.set()
            done.wait(60)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert opened.wait(60)
        with amp.autocast(dtype=low, device=device, rules={"softmax": "float32"}):
            assert _dtype_of(kit, "softmax", device, low, "low") == "float32"
            assert _dtype_of(kit, "exp", device, low, "low") == "float32"  # the row's
        with amp.autocast(dtype=low, device=device, rules={"exp": "input"}):
            assert _dtype_of(kit, "softmax", device, low, "low") == "float32"
            assert _dtype_of(kit, "exp", device, low, "low") == low
    finally:
        done.set()
        other.join()


def test_a_bad_rule_is_refused_naming_what_is_accepted(kit):
    with pytest.raises(ValueError, match=r"'sofmax' names no row.*Did you mean 'softmax'"):
        amp.autocast(rules={"sofmax": "low"})
    with pytest.raises(ValueError, match=r"must be one of 'low', 'float32', 'promote',"
                                         r" 'input', 'refuse'; got 'half'"):
        amp.autocast(rules={"softmax": "half"})
    with pytest.raises(TypeError, match=r"is no op a rule can name"):
        amp.autocast(rules={42: "low"})
    with pytest.raises(TypeError, match=r"math.exp .* is no op a rule can name"):
        import math

        amp.autocast(rules={math.exp: "low"})
    with pytest.raises(TypeError, match=r"must be a dict of op -> rule kind"):
        amp.autocast(rules=["softmax"])
    with pytest.raises(ValueError, match=r"contract=False.*no rule changes"):
        amp.autocast(rules={"softmax": "low"}, contract=False)
    other = "megengine" if kit.name == "torch" else "torch"
    stand_in = type("F", (), {"__module__": f"{other}.functional"})
    foreign = type(other, (), {"__call__": lambda self: None, "__module__": other})()
    del stand_in
    with pytest.raises(ValueError, match=rf"is not a {kit.name} function"):
        amp.autocast(rules={foreign: "low"})


@pytest.mark.parametrize("inner, outer", [("vector norm", "normalize"), ("abs", "L1 loss"),
                                          ("divide", "normalize")])
def test_a_rule_reaches_the_calls_the_program_makes_not_those_inside_another_op(
        kit, device, inner, outer):
    """``F.normalize`` calls a norm inside, on both frameworks: a rule refusing the norm
    refuses the program's own norm, not normalize's (on torch, the function mode runs a
    torch function's body with itself off; MegEngine's wrappers keep rules off there
    too)."""
    low = "float16"
    if (kit.name, device, low) in UNSUPPORTED:
        pytest.skip("no float16 here")
    with amp.autocast(dtype=low, device=device, rules={inner: "refuse"}):
        want = table_expected(row(outer), "low", low, call_of(row(outer), kit.name))
        assert _dtype_of(kit, outer, device, low, "low") == want
        if call_of(row(inner), kit.name):
            with pytest.raises(RuntimeError, match="refused inside this block"):
                _dtype_of(kit, inner, device, low, "low")
