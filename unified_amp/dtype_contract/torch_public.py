"""The public callables of the torch the table was recorded on (``TORCH``) that no row
spells: ``torch``, ``torch.nn.functional`` ("F."), ``torch.linalg``, ``torch.special`` and
``torch.Tensor``'s methods and operators, as tests/contract/test_namespaces.py enumerates
them (a row's spelling under another name, the same object, counts as the row's).

They are recorded so that a new torch's new public callable is noticed: one outside this
set and outside every row fails that test until someone decides on it (a row, or this
set). Being here is not a proof: none of torch's Autocast registrations is theirs (each
is in a row: tests/native/test_torch_fake_cuda_dtypes.py), but a Python function here
that calls a row's op inside (``F.gumbel_softmax``'s softmax) gets that row's rule from
torch's kernels on CUDA and not from the contract's mode on the CPU, which sees the
outer call only. Regenerate: python -m tests.contract.test_namespaces (in .venv-torch).
"""

TORCH = '2.13.0'

_BY_NAMESPACE: dict[str, str] = {
    "F": """
        Optional adaptive_avg_pool1d adaptive_max_pool1d
        adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices
        adaptive_max_pool3d_with_indices affine_grid alpha_dropout assert_int_or_pair
        boolean_dispatch celu celu_ channel_shuffle dropout dropout1d dropout2d
        dropout3d elu elu_ embedding_bag feature_alpha_dropout fold
        fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices
        gaussian_nll_loss glu grouped_mm gumbel_softmax handle_torch_function hardshrink
        hardtanh hardtanh_ has_torch_function has_torch_function_unary
        has_torch_function_variadic leaky_relu_ linear_cross_entropy lp_pool1d lp_pool2d
        lp_pool3d max_pool1d_with_indices max_pool2d_with_indices
        max_pool3d_with_indices max_unpool1d mish multi_head_attention_forward
        multilabel_soft_margin_loss native_channel_shuffle one_hot pixel_shuffle
        pixel_unshuffle relu_ rrelu rrelu_ scaled_grouped_mm scaled_mm selu selu_
        softshrink softsign tanhshrink threshold threshold_
        triplet_margin_with_distance_loss unfold
    """,
    "Tensor": """
        __and__ __array__ __array_wrap__ __bool__ __complex__ __contains__ __deepcopy__
        __delitem__ __dir__ __div__ __dlpack__ __dlpack_device__ __eq__ __float__
        __format__ __ge__ __getitem__ __gt__ __hash__ __iand__ __ilshift__ __index__
        __init_subclass__ __int__ __invert__ __ior__ __irshift__ __iter__ __ixor__
        __le__ __len__ __long__ __lshift__ __lt__ __ne__ __new__ __nonzero__ __or__
        __pos__ __rand__ __reduce_ex__ __repr__ __reversed__ __rlshift__ __ror__
        __rrshift__ __rshift__ __rxor__ __setitem__ __setstate__ __subclasshook__
        __torch_dispatch__ __torch_function__ __xor__ abs_ absolute absolute_ acos_
        acosh_ add_ addbmm_ addcdiv_ addcmul_ addmm_ addmv_ addr_ adjoint all allclose
        aminmax angle any apply_ arccos arccos_ arccosh arccosh_ arcsin arcsin_ arcsinh
        arcsinh_ arctan arctan2 arctan2_ arctan_ arctanh arctanh_ argmax argmin argsort
        argwhere as_strided as_strided_ as_strided_scatter as_subclass asin_ asinh_
        atan2_ atan_ atanh_ backward baddbmm_ bernoulli bernoulli_ bfloat16 bincount
        bitwise_and bitwise_and_ bitwise_left_shift bitwise_left_shift_ bitwise_not
        bitwise_not_ bitwise_or bitwise_or_ bitwise_right_shift bitwise_right_shift_
        bitwise_xor bitwise_xor_ bool broadcast_to byte cauchy_ ccol_indices cdouble
        ceil_ cfloat chalf char cholesky cholesky_inverse cholesky_solve chunk clamp_
        clamp_max clamp_max_ clamp_min clamp_min_ clip clip_ clone coalesce col_indices
        conj conj_physical conj_physical_ const_data_ptr contiguous copy_ copysign
        copysign_ corrcoef cos_ cosh_ count_nonzero cov cpu crow_indices cuda cummax
        cummin cumprod_ cumsum_ data_ptr deg2rad deg2rad_ dense_dim dequantize det
        detach detach_ diag diag_embed diagflat diagonal diagonal_scatter diff digamma
        digamma_ dim dim_order dist div_ divide divide_ double dsplit eig element_size
        eq eq_ equal erf erf_ erfc erfc_ erfinv_ exp2_ exp_ expand expand_as expm1_
        exponential_ fill_ fill_diagonal_ fix fix_ flatten flip fliplr flipud float
        float_power float_power_ floor_ floor_divide_ fmax fmin fmod fmod_ frac frac_
        frexp gather gcd gcd_ ge ge_ geometric_ geqrf ger get_device greater greater_
        greater_equal greater_equal_ gt gt_ half hardshrink hash_tensor heaviside
        heaviside_ histc histogram hsplit hypot hypot_ i0 i0_ igamma igamma_ igammac
        igammac_ index index_add index_add_ index_copy_ index_fill index_fill_
        index_put_ index_reduce index_reduce_ index_select indices inner int int_repr
        ipu is_coalesced is_complex is_conj is_contiguous is_distributed
        is_floating_point is_inference is_neg is_nonzero is_pinned is_same_size
        is_set_to is_shared is_signed isclose isfinite isinf isnan isneginf isposinf
        isreal istft item kron kthvalue lcm lcm_ ldexp ldexp_ le le_ lerp lerp_ less
        less_ less_equal less_equal_ lgamma lgamma_ log10_ log1p_ log2_ log_ log_normal_
        logaddexp2 logcumsumexp logdet logical_and logical_and_ logical_not logical_not_
        logical_or logical_or_ logical_xor logical_xor_ logit logit_ long lstsq lt lt_
        lu lu_solve map2_ map_ masked_fill masked_fill_ masked_scatter masked_scatter_
        masked_select matrix_exp matrix_power max median min mode module_load moveaxis
        movedim msort mtia mul_ multinomial multiply multiply_ mvlgamma mvlgamma_
        nan_to_num nan_to_num_ nanmean nanmedian nansum narrow narrow_copy ndimension ne
        ne_ neg_ negative negative_ nelement new new_empty new_empty_strided new_full
        new_ones new_tensor new_zeros nextafter nextafter_ nonzero nonzero_static
        normal_ not_equal not_equal_ numel numpy orgqr ormqr outer permute pin_memory
        pinverse polygamma polygamma_ positive pow_ prelu put put_ q_per_channel_axis
        q_per_channel_scales q_per_channel_zero_points q_scale q_zero_point qr qscheme
        rad2deg rad2deg_ random_ ravel reciprocal_ record_stream register_hook
        register_post_accumulate_grad_hook reinforce relu_ remainder_ renorm_ repeat
        repeat_interleave requires_grad_ reshape reshape_as resize resize_ resize_as
        resize_as_ resize_as_sparse_ resolve_conj resolve_neg retain_grad roll rot90
        round_ row_indices rsqrt_ scatter scatter_ scatter_add_ scatter_reduce
        scatter_reduce_ select select_scatter set_ sgn sgn_ share_memory_ short sigmoid_
        sign_ signbit sin_ sinc sinc_ sinh_ size slice_inverse slice_scatter slogdet smm
        solve sort sparse_dim sparse_mask sparse_resize_ sparse_resize_and_clear_ split
        split_with_sizes sqrt_ square_ squeeze squeeze_ sspaddmm stft storage
        storage_offset storage_type stride sub_ subtract subtract_ sum_to_size svd
        swapaxes swapaxes_ swapdims swapdims_ symeig t t_ take take_along_dim tan_ tanh_
        tensor_split tile to to_dense to_mkldnn to_padded_tensor to_sparse to_sparse_bsc
        to_sparse_bsr to_sparse_coo to_sparse_csc to_sparse_csr tolist topk transpose
        transpose_ triangular_solve tril tril_ triu triu_ true_divide true_divide_ trunc
        trunc_ type type_as unbind unflatten unfold uniform_ unique unique_consecutive
        unsafe_chunk unsafe_split unsafe_split_with_sizes unsqueeze unsqueeze_
        untyped_storage values view view_as vsplit where xlogy xlogy_ xpu zero_
    """,
    "torch": """
        abs_ absolute acos_ acosh_ adaptive_avg_pool1d adaptive_max_pool1d addmv_
        adjoint affine_grid_generator alias_copy all allclose alpha_dropout
        alpha_dropout_ aminmax angle any arange arccos_ arccosh arccosh_ arcsin_ arcsinh
        arcsinh_ arctan arctan_ arctanh arctanh_ are_deterministic_algorithms_enabled
        argmax argmin argsort argwhere as_strided as_strided_ as_strided_copy
        as_strided_scatter as_tensor asarray asin_ asinh_ atan_ atanh_ atleast_1d
        atleast_2d atleast_3d autocast_decrement_nesting autocast_increment_nesting
        bartlett_window batch_norm_backward_elemt batch_norm_backward_reduce
        batch_norm_elemt batch_norm_gather_stats batch_norm_gather_stats_with_counts
        batch_norm_stats batch_norm_update_stats bernoulli
        binary_cross_entropy_with_logits bincount binomial bitwise_and
        bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift bitwise_xor
        blackman_window block_diag broadcast_shapes broadcast_tensors broadcast_to
        bucketize can_cast cartesian_prod ccol_indices_copy ceil_ celu celu_
        channel_shuffle choose_qparams_optimized chunk clamp_ clamp_max clamp_max_
        clamp_min clamp_min_ classproperty clear_autocast_cache clip_ clone
        col_indices_copy column_stack combinations compile compiled_with_cxx11_abi cond
        conj conj_physical conj_physical_ constant_pad_nd copysign corrcoef cos_ cosh_
        cosine_embedding_loss count_nonzero cov crow_indices_copy
        cudnn_affine_grid_generator cudnn_batch_norm cudnn_convolution
        cudnn_convolution_add_relu cudnn_convolution_relu cudnn_convolution_transpose
        cudnn_grid_sampler cudnn_is_acceptable cummax cummin cumulative_trapezoid
        deg2rad deg2rad_ dequantize det detach detach_ detach_copy diag diag_embed
        diagflat diagonal diagonal_copy diagonal_scatter diff digamma divide dropout
        dropout_ dsmm dsplit dstack eig embedding_bag embedding_renorm_ empty empty_like
        empty_permuted empty_quantized empty_strided eq equal erf erf_ erfc erfc_ exp2_
        exp_ expand_copy expm1_ eye fake_quantize_per_channel_affine
        fbgemm_linear_fp16_weight fbgemm_linear_fp16_weight_fp32_activation
        fbgemm_linear_int8_weight fbgemm_linear_int8_weight_fp32_activation
        fbgemm_linear_quantize_weight fbgemm_pack_gemm_matrix_fp16
        fbgemm_pack_quantized_matrix feature_alpha_dropout feature_alpha_dropout_
        feature_dropout feature_dropout_ fill fill_ fix fix_ flatten flip fliplr flipud
        float_power floor_ fmax fmin fmod fork frac frac_ frexp from_dlpack from_file
        from_numpy frombuffer full full_like fused_moving_avg_obs_fake_quant gather gcd
        gcd_ ge ger get_autocast_cpu_dtype get_autocast_dtype get_autocast_gpu_dtype
        get_autocast_ipu_dtype get_autocast_xla_dtype get_default_device
        get_default_dtype get_deterministic_debug_mode get_device get_device_module
        get_file_path get_float32_matmul_precision get_num_interop_threads
        get_num_threads get_rng_state gradient greater greater_equal grid_sampler_2d
        grid_sampler_3d gru gt hamming_window hann_window hardshrink hash_tensor
        heaviside hinge_embedding_loss histc histogram histogramdd hsmm hsplit hspmm
        hstack hypot i0 i0_ igamma igammac imag import_ir_module
        import_ir_module_from_buffer index_add index_fill index_put_ index_reduce
        index_select indices_copy init_num_threads initial_seed inner int_repr
        is_anomaly_check_nan_enabled is_anomaly_enabled is_autocast_cache_enabled
        is_autocast_cpu_enabled is_autocast_enabled is_autocast_ipu_enabled
        is_autocast_xla_enabled is_complex is_conj
        is_deterministic_algorithms_warn_only_enabled is_distributed is_floating_point
        is_grad_enabled is_inference is_inference_mode_enabled is_neg is_nonzero
        is_same_size is_signed is_storage is_tensor is_vulkan_available
        is_warn_always_enabled isclose isfinite isin isinf isnan isneginf isposinf
        isreal istft kaiser_window kl_div kron kthvalue lcm lcm_ ldexp ldexp_ le lerp
        less less_equal lgamma linspace load lobpcg log10_ log1p_ log2_ log_ logaddexp2
        logcumsumexp logdet logical_and logical_not logical_or logical_xor logit logit_
        logspace lstsq lt lu lu_unpack manual_seed margin_ranking_loss masked_fill
        masked_scatter masked_select matrix_exp matrix_power matrix_rank max max_pool1d
        max_pool1d_with_indices median merge_type_from_type_comment meshgrid min
        miopen_batch_norm miopen_convolution miopen_convolution_add_relu
        miopen_convolution_relu miopen_convolution_transpose miopen_ctc_loss
        miopen_depthwise_convolution miopen_rnn mkldnn_adaptive_avg_pool2d
        mkldnn_convolution mkldnn_linear_backward_weights mkldnn_max_pool2d
        mkldnn_max_pool3d mkldnn_rnn_layer mode moveaxis movedim msort multinomial
        multiply mvlgamma nan_to_num nan_to_num_ nanmean nanmedian nansum narrow
        narrow_copy native_batch_norm native_channel_shuffle native_dropout
        native_group_norm native_norm ne neg_ negative_ nextafter nonzero nonzero_static
        norm_except_dim normal not_equal numel ones ones_like outer parse_ir
        parse_schema parse_type_comment pca_lowrank permute permute_copy pixel_shuffle
        pixel_unshuffle poisson poisson_nll_loss polygamma positive
        prepare_multiprocessing_environment
        profiler_allow_cudagraph_cupti_lazy_reinit_cuda12 promote_types put
        q_per_channel_axis q_per_channel_scales q_per_channel_zero_points q_scale
        q_zero_point quantize_per_channel quantize_per_tensor
        quantize_per_tensor_dynamic quantized_batch_norm quantized_gru
        quantized_gru_cell quantized_lstm quantized_lstm_cell quantized_max_pool1d
        quantized_max_pool2d quantized_max_pool3d quantized_rnn_relu_cell
        quantized_rnn_tanh_cell rad2deg rad2deg_ rand rand_like randint randint_like
        randn randn_like randperm range ravel real reciprocal_ relu_ repeat_interleave
        reshape resize_as_ resize_as_sparse_ resolve_conj resolve_neg result_type
        rnn_relu rnn_tanh roll rot90 round_ row_indices_copy row_stack rrelu rrelu_
        rsqrt_ rsub saddmm save scalar_tensor scatter scatter_reduce searchsorted seed
        segment_reduce select select_copy select_scatter selu selu_ set_anomaly_enabled
        set_autocast_cache_enabled set_autocast_cpu_dtype set_autocast_cpu_enabled
        set_autocast_dtype set_autocast_enabled set_autocast_gpu_dtype
        set_autocast_ipu_dtype set_autocast_ipu_enabled set_autocast_xla_dtype
        set_autocast_xla_enabled set_default_device set_default_dtype
        set_default_tensor_type set_deterministic_debug_mode
        set_float32_matmul_precision set_flush_denormal set_num_interop_threads
        set_num_threads set_printoptions set_rng_state set_warn_always sgn sigmoid_
        signbit sin_ sinc sinc_ sinh_ slice_copy slice_inverse slice_scatter slogdet smm
        solve sort sparse_bsc_tensor sparse_bsr_tensor sparse_compressed_tensor
        sparse_coo_tensor sparse_csc_tensor sparse_csr_tensor split split_copy
        split_with_sizes split_with_sizes_copy spmm sqrt_ square_ squeeze squeeze_copy
        sspaddmm std_mean svd_lowrank swapaxes swapdims sym_constrain_range
        sym_constrain_range_for_size sym_float sym_fresh_size sym_int sym_ite sym_max
        sym_min sym_not sym_sqrt sym_sum symeig t t_copy take take_along_dim tan_ tanh_
        tensor tensor_split thread_safe_generator threshold threshold_ tile to_dlpack
        topk transpose transpose_copy trapezoid trapz tril tril_indices
        triplet_margin_loss triu triu_indices true_divide trunc trunc_ typename unbind
        unbind_copy unflatten unfold_copy unify_type_list unique unique_consecutive
        unravel_index unsafe_chunk unsafe_split unsafe_split_with_sizes unsqueeze
        unsqueeze_copy use_deterministic_algorithms values_copy vander var_mean
        view_as_complex_copy view_as_real view_as_real_copy view_copy vmap vsplit vstack
        wait while_loop xlogy xlogy_ zero_ zeros zeros_like
    """,
    "torch.linalg": """
        cross det diagonal ldl_factor ldl_factor_ex ldl_solve lu lu_factor_ex lu_solve
        matmul matrix_exp matrix_power matrix_rank slogdet solve_triangular vander
    """,
    "torch.special": """
        airy_ai bessel_j0 bessel_j1 bessel_y0 bessel_y1 chebyshev_polynomial_t
        chebyshev_polynomial_u chebyshev_polynomial_v chebyshev_polynomial_w digamma
        entr erf erfc erfcx expit gammainc gammaincc gammaln hermite_polynomial_h
        hermite_polynomial_he i0 i0e i1 i1e laguerre_polynomial_l legendre_polynomial_p
        log_ndtr logit modified_bessel_i0 modified_bessel_i1 modified_bessel_k0
        modified_bessel_k1 multigammaln ndtr ndtri polygamma psi round
        scaled_modified_bessel_k0 scaled_modified_bessel_k1
        shifted_chebyshev_polynomial_t shifted_chebyshev_polynomial_u
        shifted_chebyshev_polynomial_v shifted_chebyshev_polynomial_w sinc
        spherical_bessel_j0 xlog1py xlogy zeta
    """,
}
WITHOUT_ROW: frozenset[str] = frozenset(
    f"{namespace}.{name}" for namespace, names in _BY_NAMESPACE.items()
    for name in names.split())
