"""The PyTorch adapter: unified_amp's primitives on torch's own kernels."""

from __future__ import annotations

import collections
import math
import threading
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from unified_amp import scaler as _core
from unified_amp.errors import UnsupportedPrecisionError

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_ALL_DTYPES = dict(_DTYPES, float32=torch.float32)
_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm  # BatchNorm1d/2d/3d, SyncBatchNorm
_LOW = (torch.float16, torch.bfloat16)

# Ops the dtype contract puts in float32 whatever their input (docs/DTYPE_CONTRACT.md).
# Where torch's autocast already has a kernel for an (op, device) pair -- on CUDA it puts
# softmax, log_softmax, sum, exp, log and layer_norm in float32 -- we leave it alone; where
# it falls through (all of these on CPU; mean and average pooling on CUDA), a float16
# input would give a float16 output, so we register a kernel on that device's Autocast
# key.
_FP32_OPS = (
    "softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "mean", "mean.dim",
    "exp", "log", "layer_norm", "avg_pool2d", "adaptive_avg_pool2d",
)
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


_DTensor: Any = None


def _dtensor_class() -> type:
    """DTensor, imported on the first distributed check (it pulls in a lot)."""
    global _DTensor
    if _DTensor is None:
        from torch.distributed.tensor import DTensor

        _DTensor = DTensor
    return _DTensor


class _Policy(threading.local):
    """Whether the innermost unified autocast block of this thread is enabled.

    The registered kernels consult it so that plain ``torch.autocast`` (not ours) keeps
    torch's own behaviour even after this adapter is loaded.
    """

    def __init__(self) -> None:
        self.stack: list[bool] = []

    @property
    def on(self) -> bool:
        return bool(self.stack) and self.stack[-1]


_policy = _Policy()
_library: torch.library.Library | None = None
_installed: set[str] = set()  # device types whose kernels are registered


def _fp32_kernel(op: Any, key: str) -> Callable[..., Any]:
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _policy.on:
            args = tuple(
                a.float() if isinstance(a, torch.Tensor) and a.dtype in _LOW else a
                for a in args
            )
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    return kernel


def _install_policy(device_type: str) -> None:
    """Registers the float32 kernels for one device type, once per process."""
    global _library
    if device_type in _installed:
        return
    _installed.add(device_type)
    key = _AUTOCAST_KEYS[device_type]
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
    for name in _FP32_OPS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
            continue
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        _library.impl(name, _fp32_kernel(op, key), key)


class _Tape:
    """GradManager recording on torch autograd, with MegEngine's semantics."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self._grad_mode: bool | None = None
        # id(param) -> callbacks, MegEngine's: each gets (param, this backward's
        # gradient) and returns the gradient passed on, then accumulated into .grad.
        self._callbacks: dict[int, list[Any]] = {}

    def attach(self, params: Sequence[torch.Tensor], callbacks: Sequence[Any] = ()) -> None:
        for p in params:
            if not p.is_leaf:
                raise ValueError(
                    f"GradManager can only attach leaf tensors (parameters); got a tensor of"
                    f" shape {tuple(p.shape)} computed by {type(p.grad_fn).__name__}."
                    f" Attach the parameter it was computed from, or .detach() it."
                )
            if not p.requires_grad:
                if not p.is_floating_point():
                    raise ValueError(
                        f"GradManager can only attach floating-point tensors; got dtype"
                        f" {p.dtype} for a tensor of shape {tuple(p.shape)}."
                    )
                # Attaching is what makes a tensor differentiable in MegEngine.
                p.requires_grad_(True)
        known = {id(p) for p in self.params}
        self.params.extend(p for p in params if id(p) not in known)
        if callbacks:
            for p in params:  # concatenated per tensor on repeated attach, as MegEngine
                self._callbacks.setdefault(id(p), []).extend(callbacks)

    def record(self) -> None:
        self._grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(True)

    def release(self) -> None:
        if self._grad_mode is not None:
            torch.set_grad_enabled(self._grad_mode)
            self._grad_mode = None

    def backward(self, ys: Sequence[torch.Tensor], dys: Sequence[Any] | None) -> None:
        if not ys or not self.params:
            return
        if dys is None:
            dys = [torch.ones_like(y) for y in ys]
        hooked = [p for p in self.params if id(p) in self._callbacks]
        if not hooked:
            # inputs= keeps gradients to the attached tensors, as MegEngine does.
            torch.autograd.backward(list(ys), grad_tensors=list(dys), inputs=self.params)
            return
        # The callbacks see this backward's gradient alone, before it joins what .grad
        # holds: set the old gradients aside, run the backward, then pass each new
        # gradient through its callbacks and accumulate it (after backward, in place,
        # as autograd would have).
        kept = [(p, p.grad) for p in hooked]
        for p in hooked:
            p.grad = None
        try:
            torch.autograd.backward(list(ys), grad_tensors=list(dys), inputs=self.params)
        except BaseException:
            for p, old in kept:
                p.grad = old
            raise
        with torch.no_grad():
            for p, old in kept:
                new = p.grad
                if new is None:  # no gradient reached it: its callbacks do not run
                    p.grad = old
                    continue
                for callback in self._callbacks[id(p)]:
                    new = callback(p, new)
                p.grad = new if old is None else old.add_(new)


def _check_and_unscale_per_device(grads: Sequence[torch.Tensor], inv_scale: Any
                                  ) -> dict[torch.device, torch.Tensor]:
    """torch's fused kernel over grads of any devices/dtypes (it takes one of each per
    call); ``inv_scale`` is a float or a float32 0-dim tensor. Returns a found_inf flag
    (float32) per device. No host sync."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list))
    for g in grads:
        if g.is_sparse:
            g = g._values()
        groups[g.device][g.dtype].append(g)
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, by_dtype in groups.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            if isinstance(inv_scale, torch.Tensor):
                inv = inv_scale.to(device, non_blocking=True)
            else:
                # Filled in float64 and cast, so that the reciprocal of a scale that
                # has underflowed (after ~144 overflows in a row) becomes inf, as in
                # torch.amp, instead of failing to convert.
                inv = torch.full((), inv_scale, dtype=torch.float64,
                                 device=device).float()
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv)
            found[device] = found_inf
    return found


def _check_and_unscale(grads: Sequence[torch.Tensor], inv_scale: Any,
                       found_on: torch.device | None = None) -> torch.Tensor:
    """The same, as one flag on ``found_on`` (default: the first gradient's device)."""
    found = list(_check_and_unscale_per_device(grads, inv_scale).values())
    target = found_on or found[0].device
    total = found[0].to(target, non_blocking=True)
    for f in found[1:]:
        total = total + f.to(target, non_blocking=True)
    return total


def _by_device(flags: Sequence[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    per_device: dict[torch.device, torch.Tensor] = {}
    for flag in flags:
        per_device[flag.device] = per_device[flag.device] + flag \
            if flag.device in per_device else flag
    return per_device


class _DeviceScale:
    """The scale and growth tracker as device tensors, updated by torch's own
    ``_amp_update_scale_`` as torch.amp does, so that a fused optimizer (which skips on
    ``found_inf`` inside its kernel) steps with no host sync at all.

    Telemetry comes back through asynchronous copies into pinned memory, read only
    once their CUDA event has completed: ``poll()`` never waits.
    """

    def __init__(self, device: torch.device, scale: float, tracker: int, skipped: int):
        self.device = device
        self.scale_t = torch.full((), scale, dtype=torch.float32, device=device)
        self.tracker_t = torch.full((), tracker, dtype=torch.int32, device=device)
        self.skipped_t = torch.full((), skipped, dtype=torch.float64, device=device)
        self._in_flight: collections.deque = collections.deque()  # copies not yet landed
        self._latest: tuple | None = None  # the newest snapshot that has landed

    def scale(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.scale_t.to(y.device, non_blocking=True)

    def scaled_cotangents(self, ys: Sequence[torch.Tensor],
                          dys: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        if dys is None:
            return [torch.ones_like(y) * self.scale_t.to(y.device) for y in ys]
        return [dy * self.scale_t.to(dy.device, non_blocking=True) for dy in dys]

    def unscale_and_check(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # the reciprocal in float64, as torch.amp does
        inv = self.scale_t.double().reciprocal().float()
        return _check_and_unscale(grads, inv, self.device)

    def check(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return _check_and_unscale(grads, 1.0, self.device)

    def rescale(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        # multiplies by the scale: unscaled gradients back to the scale (no host read)
        return _check_and_unscale(grads, self.scale_t, self.device)

    def step(self, optimizer: Any, unscale: bool, flags: Sequence[torch.Tensor],
             args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        # The attributes torch's fused optimizers read, set as torch.amp sets them: a
        # grad_scale the user preset multiplies ours, or stands alone once the gradients
        # were unscaled; both attributes are removed after the step.
        preset = getattr(optimizer, "grad_scale", None)
        if unscale:
            optimizer.grad_scale = self.scale_t if preset is None else self.scale_t * preset
        else:
            optimizer.grad_scale = preset
        optimizer.found_inf = self._combine(flags)
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf

    def _combine(self, flags: Sequence[torch.Tensor], found_host: bool = False
                 ) -> torch.Tensor:
        found = torch.full((), float(found_host), dtype=torch.float32, device=self.device)
        for f in flags:
            found = found + f.to(self.device, non_blocking=True)
        return found

    def update(self, found_host: bool, flags: Sequence[torch.Tensor], growth: float,
               backoff: float, interval: int, *, steps: int, count: bool,
               new_scale: float | None) -> None:
        found = self._combine(flags, found_host)
        if new_scale is not None:
            self.scale_t.fill_(new_scale)
        else:
            torch._amp_update_scale_(self.scale_t, self.tracker_t, found, growth, backoff,
                                     interval)
        if count:
            self.skipped_t += (found > 0).double()
        self._snapshot(steps, found > 0)

    def _snapshot(self, steps: int, last_found: torch.Tensor) -> None:
        values = torch.stack([self.scale_t.double(), self.tracker_t.double(),
                              self.skipped_t, last_found.double()])
        if self.device.type == "cuda":
            buf = torch.empty(4, dtype=torch.float64, pin_memory=True)
            buf.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            buf, event = values.cpu(), None
        self._in_flight.append((steps, buf, event))
        # Drained here too, not only in poll(): a run that never asks for stats() must
        # not keep a buffer per step.
        self._drain()

    def _drain(self) -> None:
        while self._in_flight and (self._in_flight[0][2] is None
                                   or self._in_flight[0][2].query()):
            self._latest = self._in_flight.popleft()

    def poll(self) -> tuple[int, float, int, int, bool] | None:
        """The newest snapshot whose copy has landed, or None; never waits."""
        self._drain()
        if self._latest is None:
            return None
        steps, buf, _ = self._latest
        scale, tracker, skipped, last = buf.tolist()
        return steps, scale, int(tracker), int(skipped), bool(last)

    def read(self) -> tuple[float, int]:
        return float(self.scale_t.item()), int(self.tracker_t.item())

    def load(self, scale: float, tracker: int | None) -> None:
        self.scale_t.fill_(scale)
        if tracker is not None:
            self.tracker_t.fill_(tracker)


class TorchBackend:
    """unified_amp adapter for PyTorch (CPU and CUDA)."""

    name = "torch"

    def __init__(self) -> None:
        # The dtype-contract kernels are installed by the first enabled unified autocast
        # block, not here: a drop-in user who only swaps GradScaler never gets them, so
        # plain torch.autocast keeps its exact dispatch path and speed.
        self._scale_cache: dict[torch.device, tuple[float, torch.Tensor]] = {}

    # -- devices and dtypes -----------------------------------------------------------
    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def dtype_name(self, dtype: Any) -> str | None:
        if isinstance(dtype, torch.dtype):
            return str(dtype).removeprefix("torch.")
        return None

    def _devices(self, device: str | None) -> list[str]:
        if device is not None:
            return [device]
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]

    @staticmethod
    def _default_dtype(device: str) -> str:
        # bfloat16 on CPU: on these avx512_bf16 CPUs it runs faster than fp32, while
        # float16 runs slower (SPEC §2). float16 on CUDA, the classic AMP choice.
        return "bfloat16" if device == "cpu" else "float16"

    # -- autocast ---------------------------------------------------------------------
    def check_precision(self, dtype: str | None, device: str | None) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise UnsupportedPrecisionError(
                "autocast(device='cuda') was requested, but torch sees no CUDA device"
                f" (torch {torch.__version__}). Use device='cpu' or device=None."
            )
        for dev in self._devices(device):
            want = dtype or self._default_dtype(dev)
            if dev == "cuda" and want == "bfloat16" and not torch.cuda.is_bf16_supported():
                raise UnsupportedPrecisionError(
                    f"autocast dtype 'bfloat16' is not supported by this CUDA device"
                    f" ({torch.cuda.get_device_name()}); use dtype='float16'."
                )

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True) -> Any:
        contexts = []
        for dev in self._devices(device):
            if enabled and contract:
                _install_policy(dev)
            ctx = torch.autocast(
                dev, dtype=_DTYPES[dtype or self._default_dtype(dev)], enabled=enabled
            )
            ctx.__enter__()
            contexts.append(ctx)
        _policy.stack.append(enabled and contract)
        return contexts

    def exit_autocast(self, token: Any) -> None:
        _policy.stack.pop()
        for ctx in reversed(token):
            ctx.__exit__(None, None, None)

    def is_autocast_enabled(self) -> bool:
        return any(torch.is_autocast_enabled(dev) for dev in self._devices(None))

    # -- gradients --------------------------------------------------------------------
    def new_tape(self) -> _Tape:
        return _Tape()

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def grads(self, params: Any) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]

    def drop_grads(self, params: Any) -> None:
        for p in params:
            p.grad = None

    def grad_version(self, grad: torch.Tensor) -> int:
        # Bumped by every in-place write (a backward accumulating into it, clipping);
        # the fused unscale kernel leaves it alone.
        return grad._version

    def watch_backward(self, tensor: torch.Tensor, callback: Any) -> bool:
        if not tensor.requires_grad:
            return False
        tensor.register_hook(lambda grad: callback())  # returns None: grad unchanged
        return True

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float,
                       norm_type: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        # Under FSDP2 the norm is a DTensor; torch 2.7 and 2.8 read its float as this rank's
        # local part, so ask for the global value explicitly.
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    # -- loss scaling -----------------------------------------------------------------
    def _scale_tensor(self, scale: float, device: torch.device) -> torch.Tensor:
        # A float32 0-dim tensor, as torch.amp keeps its scale: y * tensor gives the same
        # bits as torch.amp.GradScaler.scale(y). Cached until the scale changes.
        cached = self._scale_cache.get(device)
        if cached is None or cached[0] != scale:
            cached = (scale, torch.full((), scale, dtype=torch.float32, device=device))
            self._scale_cache[device] = cached
        return cached[1]

    def scale(self, y: torch.Tensor, scale: float) -> torch.Tensor:
        return y * self._scale_tensor(scale, y.device)

    def scaled_cotangents(self, ys: Sequence[torch.Tensor], dys: Sequence[Any] | None,
                          scale: float) -> list[torch.Tensor]:
        if dys is None:
            return [torch.full_like(y, scale) for y in ys]
        return [dy * self._scale_tensor(scale, dy.device) for dy in dys]

    def unscale_and_check(self, grads: Sequence[torch.Tensor], inv_scale: float) -> Any:
        return _check_and_unscale(grads, inv_scale)

    def flag_is_set(self, flag: torch.Tensor) -> bool:
        return bool(flag.item())

    # -- overflow forensics: after an overflow, or while tracing ----------------------
    def nonfinite_counts(self, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        if not tensors:
            return []
        with torch.no_grad():
            counts = []
            for t in tensors:
                t = t._values() if t.is_sparse else t
                # A DTensor's own counts would be a collective: count this rank's shard.
                t = t.to_local() if hasattr(t, "to_local") else t
                counts.append(torch.stack([torch.isinf(t).sum(), torch.isnan(t).sum()]))
            target = counts[0].device
            rows = torch.stack([c.to(target) for c in counts]).tolist()  # the one read
        return [(int(n_inf), int(n_nan)) for n_inf, n_nan in rows]

    def finite_flag(self, tensor: torch.Tensor, per_row: bool = False) -> Any:
        # min and max propagate NaN and hold any +-inf: one reduction kernel, about ten
        # times cheaper than isfinite().all() (a composite of four kernels) on CPU.
        t = tensor.detach()
        if t.numel() == 0:
            zeros = torch.zeros(t.shape[0] if per_row else (), device=t.device)
            return zeros, zeros
        if not per_row:
            return torch.aminmax(t)
        return torch.aminmax(t.flatten(1) if t.dim() > 1 else t.unsqueeze(1), dim=1)

    def read_finite_flags(self, flags: Sequence[Any]) -> list[list[bool]]:
        if not flags:
            return []
        target = flags[0][0].device
        parts = [v.reshape(-1).float().to(target) for flag in flags for v in flag]
        values = torch.cat(parts).tolist()  # the one read
        out, start = [], 0
        for flag in flags:
            n = flag[0].numel()
            lows, highs = values[start:start + n], values[start + n:start + 2 * n]
            out.append([math.isfinite(lo) and math.isfinite(hi)
                        for lo, hi in zip(lows, highs)])
            start += 2 * n
        return out

    def named_modules(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def named_parameters(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        return list(model.named_parameters())

    def add_forward_hook(self, module: torch.nn.Module, hook: Any, pre: bool = False) -> Any:
        if pre:
            return module.register_forward_pre_hook(hook)
        return module.register_forward_hook(hook)

    # -- fused optimizers (optional part of the interface) ------------------------------
    def steps_on_device(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` takes ``grad_scale``/``found_inf`` and skips on the
        device by itself: torch's fused Adam, AdamW and SGD (``fused=True``)."""
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False))

    def device_scale(self, optimizer: Any, scale: float, tracker: int,
                     skipped: int) -> _DeviceScale:
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        return _DeviceScale(device, scale, tracker, skipped)

    # -- opt levels ---------------------------------------------------------------------
    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def device_type(self, tensor: torch.Tensor) -> str:
        return "cuda" if tensor.device.type == "cuda" else "cpu"

    def default_low_dtype(self, device: str) -> str:
        return self._default_dtype(device)

    def cast(self, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
        return tensor.to(_ALL_DTYPES[dtype])

    def cast_module(self, module: torch.nn.Module, dtype: str,
                    keep_batchnorm_fp32: bool) -> None:
        target = _ALL_DTYPES[dtype]
        with torch.no_grad():
            for sub in module.modules():
                if keep_batchnorm_fp32 and isinstance(sub, _BATCH_NORM):
                    continue
                # Through .data, as Module.to() does: each Parameter object stays the
                # same, so the optimizers that hold it need no change.
                for p in sub.parameters(recurse=False):
                    if p.is_floating_point():
                        p.data = p.data.to(target)
                for name, buf in sub.named_buffers(recurse=False):
                    if buf is not None and buf.is_floating_point():
                        setattr(sub, name, buf.to(target))

    def low_precision_batch_norm(self, dtype: str) -> bool:
        return True

    def steps_low_precision(self, optimizer: Any) -> bool:
        return True

    def master_copy(self, param: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(param.detach().to(torch.float32, copy=True))

    def optimizer_state(self, optimizer: Any) -> Any:
        return optimizer.state

    def take_grads(self, params: Sequence[torch.Tensor]) -> list[Any]:
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    def restore_grads(self, params: Sequence[torch.Tensor], grads: Sequence[Any]) -> None:
        into, add = [], []
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                into.append(p.grad)
                add.append(g)
        if into:
            with torch.no_grad():
                torch._foreach_add_(into, add)

    def grads_to_masters(self, params: Sequence[torch.Tensor],
                         masters: Sequence[torch.Tensor]) -> None:
        pairs = [(p, m) for p, m in zip(params, masters) if p.grad is not None]
        if not pairs:
            return
        bufs = [torch.empty_like(m) for _, m in pairs]
        grads = [g for p, _ in pairs if (g := p.grad) is not None]  # all, as above
        with torch.no_grad():
            torch._foreach_copy_(bufs, grads)  # cast, fused
        for (p, m), buf in zip(pairs, bufs):
            m.grad = buf
            p.grad = None

    def copy_params(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(list(dst), list(src))

    def skipped_step_result(self, optimizer: Any) -> None:
        return None

    # -- distributed (optional part of the interface) -----------------------------------
    def world_group(self) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.group.WORLD if dist.get_world_size() > 1 else None

    def check_group(self, group: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "GradScaler(process_group=...) was given a group, but torch.distributed is"
                " not initialised: call torch.distributed.init_process_group() first."
            )
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"GradScaler process_group must be a torch.distributed ProcessGroup (e.g."
                f" torch.distributed.group.WORLD or one from new_group()); got"
                f" {type(group).__name__} {group!r}."
            )

    def grad_kind(self, param: torch.Tensor) -> str:
        if isinstance(param, _dtensor_class()):
            return "dtensor"  # torch all-reduces found_inf inside its kernel's dispatch
        if getattr(param, "_fsdp_flattened", False):
            return "sharded"  # FSDP1: each rank holds its own shard of the gradient
        return "local"

    def zero_grad_like(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param)  # a DTensor for a DTensor parameter

    def clean_flag(self, params: Sequence[torch.Tensor], group: Any) -> torch.Tensor:
        device = params[0].device if params else self._group_device(group)
        return torch.zeros((), dtype=torch.float32, device=device)

    @staticmethod
    def _group_device(group: Any) -> torch.device:
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_max_async(self, flag: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
        if flag.device.type == "cpu" and dist.get_backend(group) == "nccl":
            flag = flag.to(self._group_device(group), non_blocking=True)  # CPU offload
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        return flag, work

    def grad_sync_paused(self, module: Any) -> bool:
        # DDP.no_sync() sets this to False for the window's duration.
        return getattr(module, "require_backward_grad_sync", True) is False

    def module_clip_grad_norm(self, module: Any, max_norm: float,
                              norm_type: float) -> float | None:
        clip = getattr(module, "clip_grad_norm_", None)  # FSDP1's: the global norm
        if clip is None:
            return None
        return float(clip(max_norm, norm_type))

    # -- the scaler's class (optional part of the interface) ------------------------------
    def scaler_class(self, device: str | None) -> type:
        """A subclass of unified_amp.GradScaler that is also torch's own GradScaler
        (torch.cuda.amp's when made for CUDA), for runners that check isinstance."""
        cuda = device.split(":")[0] == "cuda" if device else torch.cuda.is_available()
        return TorchCudaGradScaler if cuda else TorchGradScaler


class TorchGradScaler(_core.GradScaler, torch.amp.GradScaler):
    """``unified_amp.GradScaler`` on the torch backend; also a ``torch.amp.GradScaler``.

    All behaviour is the core's (torch.amp's ``__init__`` never runs). The private
    attributes below are the ones code in the wild reads from torch.amp's scaler
    (docs/DROP_IN.md lists them); each is derived from the core's state on demand.
    """

    def _torch_device(self) -> torch.device:
        if self._dev is not None:
            return self._dev.device
        if self._device:
            return torch.device(self._device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # torch.amp's scaler keeps these as plain attributes; here they are read-only views
    # of the core's state, on purpose (docs/DROP_IN.md), hence the ignored overrides.
    @property
    def _scale(self) -> torch.Tensor | None:  # type: ignore[override]
        """The scale as a float32 0-dim tensor (a copy, except in device mode)."""
        if not self._enabled:
            return None
        if self._dev is not None:
            return self._dev.scale_t
        return torch.full((), self._scale_value, dtype=torch.float32,
                          device=self._torch_device())

    @property
    def _growth_tracker(self) -> torch.Tensor | None:  # type: ignore[override]
        if not self._enabled:
            return None
        if self._dev is not None:
            return self._dev.tracker_t
        return torch.full((), self._tracker, dtype=torch.int32, device=self._torch_device())

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    # torch.amp keeps the values its lazily made _scale/_growth_tracker tensors start
    # from; load_state_dict() and unpickling set them. There is no lazy start here, so
    # they read (and write) the scale and tracker the next step uses -- the same values
    # wherever torch.amp's have not yet been overtaken by its tensors.
    @property
    def _init_scale(self) -> float:
        self._sync_from_device()
        return self._scale_value

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._set_scale(self._valid_scale(value, "_init_scale"))

    @property
    def _init_growth_tracker(self) -> int:
        return self._get_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"GradScaler _init_growth_tracker must be an int >= 0;"
                             f" got {value!r}.")
        self._sync_from_device()
        self._tracker = value
        if self._dev is not None:
            self._dev.load(self._scale_value, value)

    def _get_growth_tracker(self) -> int:
        self._sync_from_device()
        return self._tracker if self._enabled else 0

    def _flags_of(self, checks: Sequence[Any]) -> list[torch.Tensor]:
        flags = []
        for check in checks:
            if check.flag is not None:
                flags.append(check.ready())
            elif check.found is not None:
                flags.append(torch.full((), float(check.found), device=self._torch_device()))
        return flags

    # torch annotates these two as dict[str, Any]; its own implementation, which these
    # mirror, keys them by torch.device.
    def _found_inf_per_device(  # type: ignore[override]
            self, optimizer: Any) -> dict[torch.device, torch.Tensor]:
        state = self._opt_states.get(id(optimizer))
        return _by_device(self._flags_of(state.checks if state is not None else []))

    def _check_inf_per_device(  # type: ignore[override]
            self, optimizer: Any) -> dict[torch.device, torch.Tensor]:
        # What optimizers with the older step(grad_scaler=...) contract call: check
        # without unscaling (they unscale inside), counted by the next update().
        params = [p for g in optimizer.param_groups for p in g["params"]]
        check = self._check(params, unscale=False, read=False, allow_fp16=True)
        self._opt_state(optimizer).checks.append(check)
        return self._found_inf_per_device(optimizer)

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:  # type: ignore[override]
        """A read-only snapshot in torch.amp's shape (writing to it changes nothing)."""
        stages = {_core._Stage.READY: OptState.READY, _core._Stage.UNSCALED: OptState.UNSCALED,
                  _core._Stage.STEPPED: OptState.STEPPED}
        snapshot: dict[int, dict[str, Any]] = defaultdict(
            lambda: {"stage": OptState.READY, "found_inf_per_device": {}})
        for key, state in self._opt_states.items():
            snapshot[key] = {"stage": stages[state.stage],
                             "found_inf_per_device": _by_device(self._flags_of(state.checks))}
        return snapshot

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch.amp's helper, for code that calls it directly: unscales the optimizer's
        gradients by ``inv_scale`` and returns a found-inf flag per device. The scaler's
        own methods do not go through it, so overriding it changes nothing."""
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if not allow_fp16 and g.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
                    # As torch.amp: duplicate indices summed first, since their float16
                    # sum may overflow where each value alone does not.
                    g = p.grad = g.coalesce()
                grads.append(g)
        found = _check_and_unscale_per_device(grads, inv_scale)
        # torch.amp's kernel sets the flag it is given (a copy per device) to 1 on a find
        return {device: torch.maximum(flag, found_inf.to(device))
                for device, flag in found.items()}


class TorchCudaGradScaler(TorchGradScaler, torch.cuda.amp.GradScaler):
    """The same, made for CUDA: also a ``torch.cuda.amp.GradScaler`` (older runners
    check that class)."""
