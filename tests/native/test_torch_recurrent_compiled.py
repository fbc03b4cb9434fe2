"""Recurrent layers under the contract, compiled, equal the same layers run eagerly, in
both low dtypes, on every CPU instruction set.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` are what users compile (the rows' sample calls
are the functional ``torch.lstm``, which tests/native/test_torch_compiled_dtype_table.py
compiles whole). dynamo does not trace an RNN module (``torch._dynamo.config.allow_rnn``
is off): it runs the module's forward as it is, and each of its torch calls reaches the
contract's mode eagerly inside the compiled call. oneDNN's AVX2 path has no bfloat16 or
float16 RNN primitive, where AVX-512 BF16 has a bfloat16 one, so the LSTM row computes in
float32 on the CPU in both low dtypes; `make test` runs this file a second time under
``ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import pytest
import torch

import unified_amp as amp

pytestmark = pytest.mark.timeout(900)

LAYERS = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}


def _run(layer, x, dtype, backend):
    def step(inp):
        with amp.autocast(dtype=dtype, device="cpu"):
            out = layer(inp)[0]
        return out, out.float().square().sum()

    if backend != "eager":
        torch._dynamo.reset()
    try:
        fn = step if backend == "eager" else torch.compile(step, backend=backend)
        layer.zero_grad()
        out, loss = fn(x)
        loss.backward()
        return out, [p.grad.clone() for p in layer.parameters()]
    finally:
        if backend != "eager":
            torch._dynamo.reset()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["float32", "low"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_compiled_recurrent_layer_equals_it_eagerly(name, kind, dtype):
    torch.manual_seed(0)
    layer = LAYERS[name](8, 8, batch_first=True)
    x = torch.randn(2, 3, 8)
    if kind == "low":
        x = x.to(getattr(torch, dtype))
    want, want_grads = _run(layer, x, dtype, "eager")
    got, grads = _run(layer, x, dtype, "aot_eager")
    assert want.dtype == got.dtype == getattr(torch, dtype)
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_lstm_compiled_by_inductor_gives_the_contracts_dtype_and_eagers_values(dtype):
    """Inductor does not round at each cast it fuses (its emulate_precision_casts is
    off), so its values are eager's within the low dtype's rounding."""
    torch.manual_seed(0)
    layer = torch.nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 3, 8).to(getattr(torch, dtype))
    want, want_grads = _run(layer, x, dtype, "eager")
    got, grads = _run(layer, x, dtype, "inductor")
    assert got.dtype == want.dtype == getattr(torch, dtype)
    tol = {"float16": 2e-3, "bfloat16": 2e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=4 * tol, atol=4 * tol)
