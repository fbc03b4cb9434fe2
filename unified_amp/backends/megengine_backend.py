"""The MegEngine adapter: unified_amp's primitives on MegEngine's own kernels."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np

import megengine
import megengine.functional as F
import megengine.functional.nn as _fnn
import megengine.module.activation as _mact
import megengine.module.adaptive_pooling as _mapool
import megengine.module.batchnorm as _mbn
import megengine.module.pooling as _mpool
from megengine.autodiff import GradManager as _NativeGradManager
from megengine.core import _config
from megengine.core._imperative_rt.core2 import (
    _get_amp_high_prec_dtype,
    _get_amp_low_prec_dtype,
    _set_amp_dtype_autocast,
    _set_amp_high_prec_dtype,
    _set_amp_low_prec_dtype,
)
from megengine.core.tensor import amp as _amp_state
from megengine.core.tensor.dtype import bfloat16, is_bfloat16
from megengine.functional.math import _check_non_finite
from megengine.module import Module as _Module
from megengine.optimizer import clip_grad_norm as _clip_grad_norm

from unified_amp.errors import UnsupportedPrecisionError

_LOW = (np.dtype("float16"),)


def _is_low(dtype: Any) -> bool:
    return dtype in _LOW or is_bfloat16(dtype)


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


_CPU_ONLY = not megengine.is_cuda_available()  # then "xpux", the default, is the CPU


def _on_cpu(t: Any) -> bool:
    device = str(t.device)
    return device.startswith("cpu") or (_CPU_ONLY and device.startswith("xpu"))


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


class _Tape:
    """GradManager recording on MegEngine's own GradManager."""

    def __init__(self) -> None:
        self.gm = _NativeGradManager()

    def attach(self, params: Sequence[Any], callbacks: Sequence[Any] = ()) -> None:
        # Passed straight on, so that MegEngine's own callbacks (make_allreduce_cb, which
        # asks for the GradManager running backward) work unchanged.
        self.gm.attach(params, callbacks=list(callbacks))

    def record(self) -> None:
        self.gm.record()

    def release(self) -> None:
        self.gm.release()

    def backward(self, ys: Sequence[Any], dys: Sequence[Any] | None) -> None:
        self.gm.backward(list(ys), None if dys is None else list(dys))


def _device_kind(device: Any) -> str:
    name = str(device).lower()
    return "cuda" if name.startswith(("gpu", "cuda")) else "cpu"


class MegEngineBackend:
    """unified_amp adapter for MegEngine 1.13 (CPU; CUDA where its CUDA build runs)."""

    name = "megengine"

    # -- devices and dtypes -----------------------------------------------------------
    def cuda_available(self) -> bool:
        return bool(megengine.is_cuda_available())

    def dtype_name(self, dtype: Any) -> str | None:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            return None
        return "bfloat16" if is_bfloat16(dt) else dt.name

    # -- autocast ---------------------------------------------------------------------
    def check_precision(self, dtype: str | None, device: str | None) -> None:
        cuda = self.cuda_available()
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

    # -- gradients --------------------------------------------------------------------
    def new_tape(self) -> _Tape:
        return _Tape()

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, megengine.Tensor)

    def grads(self, params: Any) -> list[Any]:
        return [p.grad for p in params if p.grad is not None]

    def drop_grads(self, params: Any) -> None:
        for p in params:
            p.grad = None

    def clip_grad_norm(self, params: Sequence[Any], max_norm: float,
                       norm_type: float) -> float:
        return float(_clip_grad_norm(params, max_norm, ord=norm_type).item())

    # -- loss scaling -----------------------------------------------------------------
    def scale(self, y: Any, scale: float) -> Any:
        return y * scale

    def scaled_cotangents(self, ys: Sequence[Any], dys: Sequence[Any] | None,
                          scale: float) -> list[Any]:
        # Exactly megengine.amp.GradScaler.backward's, so the bits match it.
        if dys is None:
            return [F.full_like(y, scale) for y in ys]
        return [dy * scale for dy in dys]

    def unscale_and_check(self, grads: Sequence[Any], inv_scale: float) -> Any:
        by_device: dict[str, list[Any]] = defaultdict(list)
        for g in grads:
            if g.dtype != np.float32:
                raise ValueError(
                    f"MegEngine's fused _check_non_finite unscales float32 gradients only;"
                    f" got a {self.dtype_name(g.dtype)} gradient of shape {tuple(g.shape)}."
                    f" Keep parameters in float32 and let autocast cast the compute."
                )
            by_device[str(g.device)].append(g)
        # One fused kernel per device; it unscales in place and returns an int32 flag.
        flags = [_check_non_finite(same, inv_scale) for same in by_device.values()]
        return flags

    def flag_is_set(self, flag: Any) -> bool:
        return any(bool(f.item()) for f in flag)

    # -- overflow forensics: after an overflow, or while tracing ----------------------
    def nonfinite_counts(self, tensors: Sequence[Any]) -> list[tuple[int, int]]:
        if not tensors:
            return []
        counts = [F.stack([F.isinf(t).astype("int32").sum().reshape(1),
                           F.isnan(t).astype("int32").sum().reshape(1)]).reshape(2)
                  for t in tensors]
        rows = F.stack(counts).numpy()  # the one read
        return [(int(n_inf), int(n_nan)) for n_inf, n_nan in rows.reshape(-1, 2)]

    def finite_flag(self, tensor: Any, per_row: bool = False) -> Any:
        t = tensor.detach()
        rows = int(t.shape[0]) if per_row else 1
        if math.prod(int(d) for d in t.shape) == 0:  # MegEngine cannot reduce these
            return megengine.tensor(np.zeros(rows, np.float32), device=t.device)
        if _is_low(t.dtype):
            # MegEngine's float16 kernels are several times slower than float32 ones
            # on CPU; the cast keeps inf and NaN as they are.
            t = t.astype("float32")
        # 0 * x is 0 for every finite x and NaN for inf and NaN: the sum is NaN exactly
        # when some element is not finite (a plain sum could overflow by itself).
        zeros = t * 0
        return zeros.reshape(rows, -1).sum(axis=1) if per_row else zeros.sum()

    def read_finite_flags(self, flags: Sequence[Any]) -> list[list[bool]]:
        if not flags:
            return []
        values = F.concat([f.reshape(-1) for f in flags]).numpy()  # the one read
        out, start = [], 0
        for f in flags:
            n = math.prod(int(d) for d in f.shape)
            out.append([bool(v) for v in np.isfinite(values[start:start + n])])
            start += n
        return out

    def named_modules(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def named_parameters(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_parameters())

    def add_forward_hook(self, module: Any, hook: Any, pre: bool = False) -> Any:
        if pre:
            return module.register_forward_pre_hook(hook)
        return module.register_forward_hook(hook)

    # -- opt levels ---------------------------------------------------------------------
    # MegEngine has no multi-tensor kernels (its own optimizers loop over parameters in
    # Python too), so the gradient and weight copies below are one op per tensor.
    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, _Module)

    def device_type(self, tensor: Any) -> str:
        return "cpu" if _on_cpu(tensor) else "cuda"

    def default_low_dtype(self, device: str) -> str:
        return "float16"  # its CPU build computes no bfloat16 (check_precision)

    def cast(self, tensor: Any, dtype: str) -> Any:
        if self.dtype_name(tensor.dtype) == dtype:
            return tensor
        return tensor.astype(bfloat16 if dtype == "bfloat16" else dtype)

    def autocast_low_dtype(self, device: str) -> str | None:
        if not _amp_state._enabled:  # one process-wide state for every device
            return None
        return self.dtype_name(_get_amp_low_prec_dtype())

    def cast_module(self, module: Any, dtype: str, keep_batchnorm_fp32: bool,
                    skip: Sequence[Any] = ()) -> None:
        left = {id(m) for s in skip for m in s.modules()}
        for sub in module.modules():
            if id(sub) in left or (keep_batchnorm_fp32 and isinstance(sub, _mbn._BatchNorm)):
                continue
            tensors = [t for _, t in sub.named_parameters(recursive=False)]
            tensors += [t for _, t in sub.named_buffers(recursive=False)]
            for t in tensors:
                if self.dtype_name(t.dtype) in ("float32", "float16", "bfloat16"):
                    t._reset(self.cast(t, dtype))  # the same Parameter object, new value

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
            dtype = self.dtype_name(d.dtype)
            assert dtype is not None  # a parameter's dtype is always a numpy one
            d._reset(self.cast(s, dtype))

    def skipped_step_result(self, optimizer: Any) -> Any:
        return optimizer  # MegEngine's step() returns self: opt.step().clear_grad()

    # -- distributed (optional part of the interface) -----------------------------------
    # MegEngine's collectives run on GPUs with NCCL only (megengine.distributed rejects
    # "cpu"). Its data-parallel gradients are identical on every rank after
    # make_allreduce_cb, so these serve GradScaler(process_group=...) alone.
    def world_group(self) -> Any:
        from megengine import distributed as dist

        if not dist.is_distributed() or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD

    def check_group(self, group: Any) -> None:
        from megengine import distributed as dist

        if not dist.is_distributed():
            raise RuntimeError(
                "GradScaler(process_group=...) was given a group, but megengine.distributed"
                " is not initialised (it runs on GPUs with NCCL only): launch the workers"
                " with megengine.distributed.launcher or init_process_group() first."
            )
        if not isinstance(group, dist.group.Group):
            raise TypeError(
                f"GradScaler process_group must be a megengine.distributed Group (e.g."
                f" megengine.distributed.group.WORLD or one from new_group()); got"
                f" {type(group).__name__} {group!r}."
            )

    def grad_kind(self, param: Any) -> str:
        return "local"

    def zero_grad_like(self, param: Any) -> Any:
        return F.zeros_like(param)

    def clean_flag(self, params: Sequence[Any], group: Any) -> Any:
        device = params[0].device if params else None
        return [megengine.tensor(0, dtype="int32", device=device)]

    def all_reduce_max_async(self, flag: Any, group: Any) -> tuple[Any, Any]:
        from megengine.distributed.functional import all_reduce_max

        # One value per device from the fused kernel; MegEngine queues ops
        # asynchronously, so there is no handle to wait for.
        total = flag[0]
        for f in flag[1:]:
            total = total + f.to(total.device)
        return [all_reduce_max(total, group)], None
