"""What a compile leaves behind: a function holding a block, compiled, called and dropped
with ``torch._dynamo.reset()``, cycle after cycle, leaves no more in the process than the
same function with a ``torch.autocast`` block does, counted in the same process.

dynamo's guards hang a ``weakref.finalize`` on each object they match by identity, and
each finalizer keeps its compile's guards alive until that object dies; the library's
modules and code never die (``autocast_dynamo.release_dead_guards``). torch.autocast's
own compile keeps its guards through three such finalizers (torch, torch.autocast and
the op), so the comparison is with what torch itself leaves, not with zero.

The cycles run in a process of their own (tools/compile_leak.py, which prints the same
figures as a table): pytest keeps every log record dynamo emits, and the other tests'
compiles die at their own pace."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about 20 s: 60 compiles in a process of its own

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compile_leak.py"
# Few cycles: the finalizers a cycle leaves are counted exactly, and the objects differ
# by several times (before the fix, on torch 2.13: amp.autocast 48 finalizers and about
# 600 objects a cycle, torch.autocast 3 and 77).
CYCLES = 4
PAIRS = {  # each form of a block -> the torch.autocast form it is held to
    "amp.autocast": "torch.autocast",
    "amp.autocast contract=False": "torch.autocast",
    "decorated": "torch.autocast",
    "block made outside": "torch.autocast",
    "amp.autocast, graph break inside": "torch.autocast",
    "amp.autocast, graph break, redefined": "torch.autocast, graph break, redefined",
    "amp.autocast CPU+CUDA (fake)": "torch.autocast CPU+CUDA (fake)",
}


@pytest.fixture(scope="module")
def left():
    forms = sorted(set(PAIRS) | set(PAIRS.values()))
    run = subprocess.run(
        [sys.executable, str(TOOL), "--json", "--cycles", str(CYCLES), "--forms", *forms],
        capture_output=True, text=True, timeout=280,
        env={**os.environ, "UNIFIED_AMP_BACKEND": "torch"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("form", list(PAIRS))
def test_a_compile_and_reset_leaves_no_more_than_torch_autocasts(form, left):
    ours, native = left[form], left[PAIRS[form]]
    assert ours["finalizers"] <= native["finalizers"], (form, ours, PAIRS[form], native)
    assert ours["objects"] <= native["objects"], (form, ours, PAIRS[form], native)
