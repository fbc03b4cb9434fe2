"""One row of the contract, and the vocabulary its sample calls use."""

from __future__ import annotations

import re
from dataclasses import dataclass


# The tensors a sample call may name: shape, role and values.
# role "data" follows the test's input kind (float32, low, or in "mixed" the last data
# tensor of the call float32 and the others low); "param" is always float32 (weights,
# targets); "int" holds indices. Data tensors have 32 elements where the op allows, so
# that the autocast fuzz can feed its (4, 8) activation to them.
SAMPLES: dict[str, tuple[tuple[int, ...], str, str]] = {
    # data
    "x": ((4, 8), "data", "normal"),
    "y": ((4, 8), "data", "normal"),
    "z": ((4, 8), "data", "normal"),
    "pos": ((4, 8), "data", "positive"),
    "unit": ((4, 8), "data", "unit"),  # in (-0.8, 0.8): asin, acos, atanh, erfinv
    "big": ((4, 8), "data", "above1"),  # in (1.2, 3): acosh
    "prob": ((4, 8), "data", "probability"),
    "v": ((8,), "data", "normal"),
    "v2": ((8,), "data", "normal"),
    "v4": ((4,), "data", "normal"),
    "m24": ((2, 4), "data", "normal"),
    "c3": ((2, 2, 4), "data", "normal"),
    "tri": ((4, 3), "data", "normal"),
    "tri2": ((4, 3), "data", "normal"),
    "y4": ((4, 4), "data", "normal"),
    "h0": ((1, 2, 8), "data", "normal"),
    "c0": ((1, 2, 8), "data", "normal"),
    "rs": ((1, 2, 2), "data", "half"),  # fractional max pooling's samples
    "img": ((1, 2, 4, 4), "data", "normal"),
    "seq": ((2, 2, 8), "data", "normal"),
    "vol": ((1, 2, 2, 2, 4), "data", "normal"),
    "a3": ((2, 2, 8), "data", "normal"),
    "b3": ((2, 8, 4), "data", "normal"),
    "sq": ((4, 4), "data", "conditioned"),  # well-conditioned: inverses, solves
    "spd": ((4, 4), "data", "spd"),  # symmetric positive definite
    "pair": ((4, 8, 2), "data", "normal"),  # real and imaginary parts
    "tbc": ((8, 2, 2), "data", "normal"),  # (time, batch, channels)
    "grid": ((1, 4, 4, 2), "data", "unit"),
    "logp": ((4, 2, 5), "data", "log_probability"),  # (time, batch, classes) for CTC
    # params: float32 whatever the input kind
    "w": ((8, 8), "param", "normal"),
    "b": ((8,), "param", "normal"),
    "cw": ((2, 2, 3, 3), "param", "normal"),
    "cb": ((2,), "param", "normal"),
    "cw1": ((2, 2, 3), "param", "normal"),
    "cw3": ((2, 2, 3, 3, 3), "param", "normal"),
    "tbcw": ((3, 2, 2), "param", "normal"),
    "lw": ((1, 4, 4, 2, 3, 3, 2), "param", "normal"),  # local conv: a filter per position
    "doff": ((1, 18, 4, 4), "param", "zero"),  # deformable conv: offsets, mask
    "dmask": ((1, 9, 4, 4), "param", "one"),
    "ch_mean": ((2,), "param", "zero"),
    "ch_var": ((2,), "param", "one"),
    "ch_w": ((2,), "param", "one"),
    "ch_b": ((2,), "param", "zero"),
    "ln_w": ((8,), "param", "one"),
    "ln_b": ((8,), "param", "zero"),
    "bw": ((8, 8, 8), "param", "normal"),
    "rnn_w": ((8, 8), "param", "normal"),
    "lstm_w": ((32, 8), "param", "normal"),
    "gru_w": ((24, 8), "param", "normal"),
    "pw": ((1,), "param", "quarter"),
    "lstm_b": ((32,), "param", "normal"),
    "target": ((4, 8), "param", "normal"),
    "t01": ((4, 8), "param", "binary"),
    "tpos": ((4, 8), "param", "positive"),
    "sign": ((4, 8), "param", "sign"),
    "sign4": ((4,), "param", "sign"),
    "table": ((10, 8), "data", "normal"),  # an embedding's weights: what it looks up
    # int
    "labels": ((4,), "int", "class8"),
    "rows4": ((4,), "int", "row4"),  # a permutation of 0..3
    "cols": ((4, 8), "int", "col8"),
    "lookup": ((4,), "int", "class8"),
    "ml_labels": ((4, 8), "int", "multilabel"),
    "ctc_targets": ((2, 2), "int", "ctc"),
    "ctc_in_len": ((2,), "int", "four"),
    "ctc_tg_len": ((2,), "int", "two"),
    # (added last: the values drawn for the others stay as they were)
    "rs3": ((1, 2, 3), "data", "half"),  # fractional max pooling's samples in 3-d
}


@dataclass(frozen=True, kw_only=True)
class Adapt:
    """What an adapter must do to keep a row's contract where its framework's own
    autocast does not: read by ``backends/*/dtype_contract.py`` (and by the tests that
    check the adapters act exactly there).

    ``torch_cpu`` / ``megengine_native``: what ``torch.autocast("cpu")`` and
    ``megengine.amp.autocast`` give the row by themselves (as measured on the versions
    of ``TABLE_TORCH`` and ``TABLE_MEGENGINE``), written as a rule name when it is the
    row's rule; empty means "the row's rule". They live here, not on the contract,
    because they are not a promise but the frameworks' measured behaviour an adapter
    works against: an adapter acts on a row exactly where its framework's own autocast
    differs from the rule, or where ``float32_compute`` names its place. They are kept
    in ``natives.py`` (``TORCH_CPU``, ``MEGENGINE``) and filled in by ``ROWS``, as they
    change with the framework's version and the rows do not.

    ``float32_compute``: places where the adapter computes the op in float32 and returns
    the rule's dtype, because the framework has no (working) low-precision kernel
    there: "torch-cpu", "torch-cpu-float16", "megengine", "megengine-cpu". ``Row.reason``
    says why, and why a native differs. ``wrapped``: places where the framework's own
    autocast gives the row's dtype but wrong values, so the adapter runs the op itself
    there ("megengine": casting the inputs and running it with MegEngine's autocast
    off). ``follows_first``: an "input" row whose output follows its first tensor (the
    data) alone, not the widest of its inputs (batch norm's float32 statistics and
    weights leave a float16 input's output float16). ``megengine_when``: "name=value",
    where one MegEngine function serves two rows: the call is this row's when its
    argument ``name`` is ``value``. ``compiled``: where code compiled by
    ``torch.compile`` keeps torch's own rule instead, and why.
    """

    float32_compute: tuple[str, ...] = ()
    wrapped: tuple[str, ...] = ()
    follows_first: bool = False
    megengine_when: str = ""
    compiled: str = ""
    torch_cpu: str = ""
    megengine_native: str = ""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """What the tests feed a row, and where they cannot.

    ``torch`` / ``megengine``: a sample call over ``SAMPLES`` whose output dtype the
    tests check (None: the framework lacks the op); ``getattr(sample, framework)``
    mirrors ``getattr(row, framework)``, the spellings. ``cuda_low``: False where
    torch's CUDA kernels take no low-precision input (torch raises there, with autocast
    or without), so the CUDA cell is checked with a float32 input only.
    ``fake_cuda``: why fake CUDA (FakeTensorMode) cannot run the sample call, where it
    cannot. ``fuzz``: whether the autocast fuzz draws the row. ``mixed``: also checked
    with mixed float32/low inputs (always for "promote" rows: ``Row.kinds``).
    ``no_bfloat16``: the op's output is complex, and no complex bfloat16 dtype exists:
    a bfloat16 input raises everywhere, as it does on torch's CUDA.
    ``megengine_absent``: the names checked absent from MegEngine where the row has no
    MegEngine call (default: the torch spellings' own names).
    """

    torch: str | None = None
    megengine: str | None = None
    cuda_low: bool = True
    fake_cuda: str = ""
    fuzz: bool = True
    mixed: bool = False
    no_bfloat16: bool = False
    megengine_absent: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Row:
    """One op class of the contract: what it promises. What an adapter must do to keep
    the promise is ``adapt`` (``Adapt``); what the tests feed it is ``sample``
    (``Sample``), as torch keeps its autocast op lists apart from the kernels that
    apply them.

    ``aten``: the torch dispatcher ops it groups (each AutocastCPU/AutocastCUDA
    registration lands in one row). ``torch`` / ``megengine``: the Python spellings that
    reach it ("F." is each framework's functional namespace, "Tensor." its tensor
    class), empty where the framework lacks the op. ``reason``: why an adapter acts on
    the row (``Adapt``), and why a native differs.

    ``refuse_low``: a row with no low-precision kernel on torch's CUDA
    (``Sample.cuda_low`` False) whose every spelling fake CUDA shows torch refusing a
    low-precision input on CUDA: the contract refuses one on every device and backend,
    one outcome everywhere (the adapters raise ``low_refusal``'s error, which names the
    fix, cast to float32; CUDA's is torch's own), which keeps CUDA free of any Python
    call. It is part of the promise (an error, not a dtype), so it is kept here.
    ``torch_since``: the first torch ("2.14") that has the row's ops and spellings,
    where that is later than the oldest torch supported; on an earlier torch the row's
    op is absent (the tests check that it is, as they check MegEngine's absent ops), and
    its Autocast registrations are recorded in ``natives.LATER_REGISTRATIONS``, as the
    first torch that has it registers them.
    """

    name: str
    group: str
    rule: str
    aten: tuple[str, ...] = ()
    torch: tuple[str, ...] = ()
    megengine: tuple[str, ...] = ()
    reason: str = ""
    refuse_low: bool = False
    torch_since: str = ""
    adapt: Adapt = Adapt()
    sample: Sample = Sample()

    def kinds(self) -> tuple[str, ...]:
        """The input kinds the tests check this row with."""
        return ("float32", "low", "mixed") if self.sample.mixed or self.rule == "promote" \
            else ("float32", "low")

    def native(self, framework: str) -> str:
        """What ``framework``'s own autocast ("torch-cpu", "megengine") gives the row."""
        own = self.adapt.torch_cpu if framework == "torch-cpu" else self.adapt.megengine_native
        return own or self.rule

    def on_torch(self, version: str) -> bool:
        """Whether torch ``version`` ("2.13.0+cpu", "2.14.1") has the row's op."""
        return not self.torch_since or release(version) >= release(self.torch_since)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.14.1+cu130" -> (2, 14, 1), a
    pre-release of 2.14.0 ("2.14.0a0+git...") -> (2, 14, 0)."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)

