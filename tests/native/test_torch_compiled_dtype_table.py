"""The dtype contract under ``torch.compile``: the rows whose ops the contract's mode
keeps on the CPU, compiled, give the contract's dtypes.

dynamo inlines a Python function such as ``F.pad`` or ``F.interpolate`` and meets the
mode at the builtin it calls (``torch._C._nn.pad``), where eager code meets it at the
Python function: the table lists both spellings, and this checks that every row the
mode keeps holds compiled as it does eagerly (docs/DTYPE_CONTRACT.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp
from unified_amp.dtype_contract import pairing
from unified_amp.backends.torch_backend import dtype_contract as adapter

from ..contract.dtype_table import ROWS, call_of, dtypes, expected, inputs, names, row, spelling_calls

pytestmark = pytest.mark.timeout(900)
LOW = "bfloat16"


def kept(kind):
    """The rows the mode keeps on the CPU (nothing of ours runs for the others), with a
    torch call; not the refusal, nor an FFT of a bfloat16 input: both raise, eagerly
    and compiled alike (tests/contract)."""
    return [r for r in ROWS if call_of(r, "torch") and "cpu" in adapter.handled_devices(r)
            and r.rule != "refuse"
            and not ((r.sample.no_bfloat16 or r.refuse_low) and kind != "float32")
            and r.name not in UNTRACEABLE]


# Rows dynamo cannot put in one graph whatever the mode does: CTC loss's output shape
# depends on its inputs' values ("Dynamic shape operator").
UNTRACEABLE = {"CTC loss"}
# ... on some torches: torch 2.7's quantile checks its input with aten.equal, whose
# bool output depends on the values ("Data dependent operator"), without any autocast.
# Left out where plain torch cannot compile the row's call whole.
UNTRACEABLE_ON_SOME_TORCH = {"quantile"}


def torch_alone_compiles(r):
    inp = inputs()
    args = [torch.from_numpy(inp[n]) for n in dtypes(r.sample.torch, "float32", LOW)]
    fn = eval(f"lambda {', '.join(names(r.sample.torch))}: {r.sample.torch}",  # noqa: S307
              {"torch": torch, "F": F})
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager", fullgraph=True)(*args)
        return True
    except torch._dynamo.exc.Unsupported:
        return False
    finally:
        torch._dynamo.reset()


@pytest.fixture(scope="module", autouse=True)
def untraceable_here():
    left_out = {r.name for r in ROWS if r.name in UNTRACEABLE_ON_SOME_TORCH
                and not torch_alone_compiles(r)}
    UNTRACEABLE.update(left_out)
    yield
    UNTRACEABLE.difference_update(left_out)


@pytest.mark.parametrize("kind", ["float32", "low"])
def test_the_rows_the_mode_keeps_hold_compiled(kind):
    rows, inp = kept(kind), inputs()
    # each row's call as a function of its sample tensors (dynamo traces into it)
    calls = [(eval(f"lambda {', '.join(names(r.sample.torch))}: {r.sample.torch}",  # noqa: S307
                   {"torch": torch, "F": F}),
              [torch.from_numpy(inp[n]) if dtype == "int"
               else torch.from_numpy(inp[n]).to(getattr(torch, dtype))
               for n, dtype in dtypes(r.sample.torch, kind, LOW).items()]) for r in rows]

    def block():
        with amp.autocast(dtype=LOW, device="cpu"):
            return [fn(*args) for fn, args in calls]

    torch._dynamo.reset()
    try:
        got = torch.compile(block, backend="aot_eager", fullgraph=True)()
    finally:
        torch._dynamo.reset()
    wrong = {r.name: (str(out.dtype), expected(r, kind, LOW, r.sample.torch))
             for r, out in zip(rows, got)
             if str(out.dtype).removeprefix("torch.") != expected(r, kind, LOW, r.sample.torch)}
    # the rows whose note says compiled code keeps torch's own rule (Adapt.compiled)
    assert len(rows) > 50 and set(wrong) == {r.name for r in rows if r.adapt.compiled
                                             and kind == "low"}, wrong


@pytest.mark.parametrize("kind", ["float32", "low"])
def test_every_spelling_of_the_rows_the_mode_keeps_holds_compiled(kind):
    """Not only each row's first spelling: every spelling of the rows the mode keeps
    (pairing.call_for), compiled, gives the contract's dtype, but where the row's note
    says compiled code keeps torch's own rule (``Adapt.compiled``). Graph breaks are
    allowed here: the internal bindings some spellings name (``torch._VF.chain_matmul``)
    are builtins dynamo does not trace, and run eagerly between graphs."""
    inp = inputs()
    cases = [(r, s, call) for r in kept(kind) for s, call in spelling_calls(r, "torch")
             if not (kind == "low" and "raises" in pairing.COMPILED_OWN.get(s, ""))]
    calls = [(eval(f"lambda {', '.join(names(call))}: {call}",  # noqa: S307
                   {"torch": torch, "F": F}),
              [torch.from_numpy(inp[n]) if dtype == "int"
               else torch.from_numpy(inp[n]).to(getattr(torch, dtype))
               for n, dtype in dtypes(call, kind, LOW).items()]) for _, _, call in cases]

    def block():
        with amp.autocast(dtype=LOW, device="cpu"):
            return [fn(*args) for fn, args in calls]

    torch._dynamo.reset()
    try:
        got = torch.compile(block, backend="aot_eager")()
    finally:
        torch._dynamo.reset()
    wrong = {(r.name, s): (str(out.dtype), expected(r, kind, LOW, call))
             for (r, s, call), out in zip(cases, got)
             if str(out.dtype).removeprefix("torch.") != expected(r, kind, LOW, call)}
    # compiled code keeps torch's own rule for these (pairing.COMPILED_OWN, Adapt.compiled)
    noted = {(r.name, s) for r, s, _ in cases if kind == "low" and (
        s in pairing.COMPILED_OWN or r.adapt.compiled and s == r.torch[0])}
    assert len(cases) > 150 and set(wrong) == noted, (set(wrong) ^ noted, wrong)
    if kind == "low":  # and those that raise compiled, raise
        for r in kept(kind):
            for s, call in spelling_calls(r, "torch"):
                if "raises" in pairing.COMPILED_OWN.get(s, ""):
                    fn = eval(f"lambda {', '.join(names(call))}: {call}",  # noqa: S307
                              {"torch": torch, "F": F})
                    args = [torch.from_numpy(inp[n]).to(getattr(torch, d))
                            for n, d in dtypes(call, kind, LOW).items()]

                    def one():
                        with amp.autocast(dtype=LOW, device="cpu"):
                            return fn(*args)  # noqa: B023

                    torch._dynamo.reset()
                    try:
                        # torch 2.13: NotImplementedError; 2.7: RuntimeError ("not
                        # implemented for 'BFloat16'")
                        with pytest.raises((NotImplementedError, RuntimeError),
                                           match="(?i)bfloat16"):
                            torch.compile(one, backend="aot_eager")()
                    finally:
                        torch._dynamo.reset()
