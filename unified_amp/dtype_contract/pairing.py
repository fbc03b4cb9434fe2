"""How the frameworks' public callables meet the contract's rows, as data.

The tests enumerate MegEngine's public callables (``megengine.functional`` and every
submodule, ``megengine.Tensor``'s methods and operators, in-place ones included) and
torch's (``torch``, ``torch.nn.functional``, ``torch.linalg``, ``torch.special``,
``torch.Tensor``): tests/contract/test_namespaces.py. Each MegEngine callable is either
a spelling of a row (``Row.megengine``, whose torch counterparts are the row's
``Row.torch``), or the same object as one, or listed here with the reason it has no
row. One that is neither fails the test, and so does a torch callable that the
recorded torch (``TORCH_PUBLIC``) lacks, until someone decides on it.

Every spelling of a row is proved as the row's first is (its output dtype on torch's
CPU, fake CUDA and MegEngine): its sample call is the row's with the function swapped
(``call_for``), or the one ``TORCH_CALLS`` / ``MEGENGINE_CALLS`` give where the
arguments are spelled otherwise.

Framework-free: names are strings.
"""

from __future__ import annotations

import re

# -- MegEngine callables that have no row, by reason ---------------------------------------

NO_ROW_REASONS: dict[str, str] = {
    "integer or boolean output":
        "its output is integer or boolean (indices, comparisons, masks, bit operations):"
        " autocast casts floating tensors only.",
    "creation":
        "it makes a tensor from shapes or numbers, no floating input (its dtype is an"
        " argument).",
    "layout":
        "it moves, copies or selects values without computing any (reshaping, indexing,"
        " joining by index, sorting, taking real or imaginary parts): its output has its"
        " input's dtype on both frameworks, with autocast or without, and neither"
        " framework's autocast names it.",
    "collective":
        "it communicates between processes (MegEngine's distributed functions, and"
        " sync_batch_norm, whose torch counterpart is the nn.SyncBatchNorm module"
        " only).",
    "quantized":
        "its inputs are quantized tensors (qint8/quint8), which autocast does not cast.",
    "random":
        "it draws random numbers (dropout): torch's counterpart gives its input's dtype,"
        " MegEngine's too, but the values cannot be compared.",
    "no torch counterpart":
        "torch (torch, torch.nn.functional, torch.linalg, torch.special) has no such op:"
        " detection and image-warping operators of MegEngine's (torchvision's and"
        " OpenCV's), MegEngine's own convolution variants and losses.",
    "not an op":
        "a helper, a configuration setter or getter, the runtime of an external"
        " engine (TensorRT, Atlas, Cambricon, MagicMind), or the Python object protocol"
        " (construction, hashing, pickling, repr), not an op on tensors; or not"
        " implemented (MegEngine 1.13's Tensor.__trunc__ raises NotImplementedError). Its"
        " Tensor.var is the tensor's graph variable, not a variance (eagerly: \"no"
        " fallback implementation for GetVarVal\").",
    "no working backward":
        "MegEngine 1.13's multi_head_attention: without projections its forward equals"
        " torch's F.scaled_dot_product_attention (measured 6e-8 apart in float32; a"
        " float16 input gives float16 under its autocast, a float32 input float32 where"
        " the attention row gives low), but its backward fails on the CPU (an"
        " asynchronous error, float32 and float16 alike: \"there is only cudnn"
        " implementation now\"), so the row's tests (gradients among them) cannot hold it;"
        " left out of the attention row, and unwrapped, until they can.",
    "complex":
        "MegEngine 1.13's complex tensors fail in eager mode (an assertion in its"
        " imperative runtime), with or without autocast: the row \"complex from real\""
        " is absent from MegEngine.",
}

# Spellings, by reason (the first spelling of each MegEngine function object, in the
# module that defines it; the same object's other bindings follow it).
NO_ROW: dict[str, str] = {
    "integer or boolean output": """
        F.argmax F.argmin F.argsort F.equal F.not_equal F.greater F.greater_equal F.less
        F.less_equal F.isinf F.isnan F.logical_and F.logical_not F.logical_or
        F.logical_xor F.left_shift F.right_shift F.topk_accuracy F.metric.topk_accuracy
        F.vision.nms F.one_hot
        Tensor.__eq__ Tensor.__ne__ Tensor.__lt__ Tensor.__le__ Tensor.__gt__ Tensor.__ge__
        Tensor.__and__ Tensor.__rand__ Tensor.__iand__ Tensor.__or__ Tensor.__ror__
        Tensor.__ior__ Tensor.__xor__ Tensor.__rxor__ Tensor.__ixor__ Tensor.__invert__
        Tensor.__lshift__ Tensor.__rlshift__ Tensor.__ilshift__ Tensor.__rshift__
        Tensor.__rrshift__ Tensor.__irshift__ Tensor.__bool__ Tensor.__int__
        Tensor.__index__ Tensor.__contains__ Tensor.__len__
    """,
    "creation": """
        F.arange F.eye F.full F.full_like F.linspace F.ones F.ones_like F.zeros
        F.zeros_like F.meshgrid
    """,
    "layout": """
        F.broadcast_to F.cond_take F.copy F.diag F.expand_dims F.flatten F.gather
        F.repeat F.reshape F.roll F.scatter F.split F.squeeze F.swapaxes F.tile
        F.transpose F.sort F.topk F.indexing_one_hot F.pixel_shuffle F.real F.imag
        Tensor.__getitem__ Tensor.__setitem__ Tensor.__iter__ Tensor.__pos__
        Tensor.astype Tensor.detach Tensor.flatten Tensor.reshape Tensor.transpose
        Tensor.to Tensor.numpy Tensor.item Tensor.tolist Tensor.__array__
        Tensor.__array_wrap__ Tensor.__float__ Tensor.__complex__ Tensor.__dlpack__
        Tensor.set_value Tensor.reset_zero F.utils.copy
    """,
    "collective": """
        F.distributed.all_gather F.distributed.all_reduce_max
        F.distributed.all_reduce_min F.distributed.all_reduce_sum
        F.distributed.all_to_all F.distributed.broadcast F.distributed.collective_comm
        F.distributed.gather F.distributed.reduce_scatter_sum F.distributed.reduce_sum
        F.distributed.remote_recv F.distributed.remote_send F.distributed.scatter
        F.sync_batch_norm F.nn.is_distributed
    """,
    "quantized": """
        F.quantized.batch_conv_bias_activation F.quantized.conv_bias_activation
        F.quantized.conv_transpose2d
    """,
    "random": "F.dropout",
    "no torch counterpart": """
        F.vision.correlation F.vision.cvt_color F.deformable_psroi_pooling F.vision.nvof
        F.region_restricted_conv F.remap F.vision.roi_align F.vision.roi_pooling F.warp_affine
        F.warp_perspective F.sliding_window F.sliding_window_transpose F.loss.hinge_loss
    """,
    "not an op": """
        F.debug_param.get_conv_execution_strategy
        F.debug_param.set_conv_execution_strategy F.debug_param.get_execution_strategy
        F.debug_param.set_execution_strategy F.debug_param.get_logger
        F.external.atlas_runtime_opr F.external.cambricon_runtime_opr
        F.external.extern_opr_subgraph F.external.magicmind_runtime_opr
        F.external.tensorrt_runtime_opr F.tensor_cache.get_scalar_one
        F.tensor_cache.get_scalar_two F.tensor_cache.get_scalar_zero
        F.tensor_cache.get_scalar_zero_point_five F.tensor_cache.is_tracing Tensor.graph
        Tensor.value_id Tensor.var Tensor.__trunc__ Tensor.__new__ Tensor.__init__
        Tensor.__init_subclass__ Tensor.__subclasshook__ Tensor.__hash__ Tensor.__repr__
        Tensor.__getnewargs__ Tensor.__getstate__ Tensor.__setstate__
        F.elemwise.convert_inputs F.elemwise.deprecated_func
        F.math.deprecated_kwargs_default F.nn.astensor1d F.nn.cast_tensors
        F.nn.convert_single_value F.nn.exclude_from_trace F.nn.expand_dhw F.nn.expand_hw
        F.nn.get_cudnn_version F.nn.get_default_device F.nn.is_cuda_available
        F.nn.layerPixelShuffle_traceable F.nn.subgraph F.nn.subgraph_fn
        F.tensor.as_device
    """,
    "no working backward": "F.multi_head_attention",
    "complex": "F.complex F.polar F.tensor.create_complex F.tensor.get_real F.tensor.get_imag",
}


def no_row() -> dict[str, str]:
    """Each MegEngine spelling of ``NO_ROW`` -> its reason's key."""
    return {s: reason for reason, spellings in NO_ROW.items() for s in spellings.split()}


# -- sample calls of the spellings whose arguments differ from the row's first ------------

# "{row name}|{spelling}" where one spelling serves two rows with different calls.
TORCH_CALLS: dict[str, str] = {
    "Tensor.__rmatmul__": "w.__rmatmul__(x)",
    "Tensor.__rtruediv__": "pos.__rtruediv__(1)",
    "torch.convolution":
        "torch.convolution(img, cw, cb, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)",
    "torch.native_layer_norm": "torch.native_layer_norm(x, (8,), ln_w, ln_b, 1e-5)[0]",
    "torch.batch_norm":
        "torch.batch_norm(img, ch_w, ch_b, ch_mean, ch_var, False, 0.1, 1e-5, False)",
    "torch.instance_norm":
        "torch.instance_norm(img, None, None, None, None, True, 0.1, 1e-5, False)",
    "F.pdist": "F.pdist(x)",
    "torch.pdist": "torch.pdist(x)",
    "F.max_pool1d": "F.max_pool1d(seq, 2)",
    "F.avg_pool1d": "F.avg_pool1d(seq, 2)",
    "torch.grid_sampler": "torch.grid_sampler(img, grid, 0, 0, False)",
    "torch.embedding": "torch.embedding(table, lookup)",
    "torch.linalg.inv_ex": "torch.linalg.inv_ex(sq)[0]",
    "torch.linalg.tensorinv": "torch.linalg.tensorinv(sq, ind=1)",
    "torch.linalg.lu_factor": "torch.linalg.lu_factor(sq)[0]",
    "torch.lu_solve": "torch.lu_solve(y4, *torch.linalg.lu_factor(sq))",
    "torch.triangular_solve": "torch.triangular_solve(y4, sq)[0]",
    "torch.linalg.lstsq": "torch.linalg.lstsq(sq, y4)[0]",
    "torch.linalg.tensorsolve": "torch.linalg.tensorsolve(sq, v4)",
    "torch.linalg.solve_ex": "torch.linalg.solve_ex(sq, y4)[0]",
    "torch.linalg.cholesky_ex": "torch.linalg.cholesky_ex(spd)[0]",
    "torch.orgqr": "torch.orgqr(*torch.geqrf(sq))",
    "torch.ormqr": "torch.ormqr(*torch.geqrf(sq), y4)",
    "torch.linalg.householder_product": "torch.linalg.householder_product(*torch.geqrf(sq))",
    "torch.svd": "torch.svd(sq)[1]",
    "torch.linalg.svd": "torch.linalg.svd(sq)[1]",
    "torch.linalg.eig": "torch.linalg.eig(spd)[0].real",
    "torch.linalg.eigvals": "torch.linalg.eigvals(spd).real",
    "torch.linalg.eigh": "torch.linalg.eigh(spd)[0]",
    "torch.polar": "torch.polar(pair[..., 0].abs(), pair[..., 1]).abs()",
    "torch.complex": "torch.complex(pair[..., 0], pair[..., 1]).abs()",
    "Tensor.__rdiv__": "pos.__rdiv__(1)",
    "torch._VF.chain_matmul": "torch._VF.chain_matmul([x, w, w])",
    "torch.chain_matmul": "torch.chain_matmul(x, w, w)",
    "torch._VF.norm": "torch._VF.norm(x, 2, [1])",
    "torch._VF.frobenius_norm": "torch._VF.frobenius_norm(x, [1])",
    "torch._VF.tensordot": "torch._VF.tensordot(x, y, [1], [1])",
    "torch._VF.stft": "torch._VF.stft(x, 4, 2, 4, None, False, True, True).abs()",
    "torch.stft": "torch.stft(x, 4, return_complex=True).abs()",
    "torch._C._nn.adaptive_avg_pool3d": "torch._C._nn.adaptive_avg_pool3d(vol, [1, 1, 1])",
    "torch._C._nn.adaptive_max_pool3d":
        "torch._C._nn.adaptive_max_pool3d(vol, [1, 1, 1])[0]",
    "F.fractional_max_pool3d":
        "F.fractional_max_pool3d(vol, 1, output_size=1, _random_samples=rs3)",
    "torch._C._nn.fractional_max_pool2d":
        "torch._C._nn.fractional_max_pool2d(img, [2, 2], [2, 2], rs)[0]",
    "torch._C._nn.fractional_max_pool3d":
        "torch._C._nn.fractional_max_pool3d(vol, [1, 1, 1], [1, 1, 1], rs3)[0]",
    "F.max_unpool3d": "F.max_unpool3d(*F.max_pool3d(vol, 2, return_indices=True), 2)",
    "torch._C._nn.max_unpool2d":
        "torch._C._nn.max_unpool2d(*F.max_pool2d(img, 2, return_indices=True), [4, 4])",
    "torch._C._nn.max_unpool3d":
        "torch._C._nn.max_unpool3d(*F.max_pool3d(vol, 2, return_indices=True), [2, 2, 4],"
        " [2, 2, 2], [0, 0, 0])",
    "F.upsample_nearest": "F.upsample_nearest(img, scale_factor=2)",
    "F.upsample_bilinear": "F.upsample_bilinear(img, scale_factor=2)",
    "torch._C._nn.upsample_nearest1d": "torch._C._nn.upsample_nearest1d(seq, [16])",
    "torch._C._nn.upsample_nearest2d": "torch._C._nn.upsample_nearest2d(img, [8, 8])",
    "torch._C._nn.upsample_nearest3d": "torch._C._nn.upsample_nearest3d(vol, [4, 4, 8])",
    "torch._C._nn._upsample_nearest_exact1d":
        "torch._C._nn._upsample_nearest_exact1d(seq, [16])",
    "torch._C._nn._upsample_nearest_exact2d":
        "torch._C._nn._upsample_nearest_exact2d(img, [8, 8])",
    "torch._C._nn._upsample_nearest_exact3d":
        "torch._C._nn._upsample_nearest_exact3d(vol, [4, 4, 8])",
    "torch._C._nn.upsample_linear1d": "torch._C._nn.upsample_linear1d(seq, [16], False)",
    "torch._C._nn.upsample_bilinear2d":
        "torch._C._nn.upsample_bilinear2d(img, [8, 8], False)",
    "torch._C._nn._upsample_bilinear2d_aa":
        "torch._C._nn._upsample_bilinear2d_aa(img, [8, 8], False)",
    "torch._C._nn.upsample_trilinear3d":
        "torch._C._nn.upsample_trilinear3d(vol, [4, 4, 8], False)",
    "torch._C._nn.upsample_bicubic2d": "torch._C._nn.upsample_bicubic2d(img, [8, 8], False)",
    "torch._C._nn._upsample_bicubic2d_aa":
        "torch._C._nn._upsample_bicubic2d_aa(img, [8, 8], False)",
    "torch._C._nn.reflection_pad1d": "torch._C._nn.reflection_pad1d(seq, [1, 1])",
    "torch._C._nn.reflection_pad2d": "torch._C._nn.reflection_pad2d(img, [1, 1, 1, 1])",
    "torch._C._nn.replication_pad1d": "torch._C._nn.replication_pad1d(seq, [1, 1])",
    "torch._C._nn.replication_pad2d": "torch._C._nn.replication_pad2d(img, [1, 1, 1, 1])",
    "torch._C._nn.replication_pad3d":
        "torch._C._nn.replication_pad3d(vol, [1, 1, 1, 1, 1, 1])",
}
MEGENGINE_CALLS: dict[str, str] = {
    "Tensor.__rtruediv__": "pos.__rtruediv__(1)",
    "Tensor.__rmatmul__": "w.__rmatmul__(x)",
    "F.general_norm": "F.general_norm(x, (1,), True, ln_w, ln_b)",
}

# torch spellings that code compiled by torch.compile gives torch's own CPU autocast rule
# for a low-precision input on the CPU, where eager code gets the row's (the rows' first
# spellings keep the row compiled, but the two padding rows: ``Adapt.compiled``). The
# builtins of torch._C._nn, called directly, are put in dynamo's graph without
# consulting any function mode; F.upsample and its two kin are Python functions dynamo
# inlines down to those builtins (as F.pad: ``Adapt.compiled``). Measured on torch 2.13 by
# tests/native/test_torch_compiled_dtype_table.py; eager code keeps the rows for all.
_BUILTIN = "a torch._C._nn builtin called directly: dynamo consults no function mode for it"
_INLINED = "dynamo inlines it down to torch._C._nn's builtins and consults no function mode"
_NO_KERNEL = (_BUILTIN + "; torch's CPU has no bfloat16 kernel for it, so compiled it raises"
              " on a bfloat16 input (NotImplementedError; on torch 2.7 a RuntimeError)")
COMPILED_OWN: dict[str, str] = {
    **dict.fromkeys("""
        torch._C._nn.adaptive_avg_pool3d torch._C._nn.adaptive_max_pool3d
        torch._C._nn.fractional_max_pool2d torch._C._nn.fractional_max_pool3d
        torch._C._nn.max_unpool2d torch._C._nn.max_unpool3d torch._C._nn.upsample_nearest1d
        torch._C._nn.upsample_nearest2d torch._C._nn.upsample_nearest3d
        torch._C._nn._upsample_nearest_exact1d torch._C._nn._upsample_nearest_exact2d
        torch._C._nn._upsample_nearest_exact3d torch._C._nn.upsample_linear1d
        torch._C._nn.upsample_bilinear2d torch._C._nn.upsample_trilinear3d
        torch._C._nn.upsample_bicubic2d torch._C._nn.pad torch._C._nn.reflection_pad1d
        torch._C._nn.reflection_pad2d torch._C._nn.replication_pad1d
        torch._C._nn.replication_pad2d torch._C._nn.replication_pad3d
    """.split(), _BUILTIN),
    **dict.fromkeys("F.upsample F.upsample_nearest F.upsample_bilinear".split(), _INLINED),
    **dict.fromkeys("torch._C._nn._upsample_bilinear2d_aa torch._C._nn._upsample_bicubic2d_aa"
                    .split(), _NO_KERNEL),
}

_CALL = re.compile(r"([A-Za-z_][\w.]*)\(")
_OPERATORS = re.compile(r"__[a-z]+__")


def _split(call: str) -> tuple[str, str, str] | None:
    """(callee, arguments, what follows the call) of ``callee(arguments)suffix``."""
    match = _CALL.match(call)
    if match is None:
        return None
    depth, start = 0, match.end() - 1
    for i in range(start, len(call)):
        depth += {"(": 1, ")": -1}.get(call[i], 0)
        if depth == 0:
            return match.group(1), call[start + 1:i], call[i + 1:]
    return None


def _first_argument(arguments: str) -> tuple[str, str]:
    depth = 0
    for i, ch in enumerate(arguments):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            return arguments[:i].strip(), arguments[i + 1:].strip()
    return arguments.strip(), ""


def call_for(row_name: str, row_call: str | None, spelling: str,
             calls: dict[str, str]) -> str | None:
    """The sample call of one spelling of a row: ``calls``' (by "row|spelling" or by
    spelling), else the row's call with its function swapped for the spelling (a
    ``Tensor.`` spelling takes the first argument as its receiver). None where the row
    has no call on that framework."""
    given = calls.get(f"{row_name}|{spelling}", calls.get(spelling))
    if given is not None or row_call is None:
        return given
    parts = _split(row_call)
    if parts is None:
        return None
    callee, arguments, suffix = parts
    if spelling == callee:
        return row_call
    head, _, method = spelling.partition(".")
    if head != "Tensor":
        return f"{spelling}({arguments}){suffix}"
    receiver, rest = _first_argument(arguments)
    return f"({receiver}).{method}({rest}){suffix}"
