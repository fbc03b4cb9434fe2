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
    import unified_amp as amp

    contract = sys.argv[1] == "on"
    # "early": the block object is made before torch is imported, so the adapter is
    # loaded by the block's entry, inside the abandoned frame
    EARLY = amp.autocast(dtype="bfloat16", device="cpu", contract=contract) \
        if sys.argv[2] == "early" else None
    import torch

    def make(block):
        def step(seed):
            g = torch.Generator().manual_seed(seed)
            # dynamo gives up on this frame: the generator, and the dict comprehension
            W = {k: torch.randn(*s, generator=g) for k, s in {"w": (4, 4)}.items()}
            x = torch.randn(4, 4, generator=g)
            with block():
                return x @ W["w"]
        return step

    unified = make(lambda: EARLY or amp.autocast(dtype="bfloat16", device="cpu",
                                                 contract=contract))
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


@pytest.mark.parametrize("contract, made", [("on", "late"), ("off", "late"), ("on", "early")],
                         ids=["contract on", "contract off", "made before torch's import"])
def test_first_use_inside_a_frame_dynamo_abandons_is_in_force(contract, made):
    """The library's first use in a frame dynamo gives up on (a generator and a dict
    comprehension before the block): the block is in force on the first call, as
    torch.autocast is in the same place, and the numbers are torch.autocast's bytes.
    (Before issue 33 the first call gave float32: the backend was imported inside the
    abandoned frame, before its eager entry was marked to run as it is, so dynamo
    compiled the entry's autocast switches as a graph of their own and lost them.
    Since a block made after torch's import loads the adapter, a block made before it
    is what still reaches that path.)"""
    out = _run(_PROGRAM, contract, made)
    assert out["unified"][:2] == ["torch.bfloat16"] * 2, out
    assert out["unified"] == out["native"]
    assert not out["autocast_left_on"] and out["modes_left"] == 0
    # the block holds no graph break: nothing to warn about
    assert out["compile_warnings"] == [], out["compile_warnings"]


# A block object made outside the compiled function, in a fresh interpreter: a global,
# and the `ctx = nullcontext() if ... else autocast(...)` of training scripts. Each is
# compiled with fullgraph=True and compared with torch.autocast made the same way.
_OUTSIDE = textwrap.dedent("""
    import contextlib, json, sys
    import torch, torch.nn.functional as F, unified_amp as amp

    contract = sys.argv[1] == "on"
    CTX = amp.autocast(dtype="bfloat16", device="cpu", contract=contract)
    NATIVE = torch.autocast("cpu", dtype=torch.bfloat16)
    cpu_only = False
    ctx = contextlib.nullcontext() if cpu_only else amp.autocast(dtype="bfloat16",
                                                                device="cpu",
                                                                contract=contract)
    native_ctx = contextlib.nullcontext() if cpu_only else torch.autocast("cpu",
                                                                          dtype=torch.bfloat16)

    def body(x, w):
        h = x @ w
        return h, F.log_softmax(h, -1)

    def global_block(x, w):
        with CTX:
            return body(x, w)

    def global_native(x, w):
        with NATIVE:
            return body(x, w)

    def local_block(x, w):
        with ctx:
            with ctx:  # re-entered, as one amp.autocast object may be
                return body(x, w)

    def local_native(x, w):
        with native_ctx:
            return body(x, w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    out = {}
    for name, fn in (("global", global_block), ("global native", global_native),
                     ("local", local_block), ("local native", local_native)):
        eager = fn(x, w)
        try:
            got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        out[name] = {"dtypes": [str(t.dtype) for t in got],
                     "equal_eager": all(torch.equal(a, b) for a, b in zip(got, eager)),
                     "values": [t.float().tolist() for t in got]}
    out["autocast_left_on"] = torch.is_autocast_enabled("cpu")
    out["modes_left"] = torch._C._len_torch_function_stack()
    out["tokens_left"] = len(CTX._tokens) + len(ctx._tokens)
    print("RESULT", json.dumps(out))
""")


@pytest.mark.parametrize("contract", ["on", "off"], ids=["contract on", "contract off"])
def test_a_block_made_outside_compiles_whole_in_a_fresh_process(contract):
    """``CTX = amp.autocast(...)`` at module level (and the nullcontext-or-autocast
    pattern) entered inside ``torch.compile(fullgraph=True)``: traced whole, as
    torch.autocast made the same way is, with the eager block's bytes; without the
    contract, torch.autocast's. (Before issue 33 it raised dynamo's Unsupported
    "context manager" on torch 2.7-2.13, the contract on or off.)"""
    out = _run(_OUTSIDE, contract)
    for name in ("global", "local"):
        got, native = out[name], out[f"{name} native"]
        assert isinstance(got, dict), got  # compiled whole: no Unsupported
        assert got["equal_eager"] and native["equal_eager"]
        low = "torch.bfloat16"
        assert got["dtypes"] == [low, "torch.float32" if contract == "on" else low]
        if contract == "off":
            assert got == native
        else:
            assert got["values"][0] == native["values"][0]  # the matmul: torch's bytes
    assert not out["autocast_left_on"] and out["modes_left"] == 0
    assert out["tokens_left"] == 0
