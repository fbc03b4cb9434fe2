"""What each framework's own autocast gives a row where that differs from the row's rule,
and the torch Autocast registrations the rows were derived from: measured facts about
the frameworks, which the adapters act on."""

from __future__ import annotations

# What each framework's own autocast gives a row where that differs from the row's rule,
# as tests/contract/test_dtype_table.py measures it (with torch.autocast("cpu") on torch
# TABLE_TORCH, and megengine.amp.autocast on MegEngine TABLE_MEGENGINE): the adapters act
# on these rows. The words: "low", "float32", "input" as the rules; "error" where the op
# raises; "mixed: ..." what mixed float32/low inputs give.
TORCH_CPU: dict[str, str] = {
    'matrix-vector product': 'input',
    'addmv': 'input',
    'addr': 'input',
    'multi-dot': 'float32 input: low, low input: error',
    'LSTM cell': 'input',
    'GRU cell': 'input',
    'GRU layer': 'input',
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
    'general eigendecomposition': 'float32',
    'FFT': 'float32',
    'real-valued FFT': 'float32',
    'complex from real': 'float32',
    'fake quantize': 'float32',
}
# Rows whose torch.autocast("cpu") outcome depends on the CPU's instruction set, and what
# oneDNN's AVX2 path gives them (``ONEDNN_MAX_CPU_ISA=AVX2`` reproduces it on any x86
# CPU): oneDNN has a bfloat16 LSTM only with AVX-512 BF16, where TORCH_CPU's entry was
# measured. The adapter computes each of these rows in float32 on every CPU
# (``Adapt.float32_compute``), so what it does depends on neither.
TORCH_CPU_AVX2: dict[str, str] = {
    'LSTM layer': 'float32 input: error, low input: low',
}
MEGENGINE: dict[str, str] = {
    'deformable conv2d': 'error',
    'conv3d': 'float32',
    'conv_transpose3d': 'float32',
    'prelu': 'float32',
    'atan2': 'float32, mixed: float32',
    'divide': 'float32, mixed: float32',
    'in-place arithmetic': 'input, mixed: float32',
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
# Ops newer than TABLE_TORCH, and the Autocast keys the first torch that has them (the
# row's ``torch_since``) registers them on, read from that torch's dispatcher as above.
# The adapter counts them as recorded from that torch on; an earlier torch lacks them.
LATER_REGISTRATIONS: dict[str, frozenset[str]] = {
    "linalg_matrix_sqrth": frozenset({"AutocastCPU", "AutocastCUDA"}),  # torch 2.14.1
}
