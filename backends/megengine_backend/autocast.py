"""Autocasting: MegEngine's autocast state, and the dtype contract's Python wrappers."""

from __future__ import annotations

from typing import Any, Callable

import megengine
import megengine.functional as F
import megengine.functional.nn as _fnn
import megengine.module.activation as _mact
import megengine.module.adaptive_pooling as _mapool
import megengine.module.batchnorm as _mbn
import megengine.module.pooling as _mpool
from megengine.core import _config
from megengine.core._imperative_rt.core2 import (
    _get_amp_high_prec_dtype,
    _get_amp_low_prec_dtype,
    _set_amp_dtype_autocast,
    _set_amp_high_prec_dtype,
    _set_amp_low_prec_dtype,
)
from megengine.core.tensor import amp as _amp_state

from unified_amp import interface
from unified_amp.errors import UnsupportedPrecisionError

from .basics import dtype_name
from .basics import is_low as _is_low
from .basics import on_cpu as _on_cpu


# MegEngine's autocast state is process-global (unlike torch's, which is per thread), so
# this stack is too: True while the innermost unified autocast block is enabled.
_policy_stack: list[bool] = []


def _policy_on() -> bool:
    return bool(_policy_stack) and _policy_stack[-1]


# -- the dtype contract (docs/DTYPE_CONTRACT.md) ----------------------------------------
# MegEngine decides most autocast dtypes in C++, where no hook reaches; a few rows of the
# contract need a Python-level wrapper, active only inside an enabled unified block:
# softmax, sum and average pooling keep a float16 input in float16 (the contract says
# float32); batch norm casts a float32 input down to float16 (the contract says: follow
# the input); and MegEngine 1.13's float16 max pooling on CPU returns wrong values for
# almost every output, so it runs in float32 there and hands back float16.
def _softmax_fp32(orig: Callable) -> Callable:
    def softmax(inp: Any, axis: Any = None) -> Any:
        if _policy_on() and _is_low(inp.dtype):
            inp = inp.astype("float32")
        return orig(inp, axis)

    return softmax


def _sum_fp32(orig: Callable) -> Callable:
    def sum(self: Any, axis: Any = None, keepdims: bool = False) -> Any:  # noqa: A001
        if _policy_on() and _is_low(self.dtype):
            self = self.astype("float32")
        return orig(self, axis, keepdims)

    return sum


def _batch_norm_follows_input(orig: Callable) -> Callable:
    def batch_norm(inp: Any, *args: Any, **kwargs: Any) -> Any:
        if _policy_on() and not _is_low(inp.dtype):
            # MegEngine's C++ autocast casts BatchNorm to float16; run it without.
            saved = _set_autocast(False)
            try:
                return orig(inp, *args, **kwargs)
            finally:
                _restore_autocast(saved)
        return orig(inp, *args, **kwargs)

    return batch_norm


def _max_pool_in_fp32_on_cpu(orig: Callable) -> Callable:
    def max_pool(inp: Any, *args: Any, **kwargs: Any) -> Any:
        if _policy_on() and _is_low(inp.dtype) and _on_cpu(inp):
            return orig(inp.astype("float32"), *args, **kwargs).astype(inp.dtype)
        return orig(inp, *args, **kwargs)

    return max_pool


def _avg_pool_fp32(orig: Callable) -> Callable:
    # Also sidesteps MegEngine's float16 adaptive_avg_pool2d, wrong on small CPU inputs.
    def avg_pool(inp: Any, *args: Any, **kwargs: Any) -> Any:
        if _policy_on() and _is_low(inp.dtype):
            inp = inp.astype("float32")
        return orig(inp, *args, **kwargs)

    return avg_pool


# Every place MegEngine binds these functions by name (modules import them directly).
_PATCHES = (
    ((F, _fnn, _mact), "softmax", _softmax_fp32),
    ((_fnn, _mbn), "batch_norm", _batch_norm_follows_input),
    ((F, _fnn, _mpool), "max_pool2d", _max_pool_in_fp32_on_cpu),
    ((F, _fnn, _mapool), "adaptive_max_pool2d", _max_pool_in_fp32_on_cpu),
    ((F, _fnn, _mpool), "avg_pool2d", _avg_pool_fp32),
    ((F, _fnn, _mapool), "adaptive_avg_pool2d", _avg_pool_fp32),
)
_installed = False


def _install_policy() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    for modules, attr, wrap in _PATCHES:
        wrapped = wrap(getattr(_fnn, attr))
        for module in modules:
            if hasattr(module, attr):
                setattr(module, attr, wrapped)
    megengine.Tensor.sum = _sum_fp32(megengine.Tensor.sum)


def _set_autocast(enabled: bool, low: str = "float16") -> tuple:
    """Sets MegEngine's autocast state the way megengine.amp.autocast does, returning
    what it replaced."""
    saved = (_amp_state._enabled, _get_amp_low_prec_dtype(), _get_amp_high_prec_dtype())
    _amp_state._enabled = enabled
    _set_amp_dtype_autocast(enabled)
    if enabled:
        _set_amp_high_prec_dtype("float32")
        _set_amp_low_prec_dtype(low)
    # megengine.amp.autocast sets compute_mode="float32" (float16 matmuls accumulate in
    # float32). MegEngine asserts -- asynchronously -- if a float32 matmul runs in that
    # mode, so a disabled block nested in an enabled one must put "default" back.
    configs = _config._reset_execution_config(
        compute_mode="float32" if enabled else "default")
    return saved + (configs,)


def _restore_autocast(saved: tuple) -> None:
    enabled, low, high, configs = saved
    _amp_state._enabled = enabled
    _set_amp_dtype_autocast(enabled)
    _set_amp_low_prec_dtype(low)
    _set_amp_high_prec_dtype(high)
    _config._reset_execution_config(*configs)


class Autocasting(interface.Autocasting):
    """Switching autocast on and off, and which precisions a device computes."""

    def check_precision(self, dtype: str | None, device: str | None) -> None:
        cuda = bool(megengine.is_cuda_available())
        if device == "cuda" and not cuda:
            raise UnsupportedPrecisionError(
                "autocast(device='cuda') was requested, but MegEngine sees no CUDA device"
                " (its CPU build, or no driver). Use device='cpu' or device=None."
            )
        # Where tensors land when no device is named: the default device, a GPU if any.
        on_cpu = device == "cpu" or (device is None and not cuda)
        if dtype == "bfloat16" and on_cpu:
            raise UnsupportedPrecisionError(
                "autocast dtype 'bfloat16' cannot run on MegEngine's CPU build: its"
                " matmul/conv kernels have no bfloat16 implementation and fail"
                " asynchronously. Use dtype='float16' (or None) with MegEngine on CPU."
            )

    def native_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                        contract: bool) -> Any:
        return None  # megengine.jit.trace replays what the block does; it needs no stand-in

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True) -> Any:
        if enabled and contract:
            # Installed by the first enabled block, not on load: a drop-in user who
            # only swaps GradScaler keeps MegEngine's functions untouched.
            _install_policy()
        saved = _set_autocast(enabled, dtype or "float16")
        _policy_stack.append(enabled and contract)
        return saved

    def exit_autocast(self, token: Any) -> None:
        _policy_stack.pop()
        _restore_autocast(token)

    def is_autocast_enabled(self) -> bool:
        return bool(_amp_state._enabled)

    def autocast_low_dtype(self, device: str) -> str | None:
        if not _amp_state._enabled:  # one process-wide state for every device
            return None
        return dtype_name(_get_amp_low_prec_dtype())
