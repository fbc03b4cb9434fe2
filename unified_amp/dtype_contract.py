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
it was derived from. A backend or device whose own autocast differs on a row keeps
the row's output dtype in its adapter, computing differently where it must
(``Row.reason``). Ops that neither framework's autocast names follow their input.

Framework-free: the names are strings, resolved by each adapter; the sample calls are
expressions over the tensors of ``SAMPLES``, evaluated by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Row", "ROWS", "RULES", "SAMPLES", "CUDA_REGISTRATIONS", "CPU_REGISTRATIONS",
           "TABLE_TORCH", "TABLE_MEGENGINE", "REFUSALS", "row", "expected_dtype"]

RULES = ("low", "float32", "promote", "input", "refuse")

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
}


@dataclass(frozen=True)
class Row:
    """One op class of the contract.

    ``aten``: the torch dispatcher ops it groups (each AutocastCPU/AutocastCUDA
    registration lands in one row). ``torch`` / ``megengine``: the Python spellings that
    reach it ("F." is each framework's functional namespace, "Tensor." its tensor
    class), empty where the framework lacks the op. ``torch_call`` / ``megengine_call``:
    a sample call over ``SAMPLES`` whose output dtype the tests check (None: absent).

    ``torch_cpu`` / ``megengine_native``: what ``torch.autocast("cpu")`` and
    ``megengine.amp.autocast`` give the row by themselves (as measured on the versions
    of ``TABLE_TORCH`` and ``TABLE_MEGENGINE``), written as a rule name when it is the
    row's rule; empty means "the row's rule". An adapter acts on a row exactly where its
    framework's own autocast differs from the rule, or where ``float32_compute`` names
    its place.

    ``float32_compute``: places where the adapter computes the op in float32 and returns
    the rule's dtype, because the framework has no (working) low-precision kernel
    there: "torch-cpu", "torch-cpu-float16", "megengine", "megengine-cpu". ``reason``
    says why, and why a native differs. ``cuda_low``: False where torch's CUDA kernels
    take no low-precision input (torch raises there, with autocast or without), so the
    CUDA cell is checked with a float32 input only. ``fake_cuda``: why fake CUDA
    (FakeTensorMode) cannot run the sample call, where it cannot. ``fuzz``: whether the
    autocast fuzz draws the row. ``mixed``: also checked with mixed float32/low inputs
    (always for "promote" rows). ``no_bfloat16``: the op's output is complex, and no
    complex bfloat16 dtype exists: a bfloat16 input raises everywhere, as it does on
    torch's CUDA. ``megengine_absent``: the names checked absent from MegEngine where
    the row has no MegEngine call (default: the torch spellings' own names).
    ``megengine_when``: "name=value", where one MegEngine function serves two rows: the
    call is this row's when its argument ``name`` is ``value``. ``wrapped``: places
    where the framework's own autocast gives the row's dtype but wrong values, so the
    adapter runs the op itself there ("megengine": casting the inputs and running it
    with MegEngine's autocast off). ``follows_first``: an "input" row whose output
    follows its first tensor (the data) alone, not the widest of its inputs (batch
    norm's float32 statistics and weights leave a float16 input's output float16).
    """

    name: str
    group: str
    rule: str
    aten: tuple[str, ...] = ()
    torch: tuple[str, ...] = ()
    torch_call: str | None = None
    megengine: tuple[str, ...] = ()
    megengine_call: str | None = None
    torch_cpu: str = ""
    megengine_native: str = ""
    float32_compute: tuple[str, ...] = ()
    reason: str = ""
    cuda_low: bool = True
    fake_cuda: str = ""
    fuzz: bool = True
    mixed: bool = False
    megengine_absent: tuple[str, ...] = ()
    no_bfloat16: bool = False
    megengine_when: str = ""
    wrapped: tuple[str, ...] = ()
    follows_first: bool = False

    def kinds(self) -> tuple[str, ...]:
        """The input kinds the tests check this row with."""
        return ("float32", "low", "mixed") if self.mixed or self.rule == "promote" \
            else ("float32", "low")

    def native(self, framework: str) -> str:
        """What ``framework``'s own autocast ("torch-cpu", "megengine") gives the row."""
        own = self.torch_cpu if framework == "torch-cpu" else self.megengine_native
        return own or self.rule


def _r(name: str, group: str, rule: str, aten: str = "", torch: str = "",
       torch_call: str | None = None, megengine: str = "",
       megengine_call: str | None = None, *, float32_compute: str = "",
       megengine_absent: str = "", wrapped: str = "", **kw: object) -> Row:
    return Row(name, group, rule, tuple(aten.split()), tuple(torch.split()), torch_call,
               tuple(megengine.split()), megengine_call,
               float32_compute=tuple(float32_compute.split()),
               megengine_absent=tuple(megengine_absent.split()),
               wrapped=tuple(wrapped.split()), **kw)  # type: ignore[arg-type]


ROWS: tuple[Row, ...] = (
    # -- matmuls and convolutions: low ----------------------------------------------------
    _r("linear", "matmul", "low", "linear", "F.linear", "F.linear(x, w, b)",
       "F.linear F.nn.linear", "F.nn.linear(x, w, b)"),
    _r("matmul", "matmul", "low", "matmul mm", "torch.matmul torch.mm Tensor.matmul Tensor.mm"
       " Tensor.__matmul__ Tensor.__rmatmul__", "torch.matmul(x, w)",
       "F.matmul Tensor.__matmul__", "F.matmul(x, w)"),
    _r("addmm", "matmul", "low", "addmm _addmm_activation", "torch.addmm Tensor.addmm",
       "torch.addmm(b, x, w)"),
    _r("matrix-vector product", "matmul", "low", "mv", "torch.mv Tensor.mv", "torch.mv(x, v)",
       "F.matmul", "F.matmul(x, v)"),
    _r("addmv", "matmul", "low", "addmv", "torch.addmv Tensor.addmv", "torch.addmv(v4, x, v)"),
    _r("addr", "matmul", "low", "addr", "torch.addr Tensor.addr", "torch.addr(x, v4, v)"),
    _r("batched matmul", "matmul", "low", "bmm", "torch.bmm Tensor.bmm", "torch.bmm(a3, b3)",
       "F.matmul", "F.matmul(a3, b3)"),
    _r("baddbmm", "matmul", "low", "baddbmm", "torch.baddbmm Tensor.baddbmm",
       "torch.baddbmm(c3, a3, b3)"),
    _r("addbmm", "matmul", "low", "addbmm", "torch.addbmm Tensor.addbmm",
       "torch.addbmm(m24, a3, b3)"),
    _r("einsum", "matmul", "low", "einsum", "torch.einsum", "torch.einsum('ij,kj->ik', x, w)"),
    _r("multi-dot", "matmul", "low", "linalg_multi_dot chain_matmul",
       "torch.linalg.multi_dot torch.chain_matmul", "torch.linalg.multi_dot([x, w, w])"),
    _r("vector dot along a dimension", "matmul", "low", "linalg_vecdot", "torch.linalg.vecdot",
       "torch.linalg.vecdot(x, y)"),
    _r("conv1d", "convolution", "low", "conv1d conv1d.padding", "F.conv1d torch.conv1d",
       "F.conv1d(seq, cw1, cb, padding=1)", "F.conv1d F.nn.conv1d",
       "F.conv1d(seq, cw1, cb.reshape(1, 2, 1), padding=1)"),
    _r("conv2d", "convolution", "low",
       "conv2d conv2d.padding convolution _convolution _convolution.deprecated"
       " cudnn_convolution", "F.conv2d torch.conv2d torch.convolution",
       "F.conv2d(img, cw, cb, padding=1)", "F.conv2d F.nn.conv2d",
       "F.conv2d(img, cw, cb.reshape(1, 2, 1, 1), padding=1)"),
    _r("conv3d", "convolution", "low", "conv3d conv3d.padding", "F.conv3d torch.conv3d",
       "F.conv3d(vol, cw3, cb, padding=1)", "F.conv3d F.nn.conv3d",
       "F.conv3d(vol, cw3, cb.reshape(1, 2, 1, 1, 1), padding=1)",
       reason="MegEngine: its autocast promotes Convolution3D (the widest input); the"
              " adapter casts the inputs to the low dtype."),
    _r("conv_transpose1d", "convolution", "low", "conv_transpose1d",
       "F.conv_transpose1d torch.conv_transpose1d", "F.conv_transpose1d(seq, cw1, cb, padding=1)"),
    _r("conv_transpose2d", "convolution", "low",
       "conv_transpose2d.input cudnn_convolution_transpose",
       "F.conv_transpose2d torch.conv_transpose2d", "F.conv_transpose2d(img, cw, cb, padding=1)",
       "F.conv_transpose2d F.nn.conv_transpose2d",
       "F.conv_transpose2d(img, cw, cb.reshape(1, 2, 1, 1), padding=1)", wrapped="megengine",
       reason="MegEngine: under its autocast, conv_transpose2d adds the first channel's bias"
              " to every channel (its cast of the bias is left a one-element tuple); the"
              " adapter casts the inputs itself and runs it without."),
    _r("conv_transpose3d", "convolution", "low", "conv_transpose3d.input",
       "F.conv_transpose3d torch.conv_transpose3d",
       "F.conv_transpose3d(vol, cw3, cb, padding=1)",
       "F.conv_transpose3d F.nn.conv_transpose3d",
       "F.conv_transpose3d(vol, cw3, cb.reshape(1, 2, 1, 1, 1), padding=1)",
       reason="MegEngine: its autocast promotes Convolution3DBackwardData; the adapter"
              " casts the inputs to the low dtype."),
    _r("conv_tbc", "convolution", "low", "conv_tbc", "torch.conv_tbc",
       "torch.conv_tbc(tbc, tbcw, cb, 1)"),
    _r("local conv2d", "convolution", "promote", "", "", None,
       "F.local_conv2d F.nn.local_conv2d", "F.local_conv2d(img, lw, padding=1)",
       reason="absent from torch: MegEngine's own rule (its autocast promotes GroupLocal)."),
    _r("deformable conv2d", "convolution", "low", "", "", None,
       "F.deformable_conv2d F.nn.deformable_conv2d",
       "F.deformable_conv2d(img, cw, doff, dmask, padding=1)",
       float32_compute="megengine-cpu",
       reason="absent from torch: MegEngine's own rule (its autocast casts the inputs to the"
              " low dtype). MegEngine CPU: no float16 kernel (its own autocast raises); the"
              " adapter computes it in float32 and returns float16."),
    _r("prelu", "activation", "low", "prelu", "F.prelu torch.prelu", "F.prelu(x, pw)",
       "F.prelu F.nn.prelu", "F.prelu(x, pw)",
       reason="MegEngine: prelu is elementwise Python there (the widest input); the"
              " adapter casts the inputs to the low dtype."),
    _r("LSTM cell", "recurrent", "low", "lstm_cell _thnn_fused_lstm_cell", "torch.lstm_cell",
       "torch.lstm_cell(x, (y, z), lstm_w, lstm_w, lstm_b, lstm_b)[0]"),
    _r("GRU cell", "recurrent", "low", "gru_cell _thnn_fused_gru_cell", "torch.gru_cell",
       "torch.gru_cell(x, y, gru_w, gru_w)",
       fake_cuda="torch 2.13 has no meta kernel for _thnn_fused_gru_cell on CUDA, so fake CUDA cannot run it"),
    _r("RNN cell", "recurrent", "low", "rnn_tanh_cell rnn_relu_cell",
       "torch.rnn_tanh_cell torch.rnn_relu_cell", "torch.rnn_tanh_cell(x, y, rnn_w, rnn_w)"),
    _r("LSTM layer", "recurrent", "low", "mkldnn_rnn_layer _cudnn_rnn", "torch.lstm",
       "torch.lstm(a3, (h0, c0), (lstm_w, lstm_w, lstm_b, lstm_b), True, 1, 0.0, False, False, True)[0]",
       float32_compute="torch-cpu-float16",
       reason="torch CPU: oneDNN has no float16 LSTM (torch.autocast('cpu', dtype=torch.float16) raises); the adapter computes it in float32 and returns float16."),
    _r("scaled dot-product attention", "attention", "low",
       "scaled_dot_product_attention _scaled_dot_product_flash_attention"
       " _native_multi_head_attention",
       "F.scaled_dot_product_attention", "F.scaled_dot_product_attention(a3, a3, a3)"),
    # -- elementwise math --------------------------------------------------------------------
    _r("exp", "elementwise", "float32", "exp", "torch.exp Tensor.exp torch.special.exp2",
       "torch.exp(x)", "F.exp F.nn.exp", "F.exp(x)"),
    _r("expm1", "elementwise", "float32", "expm1", "torch.expm1 Tensor.expm1 torch.special.expm1",
       "torch.expm1(x)", "F.expm1", "F.expm1(x)"),
    _r("log", "elementwise", "float32", "log", "torch.log Tensor.log", "torch.log(pos)",
       "F.log F.nn.log", "F.log(pos)"),
    _r("log10", "elementwise", "float32", "log10", "torch.log10 Tensor.log10", "torch.log10(pos)"),
    _r("log2", "elementwise", "float32", "log2", "torch.log2 Tensor.log2", "torch.log2(pos)"),
    _r("log1p", "elementwise", "float32", "log1p", "torch.log1p Tensor.log1p torch.special.log1p",
       "torch.log1p(pos)", "F.log1p F.nn.log1p", "F.log1p(pos)"),
    _r("pow", "elementwise", "float32", "pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar",
       "torch.pow Tensor.pow Tensor.__pow__ Tensor.__rpow__ torch.float_power", "torch.pow(x, 2)",
       "F.pow Tensor.__pow__ Tensor.__rpow__", "F.pow(x, 2)"),
    _r("reciprocal", "elementwise", "float32", "reciprocal",
       "torch.reciprocal Tensor.reciprocal Tensor.__rtruediv__ Tensor.__rdiv__",
       "torch.reciprocal(pos)"),
    _r("rsqrt", "elementwise", "float32", "rsqrt", "torch.rsqrt Tensor.rsqrt", "torch.rsqrt(pos)"),
    _r("acos", "elementwise", "float32", "acos", "torch.acos Tensor.acos torch.arccos",
       "torch.acos(unit)", "F.acos", "F.acos(unit)"),
    _r("asin", "elementwise", "float32", "asin", "torch.asin Tensor.asin torch.arcsin",
       "torch.asin(unit)", "F.asin", "F.asin(unit)"),
    _r("cosh", "elementwise", "float32", "cosh", "torch.cosh Tensor.cosh", "torch.cosh(x)",
       "F.cosh", "F.cosh(x)"),
    _r("sinh", "elementwise", "float32", "sinh", "torch.sinh Tensor.sinh", "torch.sinh(x)",
       "F.sinh", "F.sinh(x)"),
    _r("tan", "elementwise", "float32", "tan", "torch.tan Tensor.tan", "torch.tan(unit)",
       "F.tan", "F.tan(unit)"),
    _r("erfinv", "elementwise", "float32", "erfinv", "torch.erfinv Tensor.erfinv"
       " torch.special.erfinv", "torch.erfinv(unit)"),
    _r("atan2", "elementwise", "promote", "atan2", "torch.atan2 Tensor.atan2 torch.arctan2",
       "torch.atan2(x, y)", "F.atan2", "F.atan2(x, y)",
       reason="MegEngine: its autocast computes ATAN2 in float32; the adapter returns the"
              " widest input dtype (computed in float32)."),
    _r("addcmul", "elementwise", "promote", "addcmul", "torch.addcmul Tensor.addcmul",
       "torch.addcmul(x, y, z)"),
    _r("addcdiv", "elementwise", "promote", "addcdiv", "torch.addcdiv Tensor.addcdiv",
       "torch.addcdiv(x, y, pos)"),
    _r("cross product", "elementwise", "promote", "cross", "torch.cross Tensor.cross",
       "torch.cross(tri, tri2, dim=1)"),
    _r("add", "elementwise", "input", "", "torch.add Tensor.add Tensor.__add__",
       "torch.add(x, y)", "F.add Tensor.__add__", "F.add(x, y)", mixed=True),
    _r("multiply", "elementwise", "input", "", "torch.mul Tensor.mul Tensor.__mul__",
       "torch.mul(x, y)", "F.mul Tensor.__mul__", "F.mul(x, y)", mixed=True),
    _r("divide", "elementwise", "input", "", "torch.div Tensor.div Tensor.__truediv__",
       "torch.div(x, pos)", "F.div Tensor.__truediv__ Tensor.__rtruediv__", "F.div(x, pos)",
       reason="MegEngine: its autocast computes TRUE_DIV in float32; the adapter computes"
              " it so and returns the input's dtype.", mixed=True),
    _r("sqrt", "elementwise", "input", "", "torch.sqrt Tensor.sqrt", "torch.sqrt(pos)",
       "F.sqrt", "F.sqrt(pos)",
       reason="MegEngine: its autocast computes SQRT in float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("sin", "elementwise", "input", "", "torch.sin Tensor.sin", "torch.sin(x)",
       "F.sin", "F.sin(x)",
       reason="MegEngine: its autocast computes SIN in float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("cos", "elementwise", "input", "", "torch.cos Tensor.cos", "torch.cos(x)",
       "F.cos", "F.cos(x)",
       reason="MegEngine: its autocast computes COS in float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("atan", "elementwise", "input", "", "torch.atan Tensor.atan", "torch.atan(x)",
       "F.atan", "F.atan(x)"),
    _r("asinh", "elementwise", "input", "", "torch.asinh Tensor.asinh", "torch.asinh(x)",
       "F.asinh", "F.asinh(x)",
       reason="MegEngine: its autocast computes ASINH in float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("acosh", "elementwise", "input", "", "torch.acosh Tensor.acosh", "torch.acosh(big)",
       "F.acosh", "F.acosh(big)",
       reason="MegEngine: its autocast computes ACOSH in float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("atanh", "elementwise", "input", "", "torch.atanh Tensor.atanh", "torch.atanh(unit)",
       "F.atanh", "F.atanh(unit)",
       reason="MegEngine: its autocast computes ATANH in float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("logaddexp", "elementwise", "input", "", "torch.logaddexp Tensor.logaddexp",
       "torch.logaddexp(x, y)", "F.logaddexp", "F.logaddexp(x, y)",
       reason="MegEngine: its autocast computes LOG_SUM_EXP in float32; the adapter"
              " returns the input's dtype (computed in float32)."),
    _r("abs", "elementwise", "input", "", "torch.abs Tensor.abs", "torch.abs(x)", "F.abs",
       "F.abs(x)"),
    _r("square", "elementwise", "float32", "", "torch.square Tensor.square", "torch.square(x)",
       "F.square", "F.square(x)",
       reason="torch runs square as pow(x, 2), which torch's CUDA autocast computes in"
              " float32."),
    _r("maximum", "elementwise", "input", "", "torch.maximum Tensor.maximum",
       "torch.maximum(x, y)", "F.maximum", "F.maximum(x, y)", mixed=True),
    _r("clamp", "elementwise", "input", "", "torch.clamp Tensor.clamp torch.clip",
       "torch.clamp(x, -0.5, 0.5)", "F.clip", "F.clip(x, -0.5, 0.5)"),
    _r("where", "elementwise", "input", "", "torch.where", "torch.where(t01 > 0.5, x, y)",
       "F.where", "F.where(t01 > 0.5, x, y)", mixed=True),
    # -- activations --------------------------------------------------------------------------
    _r("relu", "activation", "input", "", "F.relu torch.relu Tensor.relu", "F.relu(x)",
       "F.relu F.nn.relu", "F.relu(x)"),
    _r("sigmoid", "activation", "input", "", "F.sigmoid torch.sigmoid Tensor.sigmoid",
       "torch.sigmoid(x)", "F.sigmoid F.nn.sigmoid", "F.sigmoid(x)"),
    _r("tanh", "activation", "input", "", "F.tanh torch.tanh Tensor.tanh", "torch.tanh(x)",
       "F.tanh", "F.tanh(x)"),
    _r("gelu", "activation", "input", "", "F.gelu", "F.gelu(x)", "F.gelu F.nn.gelu",
       "F.gelu(x)"),
    _r("silu", "activation", "input", "", "F.silu", "F.silu(x)", "F.silu F.nn.silu",
       "F.silu(x)"),
    _r("leaky_relu", "activation", "input", "", "F.leaky_relu", "F.leaky_relu(x, 0.1)",
       "F.leaky_relu F.nn.leaky_relu", "F.leaky_relu(x, 0.1)"),
    _r("relu6", "activation", "input", "", "F.relu6", "F.relu6(x)", "F.relu6 F.nn.relu6",
       "F.relu6(x)"),
    _r("hardswish", "activation", "input", "", "F.hardswish", "F.hardswish(x)",
       "F.hswish F.nn.hswish", "F.hswish(x)"),
    _r("hardsigmoid", "activation", "input", "", "F.hardsigmoid", "F.hardsigmoid(x)",
       "F.hsigmoid F.nn.hsigmoid", "F.hsigmoid(x)",
       reason="MegEngine: its autocast computes HSIGMOID in float32; the adapter returns"
              " the input's dtype (computed in float32)."),
    _r("logsigmoid", "activation", "input", "", "F.logsigmoid", "F.logsigmoid(x)",
       "F.logsigmoid F.nn.logsigmoid", "F.logsigmoid(x)",
       reason="MegEngine: its autocast computes LOGSIGMOID in float32; the adapter returns"
              " the input's dtype (computed in float32)."),
    _r("softplus", "activation", "float32", "softplus", "F.softplus", "F.softplus(x)",
       "F.softplus F.nn.softplus", "F.softplus(x)"),
    _r("softmax", "activation", "float32", "softmax.int",
       "F.softmax torch.softmax Tensor.softmax torch.special.softmax F.softmin",
       "F.softmax(x, -1)", "F.softmax F.nn.softmax", "F.softmax(x, -1)",
       reason="MegEngine: its Softmax op keeps a float16 input in float16; the adapter"
              " casts the input to float32."),
    _r("log-softmax", "activation", "float32", "log_softmax.int",
       "F.log_softmax torch.log_softmax Tensor.log_softmax torch.special.log_softmax",
       "F.log_softmax(x, -1)", "F.logsoftmax F.nn.logsoftmax", "F.logsoftmax(x, -1)"),
    # -- reductions ------------------------------------------------------------------------
    _r("sum", "reduction", "float32", "sum sum.dim_IntList", "torch.sum Tensor.sum",
       "torch.sum(x, 1)", "F.sum Tensor.sum F.nn.sum", "F.sum(x, 1)",
       reason="MegEngine: its Reduce SUM keeps the input's dtype; the adapter casts a"
              " low-precision input to float32."),
    _r("mean", "reduction", "input", "", "torch.mean Tensor.mean", "torch.mean(x, 1)",
       "F.mean Tensor.mean", "F.mean(x, 1)",
       reason="MegEngine: its Reduce MEAN is always float32; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("prod", "reduction", "float32", "prod prod.dim_int", "torch.prod Tensor.prod",
       "torch.prod(pos, 1)", "F.prod Tensor.prod", "F.prod(pos, 1)",
       reason="MegEngine: its Reduce PRODUCT keeps the input's dtype; the adapter casts"
              " a low-precision input to float32."),
    _r("cumsum", "reduction", "float32", "cumsum", "torch.cumsum Tensor.cumsum",
       "torch.cumsum(x, 1)", "F.cumsum", "F.cumsum(x, 1)",
       reason="MegEngine: its Cumsum keeps the input's dtype; the adapter casts a"
              " low-precision input to float32."),
    _r("cumprod", "reduction", "float32", "cumprod", "torch.cumprod Tensor.cumprod",
       "torch.cumprod(pos, 1)"),
    _r("logsumexp", "reduction", "float32", "logsumexp",
       "torch.logsumexp Tensor.logsumexp torch.special.logsumexp",
       "torch.logsumexp(x, 1)", "F.logsumexp", "F.logsumexp(x, 1)"),
    _r("max", "reduction", "input", "", "torch.amax Tensor.amax", "torch.amax(x, 1)",
       "F.max Tensor.max", "F.max(x, 1)"),
    _r("min", "reduction", "input", "", "torch.amin Tensor.amin", "torch.amin(x, 1)",
       "F.min Tensor.min", "F.min(x, 1)"),
    _r("variance", "reduction", "input", "", "torch.var Tensor.var", "torch.var(x, 1)",
       "F.var Tensor.var", "F.var(x, 1)",
       reason="MegEngine: its var is a mean of squares, float32 under its autocast; the"
              " adapter returns the input's dtype (computed in float32)."),
    _r("standard deviation", "reduction", "input", "", "torch.std Tensor.std",
       "torch.std(x, 1)", "F.std", "F.std(x, 1)",
       reason="MegEngine: its std is float32 under its autocast; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("quantile", "reduction", "input", "quantile quantile.scalar nanquantile"
       " nanquantile.scalar", "torch.quantile Tensor.quantile torch.nanquantile"
       " Tensor.nanquantile", "torch.quantile(x, 0.5, dim=1)",
       cuda_low=False),
    _r("trace", "reduction", "input", "trace", "torch.trace Tensor.trace", "torch.trace(sq)"),
    # -- norms ------------------------------------------------------------------------------
    _r("layer norm", "norm", "float32", "layer_norm native_layer_norm",
       "F.layer_norm torch.layer_norm torch.native_layer_norm",
       "F.layer_norm(x, (8,), ln_w, ln_b)", "F.nn.layer_norm",
       "F.nn.layer_norm(x, (8,), True, ln_w, ln_b)"),
    _r("group norm", "norm", "float32", "group_norm", "F.group_norm torch.group_norm",
       "F.group_norm(img, 2, ch_w, ch_b)", "F.nn.group_norm",
       "F.nn.group_norm(img, 2, True, ch_w.reshape(1, 2, 1, 1), ch_b.reshape(1, 2, 1, 1))"),
    _r("RMS norm", "norm", "float32", "rms_norm", "F.rms_norm torch.rms_norm",
       "F.rms_norm(x, (8,), ln_w)"),
    _r("batch norm", "norm", "input", "", "F.batch_norm torch.batch_norm",
       "F.batch_norm(img, ch_mean, ch_var, ch_w, ch_b)",
       "F.nn.batch_norm", "F.nn.batch_norm(img, ch_mean.reshape(1, 2, 1, 1),"
       " ch_var.reshape(1, 2, 1, 1), ch_w.reshape(1, 2, 1, 1), ch_b.reshape(1, 2, 1, 1),"
       " training=False)",
       reason="MegEngine: its autocast casts a float32 input down to float16, and its batch"
              " norm of a float16 input with float32 weights returns float32 input"
              " gradients and float16 bias gradients (with or without its autocast); the"
              " adapter computes a float16 input in float32 and returns float16, and runs a"
              " float32 input without autocast.", follows_first=True),
    _r("instance norm", "norm", "input", "", "F.instance_norm torch.instance_norm",
       "F.instance_norm(img)", "F.nn.instance_norm", "F.nn.instance_norm(img, False)"),
    _r("local response norm", "norm", "float32", "", "F.local_response_norm",
       "F.local_response_norm(img, 2)", "F.nn.local_response_norm",
       "F.nn.local_response_norm(img, 3)"),
    _r("vector norm", "norm", "float32", "linalg_vector_norm norm.Scalar norm.ScalarOpt_dim"
       " frobenius_norm.dim",
       "torch.linalg.vector_norm torch.linalg.norm torch.norm Tensor.norm torch.frobenius_norm",
       "torch.linalg.vector_norm(x, dim=1)", "F.norm", "F.norm(x, axis=1)"),
    _r("matrix norm", "norm", "float32", "linalg_matrix_norm linalg_matrix_norm.str_ord",
       "torch.linalg.matrix_norm", "torch.linalg.matrix_norm(x)"),
    _r("nuclear norm", "norm", "float32", "nuclear_norm nuclear_norm.dim",
       "torch.nuclear_norm", "torch.nuclear_norm(sq)"),
    _r("normalize", "norm", "float32", "", "F.normalize", "F.normalize(x, dim=1)",
       "F.normalize F.nn.normalize", "F.normalize(x, axis=1)"),
    _r("renorm", "norm", "float32", "renorm", "torch.renorm Tensor.renorm",
       "torch.renorm(x, 2, 0, 1.0)"),
    _r("cosine similarity", "norm", "float32", "cosine_similarity", "F.cosine_similarity"
       " torch.cosine_similarity", "F.cosine_similarity(x, y)"),
    _r("distance", "norm", "float32", "dist cdist pdist", "torch.dist torch.cdist F.pdist"
       " torch.pdist F.pairwise_distance", "torch.cdist(x, y)"),
    # -- pooling, resampling, padding -------------------------------------------------------
    _r("max pool", "pool", "input", "", "F.max_pool2d torch.max_pool2d F.max_pool1d",
       "F.max_pool2d(img, 2)", "F.max_pool2d F.nn.max_pool2d", "F.max_pool2d(img, 2)",
       reason="MegEngine CPU: its float16 max pooling returns wrong values for almost"
              " every output; the adapter pools in float32 and returns float16.",
       float32_compute="megengine-cpu"),
    _r("average pool", "pool", "input", "", "F.avg_pool2d F.avg_pool1d",
       "F.avg_pool2d(img, 2)", "F.avg_pool2d F.nn.avg_pool2d", "F.avg_pool2d(img, 2)"),
    _r("adaptive max pool", "pool", "input", "", "F.adaptive_max_pool2d",
       "F.adaptive_max_pool2d(img, 1)", "F.adaptive_max_pool2d F.nn.adaptive_max_pool2d",
       "F.adaptive_max_pool2d(img, (1, 1))",
       reason="MegEngine CPU: as max pool, pooled in float32.",
       float32_compute="megengine-cpu"),
    _r("global average pool", "pool", "input", "", "F.adaptive_avg_pool2d",
       "F.adaptive_avg_pool2d(img, 1)", "F.adaptive_avg_pool2d F.nn.adaptive_avg_pool2d",
       "F.adaptive_avg_pool2d(img, (1, 1))",
       reason="MegEngine CPU: its float16 adaptive_avg_pool2d is wrong on small inputs;"
              " the adapter pools in float32 and returns float16.",
       float32_compute="megengine-cpu"),
    _r("average pool 3-d", "pool", "input", "avg_pool3d", "F.avg_pool3d",
       "F.avg_pool3d(vol, 2)"),
    _r("adaptive average pool 3-d", "pool", "input", "adaptive_avg_pool3d",
       "F.adaptive_avg_pool3d", "F.adaptive_avg_pool3d(vol, 1)"),
    _r("max pool 3-d", "pool", "input", "max_pool3d", "F.max_pool3d torch.max_pool3d",
       "F.max_pool3d(vol, 2)"),
    _r("adaptive max pool 3-d", "pool", "input", "adaptive_max_pool3d",
       "F.adaptive_max_pool3d", "F.adaptive_max_pool3d(vol, 1)"),
    _r("fractional max pool", "pool", "input", "fractional_max_pool2d fractional_max_pool3d",
       "F.fractional_max_pool2d F.fractional_max_pool3d",
       "F.fractional_max_pool2d(img, 2, output_size=2, _random_samples=rs)"),
    _r("max unpool", "pool", "input", "max_unpool2d max_unpool3d",
       "F.max_unpool2d F.max_unpool3d",
       "F.max_unpool2d(*F.max_pool2d(img, 2, return_indices=True), 2)"),
    _r("interpolate nearest", "resample", "float32",
       "upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d"
       " _upsample_nearest_exact2d _upsample_nearest_exact3d",
       "F.interpolate F.upsample F.upsample_nearest",
       "F.interpolate(img, scale_factor=2, mode='nearest')", "F.nn.interpolate",
       "F.nn.interpolate(img, scale_factor=2, mode='nearest')"),
    _r("interpolate linear", "resample", "float32",
       "upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d",
       "F.interpolate F.upsample F.upsample_bilinear",
       "F.interpolate(img, scale_factor=2, mode='bilinear')", "F.nn.interpolate",
       "F.nn.interpolate(img, scale_factor=2, mode='bilinear')"),
    _r("interpolate bicubic", "resample", "float32",
       "upsample_bicubic2d _upsample_bicubic2d_aa", "F.interpolate",
       "F.interpolate(img, scale_factor=2, mode='bicubic')", "F.nn.interpolate",
       "F.nn.interpolate(img, scale_factor=2, mode='bicubic')"),
    _r("grid sample", "resample", "promote",
       "grid_sampler grid_sampler_2d grid_sampler_3d _grid_sampler_2d_cpu_fallback",
       "F.grid_sample torch.grid_sampler", "F.grid_sample(img, grid, align_corners=False)",
       fake_cuda="fake CUDA runs grid_sampler_2d's Python decomposition, whose indexing needs a CUDA device guard that a CPU build lacks"),
    _r("reflection pad", "pad", "input", "reflection_pad1d reflection_pad2d",
       "F.pad", "F.pad(img, (1, 1, 1, 1), mode='reflect')", "F.nn.pad",
       "F.nn.pad(img, ((0, 0), (0, 0), (1, 1), (1, 1)), mode='reflect')"),
    _r("replication pad", "pad", "input", "replication_pad1d replication_pad2d"
       " replication_pad3d", "F.pad", "F.pad(img, (1, 1, 1, 1), mode='replicate')",
       "F.nn.pad", "F.nn.pad(img, ((0, 0), (0, 0), (1, 1), (1, 1)), mode='edge')"),
    # -- losses -------------------------------------------------------------------------------
    _r("cross-entropy", "loss", "float32", "cross_entropy_loss", "F.cross_entropy",
       "F.cross_entropy(x, labels)", "F.nn.cross_entropy F.loss.cross_entropy",
       "F.nn.cross_entropy(x, labels)"),
    _r("negative log-likelihood", "loss", "float32", "nll_loss nll_loss2d", "F.nll_loss",
       "F.nll_loss(x, labels)"),
    _r("binary cross-entropy with logits", "loss", "float32",
       "binary_cross_entropy_with_logits", "F.binary_cross_entropy_with_logits",
       "F.binary_cross_entropy_with_logits(x, t01)", "F.nn.binary_cross_entropy",
       "F.nn.binary_cross_entropy(x, t01, with_logits=True)",
       megengine_when="with_logits=True"),
    _r("binary cross-entropy", "loss", "refuse", "binary_cross_entropy",
       "F.binary_cross_entropy torch.binary_cross_entropy",
       "F.binary_cross_entropy(prob, t01)", "F.nn.binary_cross_entropy",
       "F.nn.binary_cross_entropy(prob, t01, with_logits=False)",
       megengine_when="with_logits=False",
       reason="torch CPU runs it in float32, MegEngine in the input's dtype: the adapters"
              " raise CUDA's error, which names the fix (the loss with logits).",
       fuzz=False),
    _r("MSE", "loss", "float32", "mse_loss", "F.mse_loss", "F.mse_loss(x, target)",
       "F.nn.square_loss F.loss.square_loss", "F.nn.square_loss(x, target)"),
    _r("L1 loss", "loss", "float32", "l1_loss", "F.l1_loss", "F.l1_loss(x, target)",
       "F.nn.l1_loss F.loss.l1_loss", "F.nn.l1_loss(x, target)"),
    _r("smooth L1 loss", "loss", "float32", "smooth_l1_loss", "F.smooth_l1_loss",
       "F.smooth_l1_loss(x, target)"),
    _r("Huber loss", "loss", "float32", "huber_loss", "F.huber_loss", "F.huber_loss(x, target)"),
    _r("KL divergence", "loss", "float32", "kl_div", "F.kl_div",
       "F.kl_div(x, tpos, reduction='batchmean')"),
    _r("Poisson NLL loss", "loss", "float32", "poisson_nll_loss", "F.poisson_nll_loss",
       "F.poisson_nll_loss(x, tpos)"),
    _r("hinge embedding loss", "loss", "float32", "hinge_embedding_loss",
       "F.hinge_embedding_loss", "F.hinge_embedding_loss(x, sign)"),
    _r("soft margin loss", "loss", "float32", "soft_margin_loss", "F.soft_margin_loss",
       "F.soft_margin_loss(x, sign)"),
    _r("margin ranking loss", "loss", "float32", "margin_ranking_loss",
       "F.margin_ranking_loss", "F.margin_ranking_loss(x, y, sign)"),
    _r("multi-margin loss", "loss", "float32", "multi_margin_loss", "F.multi_margin_loss",
       "F.multi_margin_loss(x, labels)"),
    _r("multilabel margin loss", "loss", "float32",
       "multilabel_margin_loss multilabel_margin_loss_forward", "F.multilabel_margin_loss",
       "F.multilabel_margin_loss(x, ml_labels)"),
    _r("cosine embedding loss", "loss", "float32", "cosine_embedding_loss",
       "F.cosine_embedding_loss", "F.cosine_embedding_loss(x, y, sign4)"),
    _r("triplet margin loss", "loss", "float32", "triplet_margin_loss",
       "F.triplet_margin_loss", "F.triplet_margin_loss(x, y, z)"),
    _r("CTC loss", "loss", "input", "ctc_loss.IntList ctc_loss.Tensor", "F.ctc_loss",
       "F.ctc_loss(logp, ctc_targets, ctc_in_len, ctc_tg_len)", "F.nn.ctc_loss",
       "F.nn.ctc_loss(logp, ctc_in_len, ctc_targets, ctc_tg_len)", fuzz=False,
       fake_cuda="torch 2.13 has no meta kernel for _use_cudnn_ctc_loss on CUDA, so fake CUDA cannot run it",
       cuda_low=False),
    # -- promote: mixed inputs to the widest ----------------------------------------------------
    _r("dot", "matmul", "promote", "dot vdot", "torch.dot Tensor.dot torch.vdot Tensor.vdot",
       "torch.dot(v, v2)", "F.dot", "F.dot(v, v2)"),
    _r("bilinear", "matmul", "promote", "bilinear", "F.bilinear torch.bilinear",
       "F.bilinear(x, y, bw, b)"),
    _r("tensordot", "matmul", "promote", "tensordot", "torch.tensordot",
       "torch.tensordot(x, y, dims=([1], [1]))"),
    _r("index_put", "indexing", "promote", "index_put", "torch.index_put Tensor.index_put",
       "torch.index_put(x, (rows4,), y)"),
    _r("scatter_add", "indexing", "promote", "scatter_add", "torch.scatter_add"
       " Tensor.scatter_add", "torch.scatter_add(x, 1, cols, y)"),
    _r("index_copy", "indexing", "input", "index_copy", "torch.index_copy Tensor.index_copy",
       "torch.index_copy(x, 0, rows4, y)"),
    _r("concatenate", "indexing", "input", "cat", "torch.cat torch.concat torch.concatenate",
       "torch.cat([x, y])", "F.concat", "F.concat([x, y])", mixed=True),
    _r("stack", "indexing", "input", "stack", "torch.stack", "torch.stack([x, y])",
       "F.stack", "F.stack([x, y])", mixed=True),
    _r("embedding", "indexing", "input", "", "F.embedding torch.embedding",
       "F.embedding(lookup, table)", "F.embedding F.nn.embedding",
       "F.embedding(lookup, table)"),
    # -- linear algebra ---------------------------------------------------------------------
    _r("matrix inverse", "linalg", "input",
       "inverse linalg_inv linalg_inv_ex pinverse linalg_tensorinv",
       "torch.inverse Tensor.inverse torch.linalg.inv torch.linalg.inv_ex torch.pinverse"
       " torch.linalg.pinv torch.linalg.tensorinv", "torch.linalg.inv(sq)", "F.matinv",
       "F.matinv(sq)", fuzz=False,
       cuda_low=False),
    _r("linear solve", "linalg", "input",
       "linalg_solve lu_solve _lu_with_info triangular_solve cholesky_solve linalg_lstsq"
       " linalg_tensorsolve",
       "torch.linalg.solve torch.lu_solve torch.triangular_solve torch.cholesky_solve"
       " torch.linalg.lstsq torch.linalg.tensorsolve torch.linalg.solve_ex",
       "torch.linalg.solve(sq, y4)", fuzz=False,
       cuda_low=False),
    _r("Cholesky", "linalg", "input",
       "cholesky linalg_cholesky linalg_cholesky_ex cholesky_inverse",
       "torch.cholesky torch.linalg.cholesky torch.linalg.cholesky_ex torch.cholesky_inverse",
       "torch.linalg.cholesky(spd)", fuzz=False,
       cuda_low=False),
    _r("QR", "linalg", "input",
       "qr linalg_qr geqrf orgqr ormqr linalg_householder_product",
       "torch.qr torch.linalg.qr torch.geqrf torch.orgqr torch.ormqr"
       " torch.linalg.householder_product", "torch.linalg.qr(sq)[1].abs()", fuzz=False,
       cuda_low=False),
    _r("SVD", "linalg", "input",
       "svd linalg_svd linalg_svdvals linalg_matrix_rank linalg_matrix_rank.atol_rtol_float"
       " linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.tol_tensor linalg_cond"
       " linalg_cond.p_str",
       "torch.svd torch.linalg.svd torch.linalg.svdvals torch.linalg.matrix_rank"
       " torch.linalg.cond", "torch.linalg.svdvals(sq)", "F.svd",
       "F.svd(sq)[1]", fuzz=False,
       cuda_low=False,
       float32_compute="megengine"),
    _r("eigendecomposition", "linalg", "input",
       "linalg_eig linalg_eigvals linalg_eigh linalg_eigvalsh",
       "torch.linalg.eig torch.linalg.eigvals torch.linalg.eigh torch.linalg.eigvalsh",
       "torch.linalg.eigvalsh(spd)", fuzz=False,
       cuda_low=False),
    # -- spectral and complex ---------------------------------------------------------------
    _r("FFT", "spectral", "input",
       "fft_fft fft_fft2 fft_fftn fft_hfft fft_ifft fft_ifft2 fft_ifftn fft_ihfft fft_irfft"
       " fft_irfft2 fft_irfftn fft_rfft fft_rfft2 fft_rfftn stft stft.center",
       "torch.fft.fft torch.fft.fft2 torch.fft.fftn torch.fft.hfft torch.fft.ifft"
       " torch.fft.ifft2 torch.fft.ifftn torch.fft.ihfft torch.fft.irfft torch.fft.irfft2"
       " torch.fft.irfftn torch.fft.rfft torch.fft.rfft2 torch.fft.rfftn torch.stft",
       "torch.fft.rfft(x).abs()", fuzz=False,
       cuda_low=False, no_bfloat16=True),
    _r("complex from real", "spectral", "input", "view_as_complex polar",
       "torch.view_as_complex torch.polar torch.complex", "torch.view_as_complex(pair).abs()",
       fuzz=False, megengine_absent="view_as_complex",
       reason="MegEngine 1.13 has F.complex and F.polar, but its complex tensors fail in"
              " eager mode (an assertion in its imperative runtime) with or without"
              " autocast.",
       cuda_low=False, no_bfloat16=True),
    # -- quantization -------------------------------------------------------------------------
    _r("fake quantize", "quantization", "input", "fake_quantize_per_tensor_affine",
       "torch.fake_quantize_per_tensor_affine",
       "torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)", fuzz=False,
       fake_cuda="torch 2.13 has no meta kernel for fake_quantize_per_tensor_affine_cachemask on CUDA, so fake CUDA cannot run it"),
)


# What each framework's own autocast gives a row where that differs from the row's rule,
# as tests/contract/test_dtype_table.py measures it (with torch.autocast("cpu") on torch
# TABLE_TORCH, and megengine.amp.autocast on MegEngine TABLE_MEGENGINE): the adapters act
# on these rows. The words: "low", "float32", "input" as the rules; "error" where the op
# raises; "mixed: ..." what mixed float32/low inputs give.
_TORCH_CPU: dict[str, str] = {
    'matrix-vector product': 'input',
    'addmv': 'input',
    'addr': 'input',
    'multi-dot': 'float32 input: low, low input: error',
    'LSTM cell': 'input',
    'GRU cell': 'input',
    'LSTM layer': 'float16: float32 input: error, low input: low; bfloat16: low',
    'exp': 'input',
    'expm1': 'input',
    'log': 'input',
    'log10': 'input',
    'log2': 'input',
    'log1p': 'input',
    'pow': 'input',
    'reciprocal': 'input',
    'rsqrt': 'input',
    'acos': 'input',
    'asin': 'input',
    'cosh': 'input',
    'sinh': 'input',
    'tan': 'input',
    'erfinv': 'input',
    'cross product': 'input, mixed: error',
    'square': 'input',
    'softplus': 'input',
    'softmax': 'input',
    'log-softmax': 'input',
    'sum': 'input',
    'cumsum': 'input',
    'cumprod': 'input',
    'logsumexp': 'input',
    'quantile': 'float32',
    'trace': 'float32',
    'layer norm': 'input',
    'group norm': 'input',
    'RMS norm': 'input',
    'vector norm': 'input',
    'matrix norm': 'input',
    'nuclear norm': 'float32 input: float32, low input: error',
    'normalize': 'input',
    'renorm': 'input',
    'cosine similarity': 'input',
    'average pool 3-d': 'float32',
    'adaptive average pool 3-d': 'float32',
    'max pool 3-d': 'float32',
    'adaptive max pool 3-d': 'float32',
    'fractional max pool': 'float32',
    'max unpool': 'float32',
    'interpolate nearest': 'input',
    'interpolate linear': 'input',
    'interpolate bicubic': 'input',
    'grid sample': 'float32, mixed: float32',
    'reflection pad': 'float32',
    'replication pad': 'float32',
    'binary cross-entropy': 'float32',
    'CTC loss': 'float32',
    'dot': 'input, mixed: error',
    'bilinear': 'float32 input: float32, low input: error, mixed: error',
    'tensordot': 'low, mixed: error',
    'index_put': 'input, mixed: error',
    'scatter_add': 'input, mixed: error',
    'matrix inverse': 'float32',
    'linear solve': 'float32',
    'Cholesky': 'float32',
    'QR': 'float32',
    'SVD': 'float32',
    'eigendecomposition': 'float32',
    'FFT': 'float32',
    'complex from real': 'float32',
    'fake quantize': 'float32',
}
_MEGENGINE: dict[str, str] = {
    'deformable conv2d': 'error',
    'conv3d': 'float32',
    'conv_transpose3d': 'float32',
    'prelu': 'float32',
    'atan2': 'float32, mixed: float32',
    'divide': 'float32, mixed: float32',
    'sqrt': 'float32',
    'sin': 'float32',
    'cos': 'float32',
    'atan': 'float32',
    'asinh': 'float32',
    'acosh': 'float32',
    'atanh': 'float32',
    'logaddexp': 'float32',
    'square': 'input',
    'hardsigmoid': 'float32',
    'logsigmoid': 'float32',
    'softmax': 'input',
    'sum': 'input',
    'mean': 'float32',
    'prod': 'input',
    'cumsum': 'input',
    'variance': 'float32',
    'standard deviation': 'float32',
    'batch norm': 'low',
    'local response norm': 'crashes the process',
    'binary cross-entropy': 'float32',
    'CTC loss': 'float32',
    'dot': 'input, mixed: error',
    'SVD': 'float32 input: float32, low input: error',
}
ROWS = tuple(replace(r, torch_cpu=_TORCH_CPU.get(r.name, ""),
                     megengine_native=_MEGENGINE.get(r.name, "")) for r in ROWS)
_BY_NAME = {r.name: r for r in ROWS}


def row(name: str) -> Row:
    return _BY_NAME[name]


# The AutocastCUDA / AutocastCPU registrations of the torch the rows were derived from
# (``torch._C._dispatch_get_registrations_for_dispatch_key``, "aten::" dropped, a CPU
# build). The torch adapter compares them with the running torch's: a row whose op is
# registered differently there is handled by the contract's function mode on that
# device too.
TABLE_TORCH = "2.13.0"
TABLE_MEGENGINE = "1.13.0"
CUDA_REGISTRATIONS: frozenset[str] = frozenset("""
    _convolution _convolution.deprecated _scaled_dot_product_flash_attention
    _thnn_fused_gru_cell _thnn_fused_lstm_cell _upsample_bicubic2d_aa
    _upsample_bilinear2d_aa _upsample_nearest_exact1d _upsample_nearest_exact2d
    _upsample_nearest_exact3d acos addbmm addcdiv addcmul addmm addmv addr asin
    atan2 baddbmm bilinear binary_cross_entropy binary_cross_entropy_with_logits bmm
    cdist chain_matmul conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution cosh
    cosine_embedding_loss cosine_similarity cross cudnn_convolution
    cudnn_convolution_transpose cumprod cumsum dist dot einsum erfinv exp expm1
    frobenius_norm.dim grid_sampler group_norm gru_cell hinge_embedding_loss
    huber_loss index_put kl_div l1_loss layer_norm linalg_matrix_norm
    linalg_matrix_norm.str_ord linalg_multi_dot linalg_vecdot linalg_vector_norm
    linear log log10 log1p log2 log_softmax.int logsumexp lstm_cell
    margin_ranking_loss matmul mm mse_loss multi_margin_loss multilabel_margin_loss
    mv native_layer_norm nll_loss nll_loss2d norm.Scalar norm.ScalarOpt_dim
    nuclear_norm nuclear_norm.dim pdist poisson_nll_loss pow.Scalar
    pow.Tensor_Scalar pow.Tensor_Tensor prelu prod prod.dim_int reciprocal renorm
    rms_norm rnn_relu_cell rnn_tanh_cell rsqrt scaled_dot_product_attention
    scatter_add sinh smooth_l1_loss soft_margin_loss softmax.int softplus sum
    sum.dim_IntList tan tensordot triplet_margin_loss upsample_bicubic2d
    upsample_bilinear2d upsample_linear1d upsample_nearest1d upsample_nearest2d
    upsample_nearest3d upsample_trilinear3d vdot
""".split())
CPU_REGISTRATIONS: frozenset[str] = frozenset("""
    _addmm_activation _convolution.deprecated _grid_sampler_2d_cpu_fallback
    _lu_with_info _native_multi_head_attention adaptive_avg_pool3d
    adaptive_max_pool3d addbmm addmm avg_pool3d baddbmm binary_cross_entropy
    binary_cross_entropy_with_logits bmm cat cdist cholesky cholesky_inverse
    cholesky_solve conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding
    conv_tbc conv_transpose1d conv_transpose2d.input conv_transpose3d.input
    cosine_embedding_loss cross_entropy_loss ctc_loss.IntList ctc_loss.Tensor
    fake_quantize_per_tensor_affine fft_fft fft_fft2 fft_fftn fft_hfft fft_ifft
    fft_ifft2 fft_ifftn fft_ihfft fft_irfft fft_irfft2 fft_irfftn fft_rfft fft_rfft2
    fft_rfftn fractional_max_pool2d fractional_max_pool3d geqrf grid_sampler
    grid_sampler_2d grid_sampler_3d hinge_embedding_loss huber_loss index_copy
    inverse kl_div l1_loss linalg_cholesky linalg_cholesky_ex linalg_cond
    linalg_cond.p_str linalg_eig linalg_eigh linalg_eigvals linalg_eigvalsh
    linalg_householder_product linalg_inv linalg_inv_ex linalg_lstsq
    linalg_matrix_rank linalg_matrix_rank.atol_rtol_float
    linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.tol_tensor linalg_qr
    linalg_solve linalg_svd linalg_svdvals linalg_tensorinv linalg_tensorsolve
    linalg_vecdot linear lu_solve margin_ranking_loss matmul max_pool3d max_unpool2d
    max_unpool3d mkldnn_rnn_layer mm mse_loss multi_margin_loss
    multilabel_margin_loss multilabel_margin_loss_forward nanquantile
    nanquantile.scalar nll_loss nll_loss2d orgqr ormqr pinverse poisson_nll_loss
    polar prelu prod prod.dim_int qr quantile quantile.scalar reflection_pad1d
    reflection_pad2d replication_pad1d replication_pad2d replication_pad3d
    scaled_dot_product_attention smooth_l1_loss soft_margin_loss stack stft
    stft.center svd trace triangular_solve triplet_margin_loss view_as_complex
""".split())

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

def expected_dtype(rule: str, data: list[str], params: list[str], low: str) -> str:
    """The dtype a row's op gives inside an enabled block computing in ``low``, for data
    inputs of dtypes ``data`` and float32 parameters ``params`` (dtype names)."""
    if rule == "low":
        return low
    if rule == "float32":
        return "float32"
    pool = data + params if rule == "promote" else data
    return "float32" if "float32" in pool else low
