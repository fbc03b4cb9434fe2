"""The contract's rows: reductions, norms, pooling, resampling and padding."""

from __future__ import annotations

from .row import Row, make_row as _r

# torch.compile's dynamo inlines F.pad (a Python function) and, inside it, consults no
# torch function mode (torch 2.13: its has_torch_function asks the arguments only, and
# torch._C._nn.pad is not an overridable function).
_INLINED_PAD = ("compiled on the CPU, a low-precision input keeps torch's CPU autocast"
                " (float32): dynamo inlines F.pad and consults no function mode inside it.")

ROWS: tuple[Row, ...] = (
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
       "F.var", "F.var(x, 1)",
       reason="MegEngine: its var is a mean of squares, float32 under its autocast; the"
              " adapter returns the input's dtype (computed in float32)."),
    _r("standard deviation", "reduction", "input", "", "torch.std Tensor.std",
       "torch.std(x, 1)", "F.std", "F.std(x, 1)",
       reason="MegEngine: its std is float32 under its autocast; the adapter returns the"
              " input's dtype (computed in float32)."),
    _r("quantile", "reduction", "input", "quantile quantile.scalar nanquantile"
       " nanquantile.scalar", "torch.quantile Tensor.quantile torch.nanquantile"
       " Tensor.nanquantile", "torch.quantile(x, 0.5, dim=1)",
       cuda_low=False, refuse_low=True, fuzz=False),
    _r("trace", "reduction", "input", "trace", "torch.trace Tensor.trace", "torch.trace(sq)"),
    # -- norms ------------------------------------------------------------------------------
    _r("layer norm", "norm", "float32", "layer_norm native_layer_norm",
       "F.layer_norm torch.layer_norm torch.native_layer_norm",
       "F.layer_norm(x, (8,), ln_w, ln_b)", "F.nn.layer_norm F.general_norm",
       "F.nn.layer_norm(x, (8,), True, ln_w, ln_b)", wrapped="megengine",
       reason="MegEngine: general_norm, a layer norm over the given axes, is not in its"
              " autocast's float32 list (it keeps a float16 input in float16, and ends the"
              " process given float32 weights: \"attempt to access dtype Float32 as"
              " Float16\"); the adapter runs both spellings itself, in float32."),
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
       "F.nn.local_response_norm(img, 3)",
       reason="MegEngine: under its own autocast local_response_norm ends the process"
              " (\"attempt to access dtype Float16 as Float32\"); the adapter casts the input"
              " to float32 and runs it without."),
    _r("vector norm", "norm", "float32", "linalg_vector_norm norm.Scalar norm.ScalarOpt_dim"
       " frobenius_norm.dim",
       "torch.linalg.vector_norm torch.linalg.norm torch.norm Tensor.norm torch.frobenius_norm torch._VF.norm torch._VF.frobenius_norm",
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
       "F.adaptive_avg_pool3d torch._C._nn.adaptive_avg_pool3d", "F.adaptive_avg_pool3d(vol, 1)"),
    _r("max pool 3-d", "pool", "input", "max_pool3d", "F.max_pool3d torch.max_pool3d",
       "F.max_pool3d(vol, 2)"),
    _r("adaptive max pool 3-d", "pool", "input", "adaptive_max_pool3d",
       "F.adaptive_max_pool3d torch._C._nn.adaptive_max_pool3d", "F.adaptive_max_pool3d(vol, 1)"),
    _r("fractional max pool", "pool", "input", "fractional_max_pool2d fractional_max_pool3d",
       "F.fractional_max_pool2d F.fractional_max_pool3d torch._C._nn.fractional_max_pool2d torch._C._nn.fractional_max_pool3d",
       "F.fractional_max_pool2d(img, 2, output_size=2, _random_samples=rs)"),
    _r("max unpool", "pool", "input", "max_unpool2d max_unpool3d",
       "F.max_unpool2d F.max_unpool3d torch._C._nn.max_unpool2d torch._C._nn.max_unpool3d",
       "F.max_unpool2d(*F.max_pool2d(img, 2, return_indices=True), 2)"),
    _r("interpolate nearest", "resample", "float32",
       "upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d"
       " _upsample_nearest_exact2d _upsample_nearest_exact3d",
       "F.interpolate F.upsample F.upsample_nearest torch._C._nn.upsample_nearest1d torch._C._nn.upsample_nearest2d torch._C._nn.upsample_nearest3d torch._C._nn._upsample_nearest_exact1d torch._C._nn._upsample_nearest_exact2d torch._C._nn._upsample_nearest_exact3d",
       "F.interpolate(img, scale_factor=2, mode='nearest')", "F.nn.interpolate",
       "F.nn.interpolate(img, scale_factor=2, mode='nearest')"),
    _r("interpolate linear", "resample", "float32",
       "upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d",
       "F.interpolate F.upsample F.upsample_bilinear torch._C._nn.upsample_linear1d torch._C._nn.upsample_bilinear2d torch._C._nn._upsample_bilinear2d_aa torch._C._nn.upsample_trilinear3d",
       "F.interpolate(img, scale_factor=2, mode='bilinear')", "F.nn.interpolate",
       "F.nn.interpolate(img, scale_factor=2, mode='bilinear')"),
    _r("interpolate bicubic", "resample", "float32",
       "upsample_bicubic2d _upsample_bicubic2d_aa", "F.interpolate torch._C._nn.upsample_bicubic2d torch._C._nn._upsample_bicubic2d_aa",
       "F.interpolate(img, scale_factor=2, mode='bicubic')", "F.nn.interpolate",
       "F.nn.interpolate(img, scale_factor=2, mode='bicubic')"),
    _r("grid sample", "resample", "promote",
       "grid_sampler grid_sampler_2d grid_sampler_3d _grid_sampler_2d_cpu_fallback",
       "F.grid_sample torch.grid_sampler", "F.grid_sample(img, grid, align_corners=False)",
       fake_cuda="fake CUDA runs grid_sampler_2d's Python decomposition, whose indexing needs a CUDA device guard that a CPU build lacks"),
    _r("reflection pad", "pad", "input", "reflection_pad1d reflection_pad2d",
       "F.pad torch._C._nn.pad torch._C._nn.reflection_pad1d torch._C._nn.reflection_pad2d", "F.pad(img, (1, 1, 1, 1), mode='reflect')", "F.nn.pad",
       "F.nn.pad(img, ((0, 0), (0, 0), (1, 1), (1, 1)), mode='reflect')",
       compiled=_INLINED_PAD),
    _r("replication pad", "pad", "input", "replication_pad1d replication_pad2d"
       " replication_pad3d", "F.pad torch._C._nn.pad torch._C._nn.replication_pad1d torch._C._nn.replication_pad2d torch._C._nn.replication_pad3d", "F.pad(img, (1, 1, 1, 1), mode='replicate')",
       "F.nn.pad", "F.nn.pad(img, ((0, 0), (0, 0), (1, 1), (1, 1)), mode='edge')",
       compiled=_INLINED_PAD),
)
