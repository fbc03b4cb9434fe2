"""The dtype contract's rows (unified_amp/dtype_contract/) as the tests run them: the
sample arrays, the dtype each sample tensor gets for an input kind, the dtype the
contract expects, and the label of what a framework's own autocast gives.

Input kinds: "float32" (every data tensor float32), "low" (every data tensor in the
block's low dtype) and "mixed" (the call's last data tensor float32, the others low).
Parameters are float32 in every kind, as a model's weights are.
"""

from __future__ import annotations

import re

import numpy as np

from unified_amp.dtype_contract import ROWS, SAMPLES, Row, expected_dtype, pairing, row

__all__ = ["ROWS", "Row", "row", "inputs", "names", "dtypes", "expected", "label",
           "round_through", "call_of", "spelling_calls", "on_this_torch", "torch_has", "CASES",
           "NOT_TRAINED"]

LOWS = ("float16", "bfloat16")
# Sample tensors no gradient reaches: targets, batch norm's running statistics, the
# random samples of fractional max pooling.
NOT_TRAINED = {"target", "t01", "tpos", "sign", "sign4", "ch_mean", "ch_var", "rs", "rs3",
               "doff", "dmask"}


def _values(rng: np.random.RandomState, shape: tuple[int, ...], domain: str) -> np.ndarray:
    n, u = rng.randn(*shape), rng.rand(*shape)
    simple = {
        "normal": n, "positive": 0.5 + 1.5 * u, "unit": (2 * u - 1) * 0.8,
        "above1": 1.2 + 1.8 * u, "probability": 0.05 + 0.9 * u,
        "zero": np.zeros(shape), "one": np.ones(shape),
        "quarter": np.full(shape, 0.25), "half": np.full(shape, 0.5),
        "binary": (u > 0.5).astype(float), "sign": np.where(u > 0.5, 1.0, -1.0),
        "four": np.full(shape, 4), "two": np.full(shape, 2),
    }
    if domain in simple:
        return simple[domain]
    if domain == "conditioned":
        return 0.3 * n + 2 * np.eye(shape[-1])
    if domain == "spd":
        m = 0.5 * n
        return m @ np.swapaxes(m, -1, -2) + 2 * np.eye(shape[-1])
    if domain == "log_probability":
        e = np.exp(n)
        return np.log(e / e.sum(-1, keepdims=True))
    if domain in ("class8", "col8"):
        return rng.randint(0, 8, size=shape)
    if domain == "row4":
        return rng.permutation(shape[0])
    if domain == "multilabel":  # two targets per row, then -1
        a = np.full(shape, -1)
        a[:, 0] = rng.randint(0, 8, size=shape[0])
        a[:, 1] = (a[:, 0] + 3) % 8
        return a
    if domain == "ctc":
        return rng.randint(1, 5, size=shape)
    raise KeyError(domain)


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """Every sample array: float32 for data and parameters, int64 for indices."""
    rng = np.random.RandomState(seed)
    return {name: _values(rng, shape, domain).astype(np.int64 if role == "int" else np.float32)
            for name, (shape, role, domain) in SAMPLES.items()}


def names(call: str) -> list[str]:
    """The sample tensors a call names, in order of first appearance."""
    seen: list[str] = []
    for token in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", call):
        if token in SAMPLES and token not in seen:
            seen.append(token)
    return seen


def dtypes(call: str, kind: str, low: str) -> dict[str, str]:
    """Each sample tensor of ``call``: "float32", ``low`` or "int"."""
    data = [n for n in names(call) if SAMPLES[n][1] == "data"]
    out = {}
    for n in names(call):
        role = SAMPLES[n][1]
        if role == "int":
            out[n] = "int"
        elif role == "param" or kind == "float32" or (kind == "mixed" and n == data[-1]):
            out[n] = "float32"
        else:
            out[n] = low
    return out


def expected(r: Row, kind: str, low: str, call: str | None = None) -> str:
    """The dtype the contract gives ``r``'s sample call (``call``: the framework's, by
    default torch's), or "error" for a row that refuses."""
    if r.rule == "refuse":
        return "error"
    call = call or r.sample.torch or r.sample.megengine
    assert call is not None, r.name
    types = dtypes(call, kind, low)
    data = [types[n] for n in names(call) if SAMPLES[n][1] == "data"]
    params = [types[n] for n in names(call) if SAMPLES[n][1] == "param"]
    if r.adapt.follows_first and data:  # batch norm, in-place operators: the first tensor's
        return data[0]
    return expected_dtype(r.rule, data, params, low)


def on_this_torch(r: Row) -> bool:
    """Whether the running torch is one the row exists on (``Row.torch_since``)."""
    if not r.torch_since:
        return True
    import torch

    return r.on_torch(torch.__version__)


def torch_has(r: Row) -> list[str]:
    """Which of the row's torch spellings and dispatcher ops the running torch has."""
    import torch

    from unified_amp.backends.torch_backend.dtype_contract import resolve

    found = [s for s in r.torch if resolve(s) is not None]
    for op in r.aten:
        try:
            torch._C._get_schema(f"aten::{op.partition('.')[0]}", op.partition(".")[2])
        except RuntimeError:  # "Found no matching schema": no such op in this torch
            continue
        found.append(op)
    return found


def call_of(r: Row, framework: str) -> str | None:
    """The row's sample call on ``framework``; None where it lacks the op (MegEngine's
    absent rows; on torch, a row from a later torch than the running one)."""
    if framework == "torch":
        return r.sample.torch if on_this_torch(r) else None
    return r.sample.megengine


def spelling_calls(r: Row, framework: str) -> list[tuple[str, str]]:
    """Each spelling of the row on ``framework`` that it has here, with its sample call
    (``pairing.call_for``): every one is proved, not only the first. On torch, a spelling
    this torch lacks is left out (an older or newer torch than the table's)."""
    if call_of(r, framework) is None:
        return []
    if framework == "torch":
        from unified_amp.backends.torch_backend.dtype_contract import resolve

        spellings = [s for s in r.torch if resolve(s) is not None]
        calls, base = pairing.TORCH_CALLS, r.sample.torch
    else:
        spellings, calls, base = list(r.megengine), pairing.MEGENGINE_CALLS, r.sample.megengine
    out = []
    for s in spellings:
        call = pairing.call_for(r.name, base, s, calls)
        assert call is not None, f"{r.name!r}: give {s} a sample call in pairing.py"
        out.append((s, call))
    return out


def _word(dtype: str, low: str) -> str:
    return "low" if dtype == low else dtype


def label(r: Row, outcomes: dict[str, dict[str, str]], call: str) -> str:
    """What a framework's own autocast gives a row, in the table's words: the rule's
    name when every outcome is the rule's, else a description.

    ``outcomes``: low dtype -> input kind -> output dtype or "error".
    """
    if all(got == expected(r, kind, low, call) for low, by_kind in outcomes.items()
           for kind, got in by_kind.items()):
        return r.rule

    def describe(by_kind: dict[str, str], low: str) -> str:
        f, lo = _word(by_kind["float32"], low), _word(by_kind["low"], low)
        text = {("low", "low"): "low", ("float32", "float32"): "float32",
                ("float32", "low"): "input", ("error", "error"): "error"}.get(
            (f, lo), f"float32 input: {f}, low input: {lo}")
        if "mixed" in by_kind:
            text += f", mixed: {_word(by_kind['mixed'], low)}"
        return text

    texts = {low: describe(by_kind, low) for low, by_kind in outcomes.items()}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"{low}: {text}" for low, text in texts.items())


def round_through(a: np.ndarray, low: str) -> np.ndarray:
    """``a`` rounded to the low dtype and back to float32 (numpy has no bfloat16:
    round-to-nearest-even on the top 16 bits of the float32 pattern)."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        return a
    if low == "float16":
        return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


CASES = [(r.name, kind) for r in ROWS for kind in r.kinds()]
