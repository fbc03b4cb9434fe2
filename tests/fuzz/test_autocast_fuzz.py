"""Random op programs under amp.autocast, side by side with the native autocast
(torch.autocast on torch, megengine.amp.autocast on MegEngine), run eagerly.

- ``contract=False``: the loss, the last activation and every gradient are the native
  autocast's, byte for byte.
- the contract on (``amp.autocast()``'s default): every op's output dtype is the one
  docs/DTYPE_CONTRACT.md gives (tests/contract/dtype_table.py), inside the block, in
  nested ``enabled=False`` / re-enabled blocks and outside.
- the contract on, with rules (``amp.autocast(rules={op: kind})``) drawn for the blocks
  (autocast_programs.draw_rules): every op a rule in force names has the rule's dtype
  (unified_amp/rules.py, MEANING), the others the table's; a program calling an op a
  "refuse" rule names raises RuntimeError.

Programs come from (seed, index) alone (autocast_programs); `make test` runs the fast
tier, `make fuzz PROGRAMS=N SEED=S` a long one. torch.compile's side is in
test_autocast_fuzz_compiled.py.
"""

import os

import pytest

import unified_amp as amp

from ..contract import rules_table
from . import autocast_ops as ops
from . import autocast_programs as programs

# pytest-timeout's 300 s (pyproject.toml) is for make test's fast tier; a long run's
# eager programs take about a second each on MegEngine's CPU build.
LONG_RUN = int(os.environ.get("UNIFIED_AMP_FUZZ_PROGRAMS") or 0)
pytestmark = pytest.mark.timeout(300 + 3 * LONG_RUN)

FAST = {"torch": 16, "megengine": 8}
# MegEngine's CPU build computes no bfloat16 (docs/DTYPE_CONTRACT.md): float16 there.
LOWS = {"torch": ("bfloat16", "float16"), "megengine": ("float16",)}
# MegEngine 1.13's own autocast casts batch norm's float32 input to float16, and on CPU
# programs holding it (with convs, pools, a second batch norm) then failed in backward
# (RuntimeError "assertion `t.layout.dtype == out_dt'", AsyncError) and once ended the
# process with "corrupted size vs. prev_size": 4 of the first 40 programs (seed 0),
# megengine.amp alone. It is left out of MegEngine's programs; the contract's batch
# norm row is tests/contract's. So is max pooling: MegEngine 1.13's float16 max_pool2d
# on CPU gives wrong values (docs/DTYPE_CONTRACT.md) that also change from run to run
# (a long run, seed 1 index 13: the same contract=False program twice gave two
# gradients), so no byte comparison can hold; the contract's pooling fix is tested there.
# MegEngine's own autocast also ends the process on local_response_norm (the table's
# native for it), and its square of a float16 input returns a float32 gradient, which a
# matmul's backward later asserts on (a long run, seed 1 index 4): contract=False
# programs cannot hold them (the contract's rows are tests/contract's).
LEAVE_OUT = {"torch": (), "megengine": ("batch norm", "max pool", "adaptive max pool",
                                        "local response norm", "square")}

# Rows whose low-precision kernels the framework lacks on CPU, which a block's rule of a
# low dtype ("low"; "input" or "promote" on a low input) runs them in: the rules fuzz
# gives them "float32" (or "refuse") only. torch 2.13 CPU: NotImplementedError for
# Half and BFloat16 (cdist, avg_pool3d, the margin losses). MegEngine 1.13 CPU: float16
# backward asserts ("t.layout.dtype == out_dt"; log1p, reciprocal, sqrt, the norms:
# plain MegEngine too, F.sqrt of a float16 tensor and gm.backward), an AsyncError
# (pow). The contract computes these in float32 on MegEngine (their rows' float32
# rule); a rule asks for the low dtype, and the framework's own error says it has none
# (found by the rules fuzz, seed 0 index 36 on MegEngine: {'sqrt': 'promote'} on a
# float16 input). (local conv2d's float16 kernel ends the process: a rule's low dtype
# is computed in float32 there, the adapter's _LOW_ENDS_THE_PROCESS, and drawn.)
NO_LOW = {"torch": ("distance", "average pool 3-d", "local response norm", "multi-margin loss",
                    "multilabel margin loss"),
          "megengine": ("log1p", "pow", "reciprocal", "sqrt", "vector norm",
                        "normalize", "square", "batch norm", "local response norm")}

def program(fuzz, name, i):
    return programs.make(fuzz.seed, i, ops=ops.op_names(name), lows=LOWS[name],
                         leave_out=LEAVE_OUT[name])


@pytest.fixture(scope="module")
def name():
    return amp.get_backend().name


@pytest.fixture(scope="module")
def side(name):
    return ops.side_for(name)


def report(p, what, got, want):
    return (f"autocast fuzz program {p.name} (rebuild: test_autocast_fuzz.program(fuzz,"
            f" backend, {p.index}) with UNIFIED_AMP_FUZZ_SEED={p.seed}): {what}\n{programs.source(p, 'unified')}\n"
            f"unified: {got}\nnative:  {want}")


def first_difference(a, b):
    for key in ("loss", "h"):
        if a[key] != b[key]:
            return key, a[key][:2], b[key][:2]
    if a["grads"].keys() != b["grads"].keys():
        return "grads present", sorted(a["grads"]), sorted(b["grads"])
    for k in a["grads"]:
        if a["grads"][k] != b["grads"][k]:
            return f"grad of {k}", a["grads"][k][:2], b["grads"][k][:2]
    return None


def outcome(side, p, which, contract=False):
    """What running one side gives: its results, or the error it raised (the type and
    the first line: both sides must raise alike where one does)."""
    try:
        return side.run(side.function(p, which, contract), p)
    except Exception as exc:  # a native refusal is a finding only if ours differs
        return {"raised": type(exc).__name__}


def test_contract_off_is_the_native_autocast_byte_for_byte(fuzz, name, side):
    count = refused = 0
    for i in fuzz.programs(FAST[name]):
        p = program(fuzz, name, i)
        native = outcome(side, p, "native")
        unified = outcome(side, p, "unified")
        if "raised" in native or "raised" in unified:
            # where the native autocast refuses a program, ours must refuse it alike
            assert unified == native, report(p, "one side raised", unified, native)
            refused += 1
            continue
        diff = first_difference(unified, native)
        assert diff is None, report(p, f"{diff[0]} differs", diff[1], diff[2])
        assert [o[3] for o in unified["ops"]] == [o[3] for o in native["ops"]]
        assert not amp.is_autocast_enabled()
        count += 1
    # most programs run on both sides (a native failure is rare: MegEngine's float16
    # backward asserts on some op chains, with and without unified_amp)
    assert refused <= max(1, (count + refused) // 4), (count, refused)


def contract_violations(p, ran, framework="torch"):
    """Each recorded op whose output dtype is not the one the table gives it, or, where
    a rule of the program's blocks is in force for it, the one the rule gives."""
    bad = []
    forces = programs.rules_in_force(p)
    assert len(forces) == len(ran["ops"]), (len(forces), len(ran["ops"]))
    for (op, kind, on, dtype, took), force in zip(ran["ops"], forces):
        rule = force.get(op)
        if rule is not None:
            assert on, (op, force)
            want = rules_table.to_dtype(rule, took, p.low)
            says = f"its rule {rule!r} (floating inputs {took}) says"
        else:
            want = ops.expected_for(op, kind, p.low, framework) if on else (
                "float32" if kind == "float32" else p.low)
            says = "the contract says"
        if dtype != want:
            bad.append(f"{op} ({kind} input, autocast {'on' if on else 'off'})"
                       f" gave {dtype}, {says} {want}")
    return bad


def run_with_rules(side, p, compile_with=None):
    """A contract-on program with rules: what it ran, or None where a "refuse" rule in
    force refused one of its ops, as it must (checked here)."""
    fn = side.function(p, "unified", True)
    if programs.refused(p):
        with pytest.raises(RuntimeError, match="refused inside this block by its rules"):
            side.run(fn, p, compile_with=compile_with)
        return None
    return side.run(fn, p, compile_with=compile_with)


def test_the_contract_gives_every_op_its_table_dtype(fuzz, name, side):
    for i in fuzz.programs(FAST[name]):
        p = program(fuzz, name, i)
        ran = side.run(side.function(p, "unified", True), p)
        bad = contract_violations(p, ran, name)
        assert not bad, report(p, "; ".join(bad), "", "")
        assert not amp.is_autocast_enabled()


def rules_program(fuzz, name, side, i):
    """Program i with rules drawn for its blocks (the same ops as ``program``'s)."""
    p = program(fuzz, name, i)
    return programs.draw_rules(p, ops.rule_keys(side, p.low), no_low=NO_LOW[name])


def rule_note(p):
    return f"rules: outer {p.rules}, in force per recorded call {programs.rules_in_force(p)}"


def test_a_block_s_rules_give_their_ops_the_rule_s_dtype(fuzz, name, side):
    ruled = refusals = 0
    for i in fuzz.programs(FAST[name]):
        p = rules_program(fuzz, name, side, i)
        ran = run_with_rules(side, p)
        assert not amp.is_autocast_enabled()
        if ran is None:
            refusals += 1
            continue
        bad = contract_violations(p, ran, name)
        assert not bad, report(p, "; ".join(bad) + "\n" + rule_note(p), "", "")
        ruled += len(programs.ruled_calls(p))
    # the rules are in force for some calls, not drawn and left unused
    assert ruled > 0 and refusals < len(fuzz.programs(FAST[name])) or not fuzz.programs(FAST[name]), (
        ruled, refusals)

