"""The contract's rows: losses, promoted ops, indexing, linear algebra, spectral ops and quantization."""

from __future__ import annotations

from .row import Row, make_row as _r

ROWS: tuple[Row, ...] = (
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
       "F.binary_cross_entropy torch._C._nn.binary_cross_entropy",
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
    _r("CTC loss", "loss", "input", "ctc_loss.IntList ctc_loss.Tensor", "F.ctc_loss torch.ctc_loss",
       "F.ctc_loss(logp, ctc_targets, ctc_in_len, ctc_tg_len)", "F.nn.ctc_loss",
       "F.nn.ctc_loss(logp, ctc_in_len, ctc_targets, ctc_tg_len)", fuzz=False,
       fake_cuda="torch 2.13 has no meta kernel for _use_cudnn_ctc_loss on CUDA, so fake CUDA cannot run it",
       cuda_low=False,
       reason="MegEngine: its autocast returns float32 for a float16 input; the adapter"
              " returns the input's dtype (computed in float32)."),
    # -- promote: mixed inputs to the widest ----------------------------------------------------
    _r("dot", "matmul", "promote", "dot vdot", "torch.dot Tensor.dot torch.vdot Tensor.vdot",
       "torch.dot(v, v2)", "F.dot", "F.dot(v, v2)",
       reason="torch CPU and MegEngine refuse mixed float32/float16 vectors without"
              " autocast's promotion (MegEngine asynchronously); the adapters promote."),
    _r("bilinear", "matmul", "promote", "bilinear", "F.bilinear torch.bilinear",
       "F.bilinear(x, y, bw, b)"),
    _r("tensordot", "matmul", "promote", "tensordot", "torch.tensordot torch._VF.tensordot",
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
       cuda_low=False, refuse_low=True),
    _r("linear solve", "linalg", "input",
       "linalg_solve lu_solve _lu_with_info triangular_solve cholesky_solve linalg_lstsq"
       " linalg_tensorsolve",
       "torch.linalg.solve torch.linalg.lu_factor torch.lu_solve torch.triangular_solve torch.cholesky_solve"
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
       "torch.svd torch.linalg.svd torch.linalg.svdvals torch.linalg.cond", "torch.linalg.svdvals(sq)", "F.svd",
       "F.svd(sq)[1]", fuzz=False,
       cuda_low=False,
       float32_compute="megengine",
       reason="MegEngine: no float16 SVD (\"non-float32 tensors is not supoorted\"); the"
              " adapter computes it in float32 and returns float16."),
    _r("eigendecomposition", "linalg", "input", "linalg_eigh linalg_eigvalsh",
       "torch.linalg.eigh torch.linalg.eigvalsh", "torch.linalg.eigvalsh(spd)", fuzz=False,
       cuda_low=False),
    _r("general eigendecomposition", "linalg", "input", "linalg_eig linalg_eigvals",
       "torch.linalg.eig torch.linalg.eigvals", "torch.linalg.eigvals(spd).real", fuzz=False,
       cuda_low=False, no_bfloat16=True,
       reason="Complex eigenvalues (an eigendecomposition row's spellings until 0.4.0, whose"
              " real eigh and eigvalsh take a bfloat16 input, where these raise)."),
    _r("symmetric matrix square root", "linalg", "float32", "linalg_matrix_sqrth",
       "torch.linalg.matrix_sqrth", "torch.linalg.matrix_sqrth(spd)", fuzz=False,
       torch_since="2.14",
       reason="torch's CPU and CUDA autocast both run it in float32: it has no"
              " low-precision kernel (\"Low precision dtypes not supported\" without"
              " autocast)."),
    # -- spectral and complex ---------------------------------------------------------------
    _r("FFT", "spectral", "input",
       "fft_fft fft_fft2 fft_fftn fft_ifft fft_ifft2 fft_ifftn fft_ihfft fft_rfft fft_rfft2"
       " fft_rfftn stft stft.center",
       "torch.fft.fft torch.fft.fft2 torch.fft.fftn torch.fft.ifft torch.fft.ifft2"
       " torch.fft.ifftn torch.fft.ihfft torch.fft.rfft torch.fft.rfft2 torch.fft.rfftn"
       " torch.stft torch._VF.stft",
       "torch.fft.rfft(x).abs()", fuzz=False,
       cuda_low=False, no_bfloat16=True),
    _r("real-valued FFT", "spectral", "input", "fft_hfft fft_irfft fft_irfft2 fft_irfftn",
       "torch.fft.irfft torch.fft.irfft2 torch.fft.irfftn torch.fft.hfft",
       "torch.fft.irfft(x)", fuzz=False, cuda_low=False,
       reason="The FFTs with a real output (FFT's spellings until 0.4.0, whose complex"
              " outputs have no bfloat16 dtype, where these give bfloat16)."),
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
