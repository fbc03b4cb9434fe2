"""The dtype contract under ``autocast``, as data: one row per op class.

The rule that decides every row: **torch's CUDA autocast policy is the contract.**
What ``torch.autocast("cuda")`` gives an op is what the op gives inside an enabled
``amp.autocast`` block, on every backend and device:

- ``low``: the block's low dtype (float16 or bfloat16), whatever the input: CUDA's
  lower-precision list (matmuls, convolutions, RNN cells, attention);
- ``float32``: float32, whatever the input: CUDA's float32 lists (exponentials,
  logarithms, powers, most reductions and norms, softmax, the losses, upsampling);
- ``promote``: mixed floating inputs go to the widest of them: CUDA's promote list;
- ``input``: the dtype the op gives without autocast (its input's, or the widest of its
  inputs'): every op that torch's CUDA autocast does not name;
- ``refuse``: an error on every backend and device, naming the fix: CUDA's banned
  ``binary_cross_entropy``.

Each row's rule was found by running the row's sample call under ``torch.autocast
("cuda")`` (tests/native/test_torch_fake_cuda_dtypes.py runs it again on every CI run),
not by reading a list; ``CUDA_REGISTRATIONS`` is the set of AutocastCUDA registrations
it was derived from (``LATER_REGISTRATIONS``: those of ops a later torch added, whose
rows say from which torch on they exist, ``Row.torch_since``). A backend or device whose own autocast differs on a row keeps
the row's output dtype in its adapter, computing differently where it must
(``Row.reason``). Ops that neither framework's autocast names follow their input.

Framework-free: the names are strings, resolved by each adapter; the sample calls are
expressions over the tensors of ``SAMPLES``, evaluated by the tests.
"""


from dataclasses import replace

from . import natives, pairing, rows_compute, rows_other, rows_reduce, torch_public
from .row import SAMPLES, Adapt, Row, Sample
from .natives import (CPU_REGISTRATIONS, CUDA_REGISTRATIONS, LATER_REGISTRATIONS,
                      TABLE_MEGENGINE, TABLE_TORCH)

__all__ = ["Row", "Adapt", "Sample", "ROWS", "RULES", "SAMPLES", "CUDA_REGISTRATIONS", "CPU_REGISTRATIONS",
           "LATER_REGISTRATIONS", "TABLE_TORCH", "TABLE_MEGENGINE", "REFUSALS", "row", "low_refusal",
           "expected_dtype"]

RULES = ("low", "float32", "promote", "input", "refuse")

ROWS: tuple[Row, ...] = tuple(
    replace(r, adapt=replace(r.adapt, torch_cpu=natives.TORCH_CPU.get(r.name, ""),
                             megengine_native=natives.MEGENGINE.get(r.name, "")))
    for r in rows_compute.ROWS + rows_reduce.ROWS + rows_other.ROWS)
_BY_NAME = {r.name: r for r in ROWS}


def row(name: str) -> Row:
    return _BY_NAME[name]


# The error of a "refuse" row, the same on every backend and device (torch's CUDA
# autocast raises its own, which says the same).
REFUSALS = {
    "binary cross-entropy": (
        "binary_cross_entropy (F.binary_cross_entropy, nn.BCELoss; MegEngine's"
        " F.nn.binary_cross_entropy(..., with_logits=False)) is unsafe to autocast:"
        " the sigmoid before it saturates in float16 and its log then overflows. Inside"
        " amp.autocast, combine the two: binary_cross_entropy_with_logits"
        " (nn.BCEWithLogitsLoss; MegEngine: binary_cross_entropy(..., with_logits=True)),"
        " which is safe to autocast; or run the loss under amp.autocast(enabled=False)"
        " on float32 inputs."),
}

def low_refusal(row_name: str) -> str:
    """The error of a low-precision input to a row with no low-precision kernel on
    torch's CUDA (``Row.refuse_low``), raised by the adapters on torch's CPU and on
    MegEngine; on CUDA torch raises its own ("not implemented for 'Half'", "Low
    precision dtypes not supported"), with autocast or without."""
    return (f"amp.autocast: {row_name} has no float16 or bfloat16 kernel on torch's CUDA"
            f" (torch raises there, with autocast or without), so the contract refuses a"
            f" low-precision input on every device and backend alike. Cast the input to"
            f" float32 first (x.float() on torch, x.astype('float32') on MegEngine): the op"
            f" then computes in float32 and returns float32.")


def expected_dtype(rule: str, data: list[str], params: list[str], low: str) -> str:
    """The dtype a row's op gives inside an enabled block computing in ``low``, for data
    inputs of dtypes ``data`` and float32 parameters ``params`` (dtype names)."""
    if rule == "low":
        return low
    if rule == "float32":
        return "float32"
    pool = data + params if rule == "promote" else data
    return "float32" if "float32" in pool else low
