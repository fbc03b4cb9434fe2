"""``GradScaler``: dynamic loss scaling, one state machine for both frameworks.

The state (scale, growth tracker, per-optimizer stage) lives here as plain Python
numbers; adapters only scale tensors, run the fused check-and-unscale kernel and read
its flag back. That flag read is the only device-to-host sync, once per unscale, so at
most once per optimizer step.

One exception, for optimizers that skip a step on the device by themselves (torch's
``fused=True`` Adam/AdamW/SGD read ``grad_scale``/``found_inf`` tensors): once such an
optimizer steps, the adapter keeps the scale and growth tracker in device tensors and
updates them with the framework's own kernel, so a step needs no sync at all. The stage
logic below is the same in both modes; only where the arithmetic runs differs.
"""

from __future__ import annotations

import enum
import inspect
import math
import struct
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ._registry import get_backend
from ._targets import is_optimizer, params_of

__all__ = ["GradScaler", "next_scale"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _f32(x: float) -> float:
    """``x`` rounded to float32, the precision torch keeps its scale in (inf past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def next_scale(
    scale: float,
    growth_tracker: int,
    found_inf: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[float, int]:
    """One ``update()`` of the scale, in the float32 arithmetic of ``torch._amp_update_scale_``.

    Returns the new ``(scale, growth_tracker)``. A growth that would overflow float32 is
    not taken, as in torch.
    """
    if found_inf:
        return _f32(scale * backoff_factor), 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = _f32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_factors(init_scale: Any, growth_factor: Any, backoff_factor: Any,
                   growth_interval: Any, scale_name: str = "init_scale") -> None:
    """Raises TypeError / ValueError naming the first bad hyper-parameter."""
    for name, value in ((scale_name, init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor)):
        if not _is_number(value):
            raise TypeError(f"GradScaler {name} must be a number; got {value!r}.")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(
            f"GradScaler {scale_name} must be a positive finite number; got {init_scale!r}."
            f" The usual start is 2.0**16."
        )
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ValueError(
            f"GradScaler growth_factor must be > 1.0 (the scale is multiplied by it after"
            f" growth_interval clean steps); got {growth_factor!r}. The usual value is 2.0."
        )
    if not (0.0 < backoff_factor < 1.0):
        raise ValueError(
            f"GradScaler backoff_factor must be in (0, 1) (the scale is multiplied by it"
            f" after an overflow); got {backoff_factor!r}. The usual value is 0.5."
        )
    if not isinstance(growth_interval, int) or isinstance(growth_interval, bool):
        raise TypeError(
            f"GradScaler growth_interval must be an int; got {growth_interval!r}."
        )
    if growth_interval < 0:
        raise ValueError(
            f"GradScaler growth_interval must be >= 0 (0 never grows the scale); got"
            f" {growth_interval!r}. The usual value is 2000."
        )


# The call forms users bring with them, as signatures to bind (see GradScaler's docstring).
def _unified_form(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=2000, enabled=True, *, device=None):
    pass


def _torch_form(device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=2000, enabled=True):
    pass


_UNIFIED_SIG = inspect.signature(_unified_form)
_TORCH_SIG = inspect.signature(_torch_form)

_STATE_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class GradScaler:
    """Dynamic loss scaling for mixed-precision training, on the active backend.

    Call forms::

        amp.GradScaler()                          # init_scale=2**16 on both backends
        amp.GradScaler("cuda") / GradScaler(device="cpu", init_scale=...)   # torch.amp's
        amp.GradScaler(2.0**4)                    # megengine.amp's (positional init_scale)

    Automatic mode: ``scaler.backward(gm, loss)`` then ``optimizer.step()``.
    Manual mode: ``gm.backward(scaler.scale(loss))`` (any number of times) -> custom
    gradient ops on scaled grads -> ``scaler.unscale(target)`` -> custom ops on true
    grads (clipping) -> ``scaler.step(optimizer)`` or the optimizer's own step ->
    ``scaler.update()``.

    When any unscaled gradient is inf/NaN, the gradients that were checked are dropped
    (set to None) so that no optimizer step can touch their parameters, ``step()`` skips
    the optimizer, and ``update()`` multiplies the scale by ``backoff_factor``. After
    ``growth_interval`` clean updates in a row the scale grows by ``growth_factor``.

    Args:
        init_scale: the first scale, a positive finite number.
        growth_factor: > 1.
        backoff_factor: in (0, 1).
        growth_interval: clean updates before growing; 0 never grows.
        enabled: False makes every method a pass-through (one code path for fp32).
        device: accepted for torch.amp compatibility; "cuda" on a machine without
            CUDA disables the scaler with a warning, as torch.amp does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and isinstance(args[0], str):
            bound = _TORCH_SIG.bind(*args, **kwargs)
        else:
            bound = _UNIFIED_SIG.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        _check_factors(a["init_scale"], a["growth_factor"], a["backoff_factor"],
                       a["growth_interval"])
        if not isinstance(a["enabled"], bool):
            raise TypeError(f"GradScaler enabled must be a bool; got {a['enabled']!r}.")
        self._backend: Any = None
        self._enabled = a["enabled"]
        device = a["device"]
        if device is not None and not isinstance(device, str):
            device = str(device)
        if self._enabled and device is not None and device.split(":")[0] == "cuda":
            if not self._be().cuda_available():
                warnings.warn(
                    "GradScaler(device='cuda') is enabled, but CUDA is not available."
                    "  Disabling.",
                    stacklevel=2,
                )
                self._enabled = False
        self._device = device
        self._scale = _f32(float(a["init_scale"]))
        self._growth_factor = float(a["growth_factor"])
        self._backoff_factor = float(a["backoff_factor"])
        self._growth_interval = a["growth_interval"]
        self._growth_tracker = 0
        self._steps = 0
        self._skipped_steps = 0
        self._last_step_skipped = False
        self._as_of_step = 0  # the step the telemetry describes (lags only in device mode)
        self._dev: Any = None  # the adapter's device-resident scale, once a fused step ran
        self._new_iteration()

    # -- internals ----------------------------------------------------------------------
    def _be(self) -> Any:
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    def _new_iteration(self) -> None:
        # What happened since the last update(), keyed by id() like torch.amp: the keys
        # only live for one iteration, so a recycled id cannot leak into the next.
        self._opt_stage: dict[int, _Stage] = {}
        # checked params -> whether their check found inf/NaN: a bool once read on the
        # host, or the adapter's unread device flag (fused optimizers, device mode)
        self._param_found: dict[int, Any] = {}
        self._checked = False  # any check ran (even over no gradients)
        self._found_inf = False  # an inf/NaN was seen on the host
        self._flags: list[Any] = []  # device mode: every flag, read or not, for update()

    def _steps_on_device(self, optimizer: Any) -> bool:
        backend = self._be()
        supported = getattr(backend, "steps_on_device", None)
        if supported is None or not supported(optimizer):
            return False
        if self._dev is None:
            self._dev = backend.device_scale(optimizer, self._scale, self._growth_tracker,
                                             self._skipped_steps)
        return True

    def _inv_scale(self) -> float:
        # The reciprocal in float64, rounded to float32 by the adapter: torch.amp's
        # "FP32 division can be imprecise" recipe, and what megengine.amp computes too.
        return 1.0 / self._scale if self._scale else math.inf

    def _check(self, params: list[Any], *, unscale: bool = True, read: bool = True) -> Any:
        """Checks the gradients of ``params`` for inf/NaN in one fused call, unscaling
        them too unless a fused optimizer will. Returns the host bool when ``read``
        (the sync), else the device flag."""
        backend = self._be()
        grads = backend.grads(params)
        for dtype in {g.dtype for g in grads}:
            if backend.dtype_name(dtype) == "float16":
                raise ValueError(
                    "Attempting to unscale FP16 gradients. GradScaler needs float32"
                    " parameters (and so float32 gradients): keep the model in float32 and"
                    " let autocast run the low-precision ops."
                )
        found: Any = False
        if grads:
            if self._dev is not None:
                flag = self._dev.unscale_and_check(grads) if unscale else self._dev.check(grads)
                self._flags.append(flag)
            else:
                flag = backend.unscale_and_check(grads, self._inv_scale())
            found = backend.flag_is_set(flag) if read else flag  # the one sync
        if found is True:
            backend.drop_grads(params)
            self._found_inf = True
        for p in params:
            self._param_found[id(p)] = found
        self._checked = True
        return found

    # -- loss scaling -------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list/tuple of tensors) times the current scale."""
        if not self._enabled:
            return outputs
        backend = self._be()

        def apply(val: Any) -> Any:
            if backend.is_tensor(val):
                if self._dev is not None:
                    return self._dev.scale(val)
                return backend.scale(val, self._scale)
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, Iterable) and not isinstance(val, (str, bytes, Mapping)):
                return map(apply, val)
            raise ValueError(
                f"GradScaler.scale() expects a {backend.name} tensor or an iterable of"
                f" them; got {type(val).__name__}."
            )

        return apply(outputs)

    def backward(self, gm: Any, y: Any = None, dy: Any = None, *,
                 unscale_grad: bool = True, update_scale: bool = True) -> None:
        """Automatic mode: scaled backward, then (by default) unscale and update.

        Args:
            gm: an ``amp.GradManager`` or MegEngine's own ``GradManager``.
            y, dy: as ``gm.backward(y, dy)``; ``dy`` (default ones) is multiplied by
                the scale.
            unscale_grad: False leaves the gradients scaled, to accumulate several
                backward passes and unscale once with ``unscale(gm)``.
            update_scale: whether to ``update()`` after unscaling (ignored when
                ``unscale_grad`` is False).
        """
        if not self._enabled:
            gm.backward(y, dy)
            return
        ys = [] if y is None else list(y) if isinstance(y, (list, tuple)) else [y]
        if dy is None:
            dys = None
        else:
            dys = list(dy) if isinstance(dy, (list, tuple)) else [dy]
            if len(dys) != len(ys):
                raise ValueError(
                    f"GradScaler.backward() got {len(ys)} output(s) y but {len(dys)}"
                    f" cotangent(s) dy; pass one dy per y, or dy=None for ones."
                )
        if self._dev is not None:
            cotangents = self._dev.scaled_cotangents(ys, dys)
        else:
            cotangents = self._be().scaled_cotangents(ys, dys, self._scale)
        gm.backward(ys, cotangents)
        if unscale_grad:
            self.unscale(gm)
            if update_scale:
                self.update()

    def unscale(self, target: Any) -> "GradScaler":
        """Divides the gradients of ``target`` by the scale, in place, and checks them.

        ``target`` is a GradManager, an optimizer, or an iterable of parameters. Call it
        once per iteration for a given set of gradients, after all of their backward
        passes; returns self (megengine.amp's chaining).

        Raises:
            RuntimeError: these gradients were already unscaled since the last
                ``update()``, or their optimizer already stepped.
            ValueError: a gradient is float16.
        """
        if not self._enabled:
            return self
        if is_optimizer(target):
            stage = self._opt_stage.get(id(target), _Stage.READY)
            if stage is _Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last"
                    " update(). Unscaling twice would divide its gradients by the scale"
                    " twice; call scaler.update() to finish the iteration first."
                )
            if stage is _Stage.STEPPED:
                raise RuntimeError(
                    "unscale_() is being called after step(). Unscale before"
                    " scaler.step(optimizer) (step() unscales by itself when you don't)."
                )
        params = params_of(target, self._be(), "GradScaler.unscale()")
        again = [p for p in params if id(p) in self._param_found]
        if again:
            raise RuntimeError(
                f"unscale() has already been called on these gradients since the last"
                f" update() ({len(again)} of the {len(params)} parameters given were"
                f" unscaled already). Unscaling twice would divide them by the scale twice;"
                f" call scaler.update() before unscaling them again."
            )
        # A fused optimizer skips on the device, so its flag need not come to the host.
        on_device = is_optimizer(target) and self._steps_on_device(target)
        self._check(params, read=not on_device)
        if is_optimizer(target):
            self._opt_stage[id(target)] = _Stage.UNSCALED
        return self

    unscale_ = unscale  # torch.amp's name

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscales ``optimizer``'s gradients if not yet done, then steps it unless an
        inf/NaN gradient was found for its parameters since the last ``update()``.

        Returns what ``optimizer.step(*args, **kwargs)`` returns, or None if skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled."
            )
        if not is_optimizer(optimizer):
            raise TypeError(
                f"GradScaler.step() expects an optimizer (an object with param_groups and"
                f" step()); got {type(optimizer).__name__}."
            )
        key = id(optimizer)
        stage = self._opt_stage.get(key, _Stage.READY)
        if stage is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call"
                " scaler.update() once per iteration, after stepping every optimizer."
            )
        on_device = self._steps_on_device(optimizer)
        params = params_of(optimizer, self._be(), "GradScaler.step()")
        fused_unscale = False
        if stage is _Stage.READY:
            # Gradients unscaled through a GradManager or a parameter list are not
            # unscaled again; the rest are, in one fused call.
            pending = [p for p in params if id(p) not in self._param_found]
            # A fused optimizer unscales inside its own kernel (grad_scale), as with
            # torch.amp -- unless some of its gradients were unscaled already.
            fused_unscale = on_device and len(pending) == len(params)
            if pending:
                self._check(pending, unscale=not fused_unscale, read=not on_device)
        found = [self._param_found.get(id(p), False) for p in params]
        if not on_device:  # an ordinary optimizer needs every verdict on the host
            verdicts: dict[int, bool] = {}
            for f in found:
                if not isinstance(f, bool) and id(f) not in verdicts:
                    verdicts[id(f)] = self._be().flag_is_set(f)
            found = [verdicts.get(id(f), f) for f in found]
        if any(f is True for f in found):
            result = None
        elif on_device:
            flags = list({id(f): f for f in found if f is not False}.values())
            result = self._dev.step(optimizer, fused_unscale, flags, args, kwargs)
        else:
            result = optimizer.step(*args, **kwargs)
        self._opt_stage[key] = _Stage.STEPPED
        return result

    def update(self, new_scale: Any = None) -> None:
        """Ends the iteration: backs the scale off if an overflow was found since the
        last update, else counts a clean step (and grows after ``growth_interval``).

        Args:
            new_scale: set this scale instead (a positive finite number).

        Raises:
            RuntimeError: nothing was unscaled since the last update (and no new_scale).
        """
        if not self._enabled:
            return
        if new_scale is not None:
            new_scale = self._valid_scale(new_scale, "update(new_scale=...)")
        elif not self._checked:
            raise self._nothing_unscaled()
        if self._dev is not None:
            if self._checked:
                self._steps += 1
            self._dev.update(self._found_inf, self._flags, self._growth_factor,
                             self._backoff_factor, self._growth_interval,
                             steps=self._steps, count=self._checked, new_scale=new_scale)
        else:
            if new_scale is not None:
                self._scale = new_scale
            else:
                self._scale, self._growth_tracker = next_scale(
                    self._scale, self._growth_tracker, self._found_inf,
                    self._growth_factor, self._backoff_factor, self._growth_interval,
                )
            if self._checked:
                self._count_step(self._found_inf)
        self._new_iteration()

    @staticmethod
    def _nothing_unscaled() -> RuntimeError:
        return RuntimeError(
            "update() was called, but no gradients were unscaled since the last"
            " update(), so there is nothing to decide the new scale from. Call"
            " scaler.step(optimizer) or scaler.unscale(...) first, or pass"
            " update(new_scale=...)."
        )

    def _count_step(self, skipped: bool) -> None:
        self._steps += 1
        self._skipped_steps += int(skipped)
        self._last_step_skipped = skipped
        self._as_of_step = self._steps

    def _set_scale(self, value: float) -> None:
        self._scale = value
        if self._dev is not None:
            self._dev.load(value, None)

    def _sync_from_device(self) -> None:
        """Reads the device-resident scale and tracker back (a sync, as torch.amp's
        get_scale() is)."""
        if self._dev is not None:
            self._scale, self._growth_tracker = self._dev.read()

    def _valid_scale(self, value: Any, what: str) -> float:
        if not _is_number(value):
            backend = self._be()
            if backend.is_tensor(value) and _numel(value) == 1:
                value = float(value.item())
            else:
                raise TypeError(
                    f"GradScaler {what} must be a number or a 1-element tensor;"
                    f" got {value!r}."
                )
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"GradScaler {what} must be a positive finite number; got {value!r}."
            )
        return _f32(float(value))

    # -- inspection ---------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). No device sync,
        except after a fused optimizer moved the scale to the device (as torch.amp)."""
        if not self._enabled:
            return 1.0
        self._sync_from_device()
        return self._scale

    @property
    def scale_factor(self) -> float:
        """megengine.amp's name for the current scale; assignable."""
        return self.get_scale()

    @scale_factor.setter
    def scale_factor(self, value: Any) -> None:
        self._set_scale(self._valid_scale(value, "scale_factor"))

    def is_enabled(self) -> bool:
        return self._enabled

    def stats(self) -> dict[str, Any]:
        """Telemetry, as plain Python values, without a device sync.

        Keys: ``scale``, ``growth_tracker``, ``steps`` (updates that followed an
        unscale), ``skipped_steps`` (of those, how many found an inf/NaN),
        ``last_step_skipped``, ``enabled``, and ``as_of_step``: the step the other
        values describe. It equals ``steps`` except with fused optimizers on a GPU,
        where the values arrive asynchronously and may trail by a step or two.
        """
        if self._enabled and self._dev is not None:
            snapshot = self._dev.poll()
            if snapshot is not None:
                (self._as_of_step, self._scale, self._growth_tracker, self._skipped_steps,
                 self._last_step_skipped) = snapshot
        return {
            "scale": self._scale if self._enabled else 1.0,
            "growth_tracker": self._growth_tracker,
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "last_step_skipped": self._last_step_skipped,
            "enabled": self._enabled,
            "as_of_step": self._as_of_step,
        }

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_factors(self._scale, new_factor, self._backoff_factor, self._growth_interval)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factors(self._scale, self._growth_factor, new_factor, self._growth_interval)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_factors(self._scale, self._growth_factor, self._backoff_factor, new_interval)
        self._growth_interval = new_interval

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.amp's keys, plain Python numbers, loadable by either backend.
        Empty when disabled (as torch.amp)."""
        if not self._enabled:
            return {}
        self._sync_from_device()
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a dict from ``state_dict()``, torch.amp's, or megengine.amp's
        (``scale_factor``). A malformed dict raises ValueError (TypeError if it is no
        mapping at all) and leaves the scaler unchanged. No-op when disabled."""
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"GradScaler.load_state_dict() expects a dict from state_dict(); got"
                f" {type(state_dict).__name__}."
            )
        if len(state_dict) == 0:
            raise ValueError(
                "The source state dict is empty, possibly because it was saved from a"
                " disabled instance of GradScaler."
            )
        has_t, has_m = "scale" in state_dict, "scale_factor" in state_dict
        if not (has_t or has_m):
            raise ValueError(
                f"GradScaler state dict has no 'scale' (torch.amp) or 'scale_factor'"
                f" (megengine.amp) entry; its keys are {sorted(state_dict)}."
            )
        if has_t and has_m and state_dict["scale"] != state_dict["scale_factor"]:
            raise ValueError(
                f"GradScaler state dict has both 'scale' ({state_dict['scale']!r}) and"
                f" 'scale_factor' ({state_dict['scale_factor']!r}) and they disagree."
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"GradScaler state dict is missing {missing}; expected the keys 'scale',"
                f" {', '.join(repr(k) for k in _STATE_KEYS)} from state_dict()."
            )
        scale = state_dict["scale"] if has_t else state_dict["scale_factor"]
        tracker = state_dict["_growth_tracker"]
        try:
            _check_factors(scale, state_dict["growth_factor"], state_dict["backoff_factor"],
                           state_dict["growth_interval"], scale_name="scale")
            if not isinstance(tracker, int) or isinstance(tracker, bool) or tracker < 0:
                raise ValueError(f"_growth_tracker must be an int >= 0; got {tracker!r}.")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"GradScaler state dict is malformed: {exc}") from None
        self._scale = _f32(float(scale))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = state_dict["growth_interval"]
        self._growth_tracker = tracker
        if self._dev is not None:
            self._dev.load(self._scale, tracker)

    def __getstate__(self) -> dict[str, Any]:
        if self._opt_stage or self._checked:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning of an"
                " iteration, or at the end after scaler.update()."
            )
        self._sync_from_device()
        state = self.__dict__.copy()
        state["_backend"] = None  # re-resolved on first use after unpickling
        state["_dev"] = None  # device tensors are remade at the next fused step
        return state

    def __repr__(self) -> str:
        return (
            f"GradScaler(scale={self.get_scale()}, growth_factor={self._growth_factor},"
            f" backoff_factor={self._backoff_factor},"
            f" growth_interval={self._growth_interval}, enabled={self._enabled})"
        )


def _numel(t: Any) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n
