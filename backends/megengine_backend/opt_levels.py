"""Opt-level casting (amp.initialize): module casts, master weights, gradient copies.

The policy (which level casts what, when masters are stepped) is the core's
(unified_amp/apex/opt_levels.py); these are its primitives on MegEngine's ops.
"""

from __future__ import annotations

from typing import Any, Sequence

import megengine
import megengine.module.batchnorm as _mbn

from unified_amp import capabilities

from .basics import cast, dtype_name


class OptLevelCasting(capabilities.OptLevelCasting):
    """Casting modules and tensors, master copies, and moving gradients between them.

    MegEngine has no multi-tensor kernels (its own optimizers loop over parameters in
    Python too), so the gradient and weight copies below are one op per tensor.
    """

    def default_low_dtype(self, device: str) -> str:
        return "float16"  # its CPU build computes no bfloat16 (check_precision)

    def cast_module(self, module: Any, dtype: str, keep_batchnorm_fp32: bool,
                    skip: Sequence[Any] = ()) -> None:
        left = {id(m) for s in skip for m in s.modules()}  # amp.keep_float32's modules
        for sub in module.modules():
            if id(sub) in left or (keep_batchnorm_fp32 and isinstance(sub, _mbn._BatchNorm)):
                continue
            tensors = [t for _, t in sub.named_parameters(recursive=False)]
            tensors += [t for _, t in sub.named_buffers(recursive=False)]
            for t in tensors:
                if dtype_name(t.dtype) in ("float32", "float16", "bfloat16"):
                    t._reset(cast(t, dtype))  # the same Parameter object, new value

    def low_precision_batch_norm(self, dtype: str) -> bool:
        # float16 batch norm weights abort the process on the CPU build ("free():
        # invalid pointer") or fail an assertion; unverified on CUDA, so never.
        return False

    def steps_low_precision(self, optimizer: Any) -> bool:
        # Its SGD, Adam, ... update in float32 (`param -= lr * grad` with float32 lr
        # and state), which fails on float16 parameters.
        return False

    def master_copy(self, param: Any) -> Any:
        return megengine.Parameter(param.astype("float32"))

    def optimizer_state(self, optimizer: Any) -> Any:
        return optimizer._state

    def take_grads(self, params: Sequence[Any]) -> list[Any]:
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    def restore_grads(self, params: Sequence[Any], grads: Sequence[Any]) -> None:
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    def grads_to_masters(self, params: Sequence[Any], masters: Sequence[Any]) -> None:
        for p, m in zip(params, masters):
            if p.grad is not None:
                m.grad = p.grad.astype("float32")
                p.grad = None

    def copy_params(self, dst: Sequence[Any], src: Sequence[Any]) -> None:
        for d, s in zip(dst, src):
            dtype = dtype_name(d.dtype)
            assert dtype is not None  # a parameter's dtype is always a numpy one
            d._reset(cast(s, dtype))

    def skipped_step_result(self, optimizer: Any) -> Any:
        return optimizer  # MegEngine's step() returns self: opt.step().clear_grad()
