"""The small interface every framework adapter implements.

The core (autocast, GradManager, GradScaler) is written once against these primitives;
an adapter in ``backends/`` maps each one onto its framework's own kernels. Tensors,
parameters and optimizers pass through the core as opaque objects: the core reads
``optimizer.param_groups`` and ``gm.attached_tensors()`` (both frameworks spell them the
same way) and leaves everything numeric to the adapter.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

# Names of the floating dtypes the core talks about. Adapters translate their own dtype
# objects to and from these strings.
LOW_PRECISION = ("float16", "bfloat16")


@runtime_checkable
class Tape(Protocol):
    """Records a forward pass for one GradManager and turns it into gradients."""

    def attach(self, params: Sequence[Any]) -> None:
        """Adds parameters whose gradients ``backward`` must produce."""

    def record(self) -> None:
        """Starts recording operations (entered by ``with gm:``)."""

    def release(self) -> None:
        """Stops recording and frees what was kept for the backward pass."""

    def backward(self, ys: Sequence[Any], dys: Sequence[Any] | None) -> None:
        """Accumulates d(sum dy*y)/d(param) into ``param.grad`` of every attached parameter."""


@runtime_checkable
class Backend(Protocol):
    """What a framework adapter provides. One instance per process, made lazily."""

    name: str

    # -- devices and dtypes -----------------------------------------------------------
    def cuda_available(self) -> bool:
        """Whether this framework sees a CUDA device."""

    def dtype_name(self, dtype: Any) -> str | None:
        """'float16', 'bfloat16', 'float32', ... for one of the framework's dtype objects,
        or None if ``dtype`` is not one."""

    # -- autocast ---------------------------------------------------------------------
    def check_precision(self, dtype: str | None, device: str | None) -> None:
        """Raises UnsupportedPrecisionError if ``dtype`` cannot be computed on ``device``
        (None: every device autocast would touch)."""

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True) -> Any:
        """Switches autocast on or off; returns a token that restores the outer state.
        ``contract`` False leaves the framework's own op lists unchanged (no dtype
        contract inside this block)."""

    def exit_autocast(self, token: Any) -> None:
        """Restores the state saved in ``token``."""

    def is_autocast_enabled(self) -> bool:
        """Whether autocast is on for the calling thread, on any device."""

    # -- gradients --------------------------------------------------------------------
    def new_tape(self) -> Tape:
        """A fresh recorder for an ``amp.GradManager``."""

    def is_tensor(self, obj: Any) -> bool:
        """Whether ``obj`` is one of the framework's tensors."""

    def grads(self, params: Iterable[Any]) -> list[Any]:
        """The gradients of ``params`` that are not None, in order."""

    def drop_grads(self, params: Iterable[Any]) -> None:
        """Sets ``param.grad`` to None, so that any optimizer step leaves the param alone."""

    def clip_grad_norm(self, params: Sequence[Any], max_norm: float, norm_type: float) -> float:
        """The framework's own clip-by-total-norm, in place; returns the norm before clipping."""

    # -- loss scaling -----------------------------------------------------------------
    def scale(self, y: Any, scale: float) -> Any:
        """``y`` times the loss scale, as the framework's own scaler would compute it."""

    def scaled_cotangents(
        self, ys: Sequence[Any], dys: Sequence[Any] | None, scale: float
    ) -> list[Any]:
        """The ``dy`` to feed a backward pass so that gradients come out scaled."""

    def unscale_and_check(self, grads: Sequence[Any], inv_scale: float) -> Any:
        """Fused kernel: multiplies every gradient by ``inv_scale`` in place and returns a
        device-side flag that is set if any gradient holds an inf or NaN. No host sync."""

    def flag_is_set(self, flag: Any) -> bool:
        """Reads a flag from ``unscale_and_check`` on the host: the one sync per step."""

    # -- overflow forensics (forensics.py): never on a clean step ----------------------
    def nonfinite_counts(self, tensors: Sequence[Any]) -> list[tuple[int, int]]:
        """(inf elements, NaN elements) of each tensor, read back in one host sync.
        Called only after a fused check found an inf/NaN."""

    def finite_flag(self, tensor: Any, per_row: bool = False) -> Any:
        """A device-side flag: whether ``tensor`` is all finite (``per_row``: one flag
        per index of its first dimension). No host sync; used by forward tracing."""

    def read_finite_flags(self, flags: Sequence[Any]) -> list[list[bool]]:
        """Reads flags from ``finite_flag`` in one host sync: for each, a list of bools
        (one element for a whole-tensor flag)."""

    def is_module(self, obj: Any) -> bool:
        """Whether ``obj`` is one of the framework's modules (``nn.Module``, ...)."""

    def named_modules(self, model: Any) -> list[tuple[str, Any]]:
        """(dotted name, module) for ``model`` ("") and every submodule, each once."""

    def named_parameters(self, model: Any) -> list[tuple[str, Any]]:
        """(dotted name, parameter) for every parameter of ``model``."""

    def add_forward_hook(self, module: Any, hook: Any, pre: bool = False) -> Any:
        """Registers ``hook(module, inputs, outputs)`` to run after ``module``'s forward
        (``pre``: ``hook(module, inputs)`` before it); returns a handle whose
        ``remove()`` takes it off again."""

    # -- optional primitives (the core asks with getattr and copes without) -------------
    # ``grad_version(grad) -> int``: a counter every in-place write to ``grad`` bumps
    #   (torch's ``_version``); lets the scaler's ledger tell new gradient generations
    #   from old ones without a new object.
    # ``watch_backward(tensor, callback) -> bool``: arranges for ``callback()`` to run when
    #   a backward pass goes through ``tensor`` (a scale() output); False if it cannot.
    # ``scaler_class(device) -> type``: a subclass of unified_amp.GradScaler that
    #   GradScaler(...) should instantiate (torch: one that is also torch.amp.GradScaler).
    # ``steps_on_device(optimizer) -> bool`` and
    #   ``device_scale(optimizer, scale, growth_tracker, skipped_steps)``: for optimizers
    #   that skip a step on the device by themselves; the latter returns an object that
    #   keeps the scale on the device (see backends/torch_backend.py, _DeviceScale).
    #   GradScaler switches to it the first time such an optimizer steps, so that its
    #   steps need no host sync. MegEngine has no such optimizers.
