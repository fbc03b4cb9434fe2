"""The native scaler class: a unified_amp GradScaler that is also torch's own."""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from typing import Any, Sequence, cast

import torch
from torch.amp.grad_scaler import OptState

from unified_amp import capabilities
from unified_amp.scaler import GradScaler

from .device_scale import TorchDeviceScale
from .scaling import by_device, check_and_unscale_per_device

# The eager shortcut around torch.compiler.disable needs dynamo's frame-evaluator getter:
# checked on torch 2.13; on 2.7 calling it from a compiled step crashes the process, and
# the versions between are untested, so they keep the disable wrapper on every call.
_CHEAP_EAGER = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) \
    >= (2, 13) and hasattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback")
_frame_evaluator: Any = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback",
                                None)


class NativeScaler(capabilities.NativeScalerClass):
    """Which GradScaler subclass ``amp.GradScaler(...)`` makes on torch."""

    def scaler_class(self, device: str | None) -> type:
        """A subclass of unified_amp.GradScaler that is also torch's own GradScaler
        (torch.cuda.amp's when made for CUDA), for runners that check isinstance."""
        cuda = device.split(":")[0] == "cuda" if device else torch.cuda.is_available()
        return TorchCudaGradScaler if cuda else TorchGradScaler


# The scaler's public methods keep host state (the scale as a Python float, the ledger,
# per-optimizer stages) and read device flags: inside a function that torch.compile
# traces they run eagerly, as dynamo runs torch.amp.GradScaler's host reads, instead of
# being traced into a graph whose side effects dynamo would replay out of order (the
# fused optimizers' grad_scale attribute, set and deleted around opt.step()).
_HOST_SIDE = ("scale", "backward", "unscale", "unscale_", "step", "update", "get_scale",
              "stats", "state_dict", "load_state_dict", "watch", "last_overflow")


def _optimizer_compiled_in_step(eager_step: Any) -> Any:
    """``step`` as dynamo should see it inside a compiled function: the scaler's host
    work (unscale, the flag read, its bookkeeping) runs eagerly, as ``eager_step``
    does, but the optimizer's own ``step()`` is called here, in code dynamo traces, so
    it is compiled as it is when torch.amp's GradScaler.step calls it. (Left inside the
    eager part, the optimizer ran eagerly: a compiled step 1.03x torch.amp's.) A fused
    optimizer's step, which the device scale hands ``grad_scale`` and ``found_inf``
    around, stays in the eager part: traced, dynamo replayed that handing out of
    order."""

    @torch.compiler.disable
    def host_part(self: Any, optimizer: Any, args: tuple, kwargs: dict
                  ) -> tuple[tuple[Any, tuple, dict] | None, Any]:
        return self.adapter_view.step_deferred(
            functools.partial(eager_step, self), optimizer, args, kwargs)

    @functools.wraps(eager_step)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or _inside_a_compiled_call():
            call, result = host_part(self, optimizer, args, kwargs)
            if call is not None:
                opt, a, k = call
                result = opt.step(*a, **k)
            return result
        return eager_step(self, optimizer, *args, **kwargs)

    # As torch.amp's GradScaler.step, which dynamo's rules skip: a compiled function
    # breaks its graph at the call (the disable marker functools.wraps copied from
    # eager_step), and dynamo runs this frame as it is, compiling the optimizer's step
    # it calls as a frame of its own. Compiled itself, it broke twice more (at host_part,
    # and at the optimizer's own break, met again inside the traced call): GPT-2's
    # whole compiled step had 2 graph breaks more than torch.amp's.
    torch._dynamo.eval_frame.skip_code(step.__code__)  # type: ignore[attr-defined]
    return step


def _inside_a_compiled_call() -> bool:
    """Whether dynamo's frame evaluator is installed (a compiled function is running
    this eagerly). Where torch cannot say cheaply (before 2.13), assume it is: the
    deferred path is the eager one, with the optimizer's step called one frame out."""
    return _frame_evaluator() is not None if _CHEAP_EAGER else True


def _run_eagerly(cls: type) -> type:
    # Classes whose next class after cls is the core's GradScaler (so its method, looked
    # up at call time, patched or not, is the one super() would find): decided once each.
    direct: dict[type, bool] = {}

    def next_is_core(owner: type) -> bool:
        known = direct.get(owner)
        if known is None:
            mro = owner.__mro__
            known = direct[owner] = mro[mro.index(cls) + 1] is GradScaler
        return known

    def eager(name: str) -> Any:
        @functools.wraps(getattr(GradScaler, name))
        def core(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = getattr(super(cls, self), name)(*args, **kwargs)
            if name == "scale":
                _note_outputs_device(self, args, kwargs)
            return result

        disabled = torch.compiler.disable(core)
        if not _CHEAP_EAGER:
            return disabled

        # Under compiled code (dynamo's frame evaluator installed: a graph-broken or
        # eagerly run part of a compiled function) through disable(), so that the
        # core's frames are never compiled; eagerly the core's method directly, without
        # the disable wrapper's two frame-evaluator switches (microseconds per call, and
        # scale/step/update run every step).
        if name == "scale":
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                if _frame_evaluator() is not None:
                    return disabled(self, *args, **kwargs)
                if not next_is_core(type(self)):
                    return core(self, *args, **kwargs)
                out = getattr(GradScaler, name)(self, *args, **kwargs)
                if self.__dict__.get("_outputs_device") is None:
                    _note_outputs_device(self, args, kwargs)
                return out
        else:
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                if _frame_evaluator() is not None:
                    return disabled(self, *args, **kwargs)
                if not next_is_core(type(self)):
                    return core(self, *args, **kwargs)
                return getattr(GradScaler, name)(self, *args, **kwargs)

        method = functools.wraps(getattr(GradScaler, name))(method)
        # dynamo never traces into it (a call from compiled code is a graph break, as
        # for a disabled function) nor compiles its frame.
        method._torchdynamo_disable = True  # type: ignore[attr-defined]
        torch._dynamo.eval_frame.skip_code(method.__code__)  # type: ignore[attr-defined]
        return method

    # The class defines none of these itself: every one is the core's.
    assert not set(_HOST_SIDE) & set(vars(cls)), "an override would be bypassed"
    for name in _HOST_SIDE:
        setattr(cls, name, eager(name))
    cls.step = _optimizer_compiled_in_step(cls.step)  # type: ignore[attr-defined]
    factor = cast(property, inspect.getattr_static(GradScaler, "scale_factor"))
    cls.scale_factor = property(  # type: ignore[attr-defined]
        torch.compiler.disable(factor.fget), torch.compiler.disable(factor.fset),
        doc=factor.__doc__)
    return cls


@_run_eagerly
class TorchGradScaler(GradScaler, torch.amp.GradScaler):
    """``unified_amp.GradScaler`` on the torch backend; also a ``torch.amp.GradScaler``.

    All behaviour is the core's (torch.amp's ``__init__`` never runs). The private
    attributes below are the ones code in the wild reads from torch.amp's scaler
    (docs/DROP_IN.md lists them); each is derived on demand from the core's state, read
    through ``self.adapter_view`` only (the members the core declares for adapters:
    unified_amp.scaler.AdapterView).
    Its public methods run eagerly inside ``torch.compile`` (``_HOST_SIDE``).
    """

    def _device_scale(self) -> TorchDeviceScale | None:
        # This adapter's device_scale() made it, so it is this adapter's class.
        return cast("TorchDeviceScale | None", self.adapter_view.device_scale)

    def _torch_device(self) -> torch.device:
        """Where torch.amp's scaler would keep its scale tensor: on the device of the
        first outputs it scaled, whatever device it was made for (a CPU model with the
        default GradScaler() on a CUDA machine keeps it on the CPU), else the device
        it was made for. The device-resident scale, once made, is where it lives."""
        dev = self._device_scale()
        if dev is not None:
            return dev.device
        seen = self.__dict__.get("_outputs_device")
        if seen is not None:
            return seen
        device = self.adapter_view.device
        if device:
            return torch.device(device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # torch.amp's scaler keeps these as plain attributes; here they are read-only views
    # of the core's state, on purpose (docs/DROP_IN.md), hence the ignored overrides.
    @property
    def _scale(self) -> torch.Tensor | None:  # type: ignore[override]
        """The scale as a float32 0-dim tensor (a copy, except in device mode)."""
        view = self.adapter_view
        if not view.enabled:
            return None
        dev = self._device_scale()
        if dev is not None:
            return dev.scale_t
        return torch.full((), view.host_scale()[0], dtype=torch.float32,
                          device=self._torch_device())

    @property
    def _growth_tracker(self) -> torch.Tensor | None:  # type: ignore[override]
        view = self.adapter_view
        if not view.enabled:
            return None
        dev = self._device_scale()
        if dev is not None:
            return dev.tracker_t
        return torch.full((), view.host_scale()[1], dtype=torch.int32,
                          device=self._torch_device())

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    # torch.amp keeps its settings as plain attributes; code in the wild reads them.
    @property
    def _enabled(self) -> bool:  # type: ignore[override]
        return self.adapter_view.enabled

    @property
    def _device(self) -> str | None:  # type: ignore[override]
        """The device the scaler was made for (None: not given; it then scales on
        whatever device the outputs live on)."""
        return self.adapter_view.device

    @property
    def _growth_factor(self) -> float:  # type: ignore[override]
        return self.get_growth_factor()

    @property
    def _backoff_factor(self) -> float:  # type: ignore[override]
        return self.get_backoff_factor()

    @property
    def _growth_interval(self) -> int:  # type: ignore[override]
        return self.get_growth_interval()

    # torch.amp keeps the values its lazily made _scale/_growth_tracker tensors start
    # from; load_state_dict() and unpickling set them. There is no lazy start here, so
    # they read (and write) the scale and tracker the next step uses -- the same values
    # wherever torch.amp's have not yet been overtaken by its tensors.
    @property
    def _init_scale(self) -> float:
        return self.get_scale()

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self.scale_factor = value  # validated; sets the device copy too

    @property
    def _init_growth_tracker(self) -> int:
        return self._get_growth_tracker()

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        state = self.state_dict()
        if state:  # (disabled: nothing to set, as every other setting)
            self.load_state_dict(dict(state, _growth_tracker=value))  # validated

    def _get_growth_tracker(self) -> int:
        view = self.adapter_view
        tracker = view.synced_scale()[1]
        return tracker if view.enabled else 0

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
        return by_device(self._flags_of(self.adapter_view.checks_of(optimizer)))

    def _check_inf_per_device(  # type: ignore[override]
            self, optimizer: Any) -> dict[torch.device, torch.Tensor]:
        # What optimizers with the older step(grad_scaler=...) contract call: check
        # without unscaling (they unscale inside), counted by the next update().
        self.adapter_view.check_only(optimizer)
        return self._found_inf_per_device(optimizer)

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:  # type: ignore[override]
        """A read-only snapshot in torch.amp's shape (writing to it changes nothing)."""
        snapshot: dict[int, dict[str, Any]] = defaultdict(
            lambda: {"stage": OptState.READY, "found_inf_per_device": {}})
        for key, (stage, checks) in self.adapter_view.stages().items():
            snapshot[key] = {"stage": OptState[stage],
                             "found_inf_per_device": by_device(self._flags_of(checks))}
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
        found = check_and_unscale_per_device(grads, inv_scale)
        # torch.amp's kernel sets the flag it is given (a copy per device) to 1 on a find
        return {device: torch.maximum(flag, found_inf.to(device))
                for device, flag in found.items()}


def _note_outputs_device(scaler: Any, args: tuple, kwargs: dict) -> None:
    """After scale(): the device of the first outputs it scaled, where torch.amp would
    have made its scale tensor (TorchGradScaler._torch_device)."""
    if scaler.__dict__.get("_outputs_device") is None:
        outputs = args[0] if args else kwargs.get("outputs")
        scaler._outputs_device = _first_tensor_device(outputs)


def _first_tensor_device(outputs: Any) -> torch.device | None:
    if isinstance(outputs, torch.Tensor):
        return outputs.device
    if isinstance(outputs, (list, tuple)):
        for item in outputs:
            found = _first_tensor_device(item)
            if found is not None:
                return found
    return None


class TorchCudaGradScaler(TorchGradScaler, torch.cuda.amp.GradScaler):
    """The same, made for CUDA: also a ``torch.cuda.amp.GradScaler`` (older runners
    check that class)."""


# Pickles record a class by module and name: keep the path they had before the adapter
# was split into modules, where the package re-exports both classes, so that scalers
# pickled by either version load in the other.
TorchGradScaler.__module__ = TorchCudaGradScaler.__module__ = "unified_amp.backends.torch_backend"
