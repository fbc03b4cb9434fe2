"""The autocast fuzz under torch.compile: the same random programs as
test_autocast_fuzz.py, compiled, side by side with torch.autocast compiled.

Programs here also take the shapes that make dynamo split or abandon the frame around
the block (an explicit graph break before, inside or after it; a generator and a dict
comprehension before it, which make dynamo give up on the frame), and the outer block
may be an object made outside the compiled function.

- ``contract=False``, aot_eager (and inductor on a few programs): loss, activation and
  gradients byte-identical to torch.autocast's compiled program (where dynamo gives up
  on the unified frame, torch.autocast's frame runs eagerly too);
- the contract on, aot_eager: every op has docs/DTYPE_CONTRACT.md's dtype;
- the contract on with rules drawn for the blocks, aot_eager: every op the dtype of the
  rule in force (or the table's), the same as the same program run eagerly, and a
  "refuse" rule in force raises as it does eagerly;
- the library's first use inside a compiled program, in a fresh interpreter.

MegEngine has no torch.compile; its programs run eagerly in test_autocast_fuzz.py.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch.compile is torch's: MegEngine's side of the fuzz is eager"
                " (test_autocast_fuzz.py)", allow_module_level=True)

import torch  # noqa: E402

import unified_amp as amp  # noqa: E402

from ..contract.dtype_table import expected  # noqa: E402,F401
from . import autocast_ops as ops  # noqa: E402
from . import autocast_programs as programs  # noqa: E402
from .test_autocast_fuzz import (NO_LOW, contract_violations, first_difference,  # noqa: E402
                                 report, rule_note, run_with_rules)

ROOT = Path(__file__).resolve().parents[2]
# pytest-timeout's 300 s (pyproject.toml) is for make test's fast tier; a long run gets
# about 30 s per program on 2 cores (two compiles each, inductor's longer).
LONG_RUN = int(os.environ.get("UNIFIED_AMP_FUZZ_PROGRAMS") or 0)
pytestmark = pytest.mark.timeout(300 + 30 * LONG_RUN)


def compiled_program(fuzz, i, shapes=programs.SHAPES):
    """Program i of the compiled fuzz: its shape and whether its block is made outside
    take turns with the index, so that a handful of programs covers every shape."""
    p = programs.make(fuzz.seed, i)
    p.shape = shapes[i % len(shapes)]
    p.made_outside = (i // len(shapes)) % 2 == 1 if fuzz.long else i % 2 == 1
    return p


@pytest.fixture(scope="module")
def side():
    amp.get_backend()  # warm: the library has been used in this process
    return ops.TorchSide()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # a graph break inside a block makes dynamo give up on the frame: said once,
        # with amp.CompileWarning (docs/COMPILE.md); not what this fuzz looks at
        warnings.simplefilter("ignore", amp.CompileWarning)
        yield
    torch._dynamo.reset()


def run_compiled(side, p, which, contract, backend, frame_eager=False):
    """The program compiled; ``frame_eager``: its own frame run eagerly, the functions
    it calls compiled (what dynamo does with a frame it gives up on)."""
    fn = side.function(p, which, contract)
    if frame_eager:
        torch._dynamo.decorators.skip(fn)  # its code skipped, its callees compiled
    torch._dynamo.reset()
    return side.run(fn, p, compile_with=backend)


def run_unified_then_native(side, p, backend):
    """The contract=False program compiled on both sides. Where dynamo gave up on the
    unified frame holding the block (its CompileWarning: a graph break inside the block
    on torch < 2.12, or in a block made outside the function), torch.autocast's program
    runs the same way, its frame eager and its callees compiled: torch's compiled
    numerics depend on where the graphs are cut (on torch 2.7 AOTAutograd traces
    cumprod's backward under the forward's autocast, so the gradients differ by
    partition, in plain torch too: docs/VERSIONS.md), and the promise is torch.autocast's
    bytes for the frame dynamo runs (docs/COMPILE.md, "Graph breaks")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp.CompileWarning)
        unified = run_compiled(side, p, "unified", False, backend)
    gave_up = any(issubclass(w.category, amp.CompileWarning) for w in caught)
    return unified, run_compiled(side, p, "native", False, backend, frame_eager=gave_up)


def share(fuzz, fast, every):
    """``fast`` programs in make test's fast tier; in a long run of N programs per test,
    every ``every``-th of them (a compiled program costs seconds: two compiles each)."""
    return fuzz.programs(fast) if not fuzz.long else range(0, len(fuzz.programs(0)), every)


def _indices(fuzz, backend):
    # inductor: none in the fast tier (two inductor compiles, about half a minute on 2
    # busy cores); a tenth of a long run's programs
    return share(fuzz, 3, 2) if backend == "aot_eager" else share(fuzz, 0, 10)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_contract_off_compiled_is_torch_autocast_compiled_byte_for_byte(fuzz, side, backend):
    for i in _indices(fuzz, backend):
        p = compiled_program(fuzz, i)
        unified, native = run_unified_then_native(side, p, backend)
        diff = first_difference(unified, native)
        assert diff is None, report(p, f"{backend}, shape {p.shape}, block made"
                                       f" {'outside' if p.made_outside else 'inside'}:"
                                       f" {diff[0]} differs", diff[1], diff[2])
        assert not torch.is_autocast_enabled("cpu")
        assert torch._C._len_torch_function_stack() == 0


def test_the_contract_compiled_gives_every_op_its_table_dtype(fuzz, side):
    # three in the fast tier: the whole block, a break before it and one inside it
    for i in share(fuzz, 3, 4):
        p = compiled_program(fuzz, i)
        ran = run_compiled(side, p, "unified", True, "aot_eager")
        bad = contract_violations(p, ran)
        assert not bad, report(p, f"aot_eager, shape {p.shape}: " + "; ".join(bad), "", "")
        assert not torch.is_autocast_enabled("cpu")
        assert torch._C._len_torch_function_stack() == 0


def test_a_block_s_rules_compiled_give_the_rule_s_dtype_as_eagerly(fuzz, side):
    # two in the fast tier (the whole block; a break before it), every 4th of a long run
    for i in share(fuzz, 2, 4):
        p = compiled_program(fuzz, i)
        p = programs.draw_rules(p, ops.rule_keys(side, p.low), no_low=NO_LOW["torch"])
        eager = run_with_rules(side, p)
        ran = run_with_rules(side, p, compile_with="aot_eager")
        assert (ran is None) == (eager is None)
        if ran is not None:
            bad = contract_violations(p, ran)
            assert not bad, report(p, f"aot_eager, shape {p.shape}: " + "; ".join(bad)
                                   + "\n" + rule_note(p), "", "")
            assert ran["ops"] == eager["ops"], report(p, f"aot_eager, shape {p.shape}:"
                                                        " dtypes differ from eager",
                                                      ran["ops"], eager["ops"])
        assert not torch.is_autocast_enabled("cpu")
        assert torch._C._len_torch_function_stack() == 0


_FRESH = textwrap.dedent("""
    import json, sys, warnings
    import torch
    import unified_amp as amp
    from tests.fuzz import autocast_ops as ops, autocast_programs as programs
    from tests.fuzz.test_autocast_fuzz import contract_violations, first_difference

    seed, index = int(sys.argv[1]), int(sys.argv[2])
    warnings.simplefilter("ignore", amp.CompileWarning)
    side = ops.TorchSide()
    found = []
    # The first program is the library's first use, inside a compiled frame that dynamo
    # abandons (a generator and a dict comprehension before the block), with the
    # contract on (the contract off takes the same path): its block starts with a matmul,
    # so a block not in force shows in the dtypes.
    p = programs.make(seed, index)
    p.shape, p.made_outside, p.body = "abandon", False, ["matmul", *p.body]
    ran = side.run(side.function(p, "unified", True), p, compile_with="aot_eager")
    found.append([p.name, "first use, contract on", contract_violations(p, ran)])
    # Then the same program without the contract, against torch.autocast, both compiled.
    for which in ("unified", "native"):
        torch._dynamo.reset()
        ran = side.run(side.function(p, which, False), p, compile_with="aot_eager")
        found.append(ran)
    diff = first_difference(found[1], found[2])
    found[1:] = [[p.name, "contract off", [] if diff is None else [diff[0]]]]
    print("RESULT", json.dumps(found))
""")


def test_first_use_inside_a_compiled_program_in_a_fresh_process(fuzz):
    """A fresh interpreter per program, whose first call of the library is inside a
    compiled frame that dynamo abandons: the contract's dtypes, and without it
    torch.autocast's bytes (issue 33)."""
    for i in share(fuzz, 1, 10):
        proc = subprocess.run([sys.executable, "-c", _FRESH, str(fuzz.seed), str(i)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env=dict(os.environ, UNIFIED_AMP_BACKEND="torch"))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-4000:]
        found = json.loads(lines[-1][len("RESULT "):])
        assert [f for f in found if f[2]] == [], found
