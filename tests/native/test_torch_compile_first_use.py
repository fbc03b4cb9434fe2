"""amp.autocast where the library's first use is inside a compiled function whose frame
dynamo abandons or splits, and an amp.autocast object made outside the compiled
function (docs/COMPILE.md). Each case runs in a fresh interpreter, where nothing of the
adapter has been imported yet, and is compared byte for byte with torch.autocast
written in the same place."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# One program per case: `unified` and `native` are the same function, with amp.autocast
# and with torch.autocast. The unified one runs first (its call is the library's first
# use); both are compiled with aot_eager.
_PROGRAM = textwrap.dedent("""
    import json, sys, warnings
    import torch, unified_amp as amp

    contract = sys.argv[1] == "on"

    def make(block):
        def step(seed):
            g = torch.Generator().manual_seed(seed)
            # dynamo gives up on this frame: the generator, and the dict comprehension
            W = {k: torch.randn(*s, generator=g) for k, s in {"w": (4, 4)}.items()}
            x = torch.randn(4, 4, generator=g)
            with block():
                return x @ W["w"]
        return step

    unified = make(lambda: amp.autocast(dtype="bfloat16", contract=contract))
    native = make(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for name, fn in (("unified", unified), ("native", native)):
            compiled = torch.compile(fn, backend="aot_eager")
            first, second = compiled(0), compiled(1)
            out[name] = [str(first.dtype), str(second.dtype),
                         first.float().tolist(), second.float().tolist()]
    out["compile_warnings"] = [str(w.message) for w in seen
                               if issubclass(w.category, amp.CompileWarning)]
    out["autocast_left_on"] = torch.is_autocast_enabled("cpu")
    out["modes_left"] = torch._C._len_torch_function_stack()
    print("RESULT", json.dumps(out))
""")


def _run(program, *args):
    proc = subprocess.run([sys.executable, "-c", program, *args], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, UNIFIED_AMP_BACKEND="torch"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("contract", ["on", "off"], ids=["contract on", "contract off"])
def test_first_use_inside_a_frame_dynamo_abandons_is_in_force(contract):
    """The library's first use in a frame dynamo gives up on (a generator and a dict
    comprehension before the block): the block is in force on the first call, as
    torch.autocast is in the same place, and the numbers are torch.autocast's bytes.
    (Before issue 33 the first call gave float32: the backend was imported inside the
    abandoned frame, before its eager entry was marked to run as it is, so dynamo
    compiled the entry's autocast switches as a graph of their own and lost them.)"""
    out = _run(_PROGRAM, contract)
    assert out["unified"][:2] == ["torch.bfloat16"] * 2, out
    assert out["unified"] == out["native"]
    assert not out["autocast_left_on"] and out["modes_left"] == 0
    # the block holds no graph break: nothing to warn about
    assert out["compile_warnings"] == [], out["compile_warnings"]

