"""What a block's own rules (``amp.autocast(rules=...)``) promise, as the tests generate
it: rule kind x sample op x key form x input kind, on each backend and device.

The sample ops are rows of the dtype table with a sample call on both frameworks, one or
more of each of the table's own rules, so that every kind is seen replacing every base
rule; their calls are the table's (tests/contract/dtype_table.py).
"""

from __future__ import annotations

import sys

from unified_amp import rules

from .dtype_table import SAMPLES, call_of, dtypes, names, row

KINDS = rules.KINDS
SAMPLE_ROWS = ("matmul", "linear", "conv2d", "exp", "softmax", "sum", "layer norm",
               "cross-entropy", "add", "relu", "mean")
# How a rule names the op: by its row; by the framework function of the row's sample
# call (which names the whole row); by a function of the program's own that makes the
# call (``own`` below: a rule on it behaves like a row).
KEY_FORMS = ("row", "function", "own")


def own(op, *tensors):
    """A program's own function: calls ``op`` on ``tensors``. A rule that names it
    casts ``tensors`` and runs ``op`` with autocast off, as a row's rule does."""
    return op(*tensors)


def floating(call: str, kind: str, low: str) -> list[str]:
    """The dtypes of the call's floating tensors, in the order the call names them."""
    return [d for n, d in dtypes(call, kind, low).items() if d != "int"]


def input_kinds(name: str) -> list[str]:
    """float32 and low inputs; mixed where the call has two data tensors (a low
    activation beside a float32 one) or a float32 weight."""
    call = row(name).sample.torch
    data = [n for n in names(call) if SAMPLES[n][1] == "data"]
    params = [n for n in names(call) if SAMPLES[n][1] == "param"]
    return ["float32", "low"] + (["mixed"] if len(data) > 1 or params else [])


def expected(kind: str, call: str, input_kind: str, low: str) -> str | None:
    """The dtype a rule of ``kind`` gives the call (None: the call raises)."""
    if kind == "refuse":
        return None
    return to_dtype(kind, floating(call, input_kind, low), low)


def to_dtype(kind: str, found: list[str], low: str) -> str:
    """The dtype the floating inputs go to (rules.MEANING)."""
    if kind == "low":
        return low
    if kind == "float32":
        return "float32"
    if kind == "promote":
        return "float32" if "float32" in found else low
    assert kind == "input", kind
    return found[0]


def framework_function(name: str, framework: str):
    """The framework function of the row's sample call (``F.softmax``)."""
    call = call_of(row(name), framework)
    spelling = call.partition("(")[0]
    if framework == "torch":
        from unified_amp.backends.torch_backend.dtype_contract import resolve

        return resolve(spelling)
    from unified_amp.backends.megengine_backend.dtype_contract import resolve

    return resolve(spelling)[2]


def key_for(form: str, name: str, framework: str):
    if form == "row":
        return name
    if form == "function":
        return framework_function(name, framework)
    return sys.modules[__name__].own  # the wrapper, once a rule has named it


def through_own(call: str) -> str:
    """The call made through ``own``: ``own(lambda x, w: F.linear(x, w), x, w)``."""
    tensors = names(call)
    return f"own(lambda {', '.join(tensors)}: {call}, {', '.join(tensors)})"
