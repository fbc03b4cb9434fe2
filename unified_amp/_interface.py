"""The small interface every framework adapter implements.

The core (autocast, GradManager, GradScaler, the opt levels) is written once against
these primitives; an adapter in ``backends/`` maps each one onto its framework's own
kernels. Tensors, parameters, modules and optimizers pass through the core as opaque
objects: the core reads ``optimizer.param_groups``, ``gm.attached_tensors()``,
``module.parameters()`` and ``module.forward`` (both frameworks spell them the same way)
and leaves everything numeric to the adapter.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

# Names of the floating dtypes the core talks about. Adapters translate their own dtype
# objects to and from these strings.
LOW_PRECISION = ("float16", "bfloat16")


@runtime_checkable
class Tape(Protocol):
    """Records a forward pass for one GradManager and turns it into gradients."""

    def attach(self, params: Sequence[Any], callbacks: Sequence[Any] = ()) -> None:
        """Adds parameters whose gradients ``backward`` must produce (a parameter given
        again is kept once) and appends ``callbacks`` to each one's list: MegEngine's
        ``callback(param, grad) -> grad``, run on each new gradient before it is
        accumulated into ``param.grad``."""

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
        device-side flag that is set if any gradient holds an inf or NaN. No host sync.
        (The scaler also passes the scale itself, to bring gradients it unscaled back
        to the scale before an automatic-mode backward accumulates into them.)"""

    def flag_is_set(self, flag: Any) -> bool:
        """Reads a flag from ``unscale_and_check`` on the host: the one sync per step."""

    # -- opt levels (amp.initialize; the policy is in opt_levels.py) -------------------
    def is_module(self, obj: Any) -> bool:
        """Whether ``obj`` is one of the framework's modules (it has ``parameters()``
        and ``forward``)."""

    def device_type(self, tensor: Any) -> str:
        """'cpu' or 'cuda': where ``tensor`` lives."""

    def default_low_dtype(self, device: str) -> str:
        """The dtype ``autocast(dtype=None)`` computes on ``device``."""

    def cast(self, tensor: Any, dtype: str) -> Any:
        """``tensor`` in ``dtype`` ('float32', 'float16', 'bfloat16'), differentiable;
        ``tensor`` itself if it has that dtype already."""

    def cast_module(self, module: Any, dtype: str, keep_batchnorm_fp32: bool) -> None:
        """Casts the floating parameters and buffers of ``module`` and its submodules to
        ``dtype`` in place, keeping each parameter object (optimizers hold them); batch
        norm layers are left in float32 if ``keep_batchnorm_fp32``."""

    def low_precision_batch_norm(self, dtype: str) -> bool:
        """Whether batch norm can hold ``dtype`` weights on this build."""

    def steps_low_precision(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` can update low-precision parameters itself."""

    def master_copy(self, param: Any) -> Any:
        """A new float32 leaf parameter holding ``param``'s values, on its device."""

    def optimizer_state(self, optimizer: Any) -> Any:
        """The optimizer's per-parameter state: a mutable mapping keyed by parameter
        (torch's ``optimizer.state``, MegEngine's ``optimizer._state``)."""

    def take_grads(self, params: Sequence[Any]) -> list[Any]:
        """Each parameter's gradient (or None), in order; leaves them all None."""

    def restore_grads(self, params: Sequence[Any], grads: Sequence[Any]) -> None:
        """Adds ``grads`` (from ``take_grads``; None entries skipped) into the params'
        gradients, in place and fused where the framework can; sets those that are None."""

    def grads_to_masters(self, params: Sequence[Any], masters: Sequence[Any]) -> None:
        """Sets each master's gradient to its param's gradient cast to float32 (fused
        where the framework can) and drops the param's; pairs without a gradient are
        left alone."""

    def copy_params(self, dst: Sequence[Any], src: Sequence[Any]) -> None:
        """Copies ``src`` into ``dst`` in place, cast to each dst's dtype; fused where
        the framework can."""

    def skipped_step_result(self, optimizer: Any) -> Any:
        """What ``optimizer.step()`` returns when amp skips it: what a real step returns
        where that does not depend on the step (MegEngine: the optimizer, for chaining)."""

    # -- overflow forensics (forensics.py): never on a clean step ----------------------
    # (and ``is_module`` above)
    def finite_flag(self, tensor: Any, per_row: bool = False) -> Any:
        """A device-side flag: whether ``tensor`` is all finite (``per_row``: one flag
        per index of its first dimension). No host sync; used by forward tracing."""

    def read_overflow(self, grads: Sequence[Any], loss: Any, flags: Sequence[Any]
                      ) -> tuple[list[tuple[int, int]], float | None, list[list[bool]]]:
        """Everything an overflow report needs from the device, in one host sync:
        (inf elements, NaN elements) of each gradient; the value of ``loss`` (a
        one-element tensor, or None for None); and each flag from ``finite_flag`` as a
        list of bools (one element for a whole-tensor flag). Called only after a fused
        check found an inf/NaN, or when a trace's flags are asked for."""

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
    #   keeps the scale on the device (see backends/torch_backend/device_scale.py;
    #   its ``rescale(grads)`` multiplies gradients by the device scale, in place).
    #   GradScaler switches to it the first time such an optimizer steps, so that its
    #   steps need no host sync. MegEngine has no such optimizers.

    # -- optional: distributed primitives (see unified_amp/distributed.py) --------------
    # An adapter whose framework can run several processes also provides:
    #   world_group() -> the default group if this process is one of several, else None
    #   check_group(group) -> None; raises TypeError/RuntimeError for a group it cannot use
    #   grad_kind(param) -> "local" | "dtensor" (the framework agrees the fused check over
    #       its own mesh) | "sharded" (a per-rank shard, with no agreement of its own)
    #   zero_grad_like(param) -> a zero gradient for param (a stand-in in the check)
    #   clean_flag(params, group) -> a flag that says "no inf", where group communicates
    #   all_reduce_max_async(flag, group) -> (flag, handle with wait() or None): starts a
    #       MAX all-reduce of the flag on the device; no host sync
    #   grad_sync_paused(module) -> bool: the module is inside a no_sync() window
    #   module_clip_grad_norm(module, max_norm, norm_type) -> float, or None where the
    #       module has no clip of its own (FSDP1's covers every rank's shard)
