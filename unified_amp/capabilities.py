"""The optional capabilities of a framework adapter, and how the core asks for them.

Beyond the required core (``unified_amp.interface.Backend``), an adapter may provide any
of these Protocols; the core asks for one where a feature needs it, in one of two ways:

- :func:`capability` where the core copes without it (a scaler with no fused optimizers
  keeps its scale on the host): the adapter as that Protocol, or None;
- :func:`require` where the feature cannot run without it (``amp.initialize`` needs
  ``OptLevelCasting``, ``amp.trace_forward`` needs ``ForensicsProbes``): the adapter, or
  ``MissingCapabilityError`` naming the backend, the capability and its missing methods.

Both decide from the adapter's class (does it define every member of the Protocol) and
remember the answer per class, because a runtime Protocol check costs tens of
microseconds and the scaler asks several times per step. Each adapter package declares
the capabilities it provides as subclasses of these Protocols, for the type checker.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, TypeVar, runtime_checkable

from .errors import MissingCapabilityError
from .interface import missing


@runtime_checkable
class OptLevelCasting(Protocol):
    """What apex's opt levels need (``amp.initialize``; the policy is in apex/), and
    ``amp.keep_float32`` of a module whose weights are in low precision."""

    def default_low_dtype(self, device: str) -> str:
        """The dtype ``autocast(dtype=None)`` computes on ``device``."""

    def cast_module(self, module: Any, dtype: str, keep_batchnorm_fp32: bool,
                    skip: Sequence[Any] = ()) -> None:
        """Casts the floating parameters and buffers of ``module`` and its submodules to
        ``dtype`` in place, keeping each parameter object (optimizers hold them); batch
        norm layers are left in float32 if ``keep_batchnorm_fp32``; the modules in
        ``skip`` (and everything inside them) are left alone."""

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


@runtime_checkable
class ForensicsProbes(Protocol):
    """Overflow forensics (forensics.py): the reports of a step a GradScaler skipped, and
    forward tracing (``amp.trace_forward``). Never called on a clean step."""

    def finite_flag(self, tensor: Any, per_row: bool = False) -> Any:
        """A device-side flag: whether ``tensor`` is all finite (``per_row``: one flag
        per index of its first dimension). No host sync; used by forward tracing."""

    def read_overflow(self, grads: Sequence[Any], losses: Sequence[Any],
                      flags: Sequence[Any]
                      ) -> tuple[list[tuple[int, int]], list[float], list[list[bool]]]:
        """Everything an overflow report needs from the device, in one host sync:
        (inf elements, NaN elements) of each gradient; the value of each of ``losses``
        (one-element tensors: the micro-batches' losses); and each flag from ``finite_flag`` as a
        list of bools (one element for a whole-tensor flag). Called only after a fused
        check found an inf/NaN, or when a trace's flags are asked for."""

    def named_parameters(self, model: Any) -> list[tuple[str, Any]]:
        """(dotted name, parameter) for every parameter of ``model``."""

    def add_forward_hook(self, module: Any, hook: Any, pre: bool = False) -> Any:
        """Registers ``hook(module, inputs, outputs)`` to run after ``module``'s forward
        (``pre``: ``hook(module, inputs)`` before it); returns a handle whose
        ``remove()`` takes it off again."""


@runtime_checkable
class GradVersions(Protocol):
    """A counter that every in-place write to a gradient bumps (torch's ``_version``):
    it lets the scaler's ledger tell new gradient generations from old ones without a
    new object."""

    def grad_version(self, grad: Any) -> int:
        """The gradient's version counter."""


@runtime_checkable
class BackwardProbes(Protocol):
    """Telling afterwards whether a backward pass went through a tensor (a ``scale()``
    output), with nothing registered that runs during the backward pass."""

    def backward_token(self, tensor: Any) -> Any:
        """Something to ask ``backward_ran`` about later (it may keep ``tensor``'s
        graph alive until dropped), or None where the adapter cannot tell."""

    def backward_ran(self, token: Any) -> bool | None:
        """True: a backward pass went through the tensor. False: none did, and one ran
        through what the tensor was computed from (``loss.backward()`` after
        ``scaler.scale(loss)``). None: it cannot tell (no backward pass yet, or one
        that kept the graph: ``retain_graph=True``)."""


class DeviceScale(Protocol):
    """The scale and growth tracker kept in device tensors, for optimizers that skip a
    step on the device by themselves; made by ``DeviceResident.device_scale``. Its
    arithmetic is the framework's; when to call what stays the scaler's."""

    def scale(self, y: Any) -> Any:
        """``y`` times the device scale."""

    def scaled_cotangents(self, ys: Sequence[Any], dys: Sequence[Any] | None) -> list[Any]:
        """As ``LossScaling.scaled_cotangents``, by the device scale."""

    def unscale_and_check(self, grads: Sequence[Any]) -> Any:
        """The fused check-and-unscale by the device scale's reciprocal; a device flag."""

    def check(self, grads: Sequence[Any]) -> Any:
        """The fused check alone (the optimizer unscales inside its own kernel)."""

    def rescale(self, grads: Sequence[Any]) -> Any:
        """Multiplies ``grads`` by the device scale in place (gradients the scaler
        unscaled, back to the scale before an automatic-mode backward adds to them)."""

    def step(self, optimizer: Any, unscale: bool, flags: Sequence[Any],
             args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Steps ``optimizer`` with the scale and the combined ``flags`` handed to it,
        so that it unscales (if ``unscale``) and skips on the device."""

    def update(self, found_host: bool, flags: Sequence[Any], growth: float,
               backoff: float, interval: int, *, steps: int, count: bool,
               new_scale: float | None) -> None:
        """One ``update()`` on the device (or sets ``new_scale``); ``count`` says the
        step counts in the telemetry."""

    def poll(self) -> tuple[int, float, int, int, bool] | None:
        """The newest telemetry that has reached the host (step, scale, tracker,
        skipped steps, last step skipped), or None; never waits."""

    def read(self) -> tuple[float, int]:
        """The scale and tracker, read back (a sync)."""

    def load(self, scale: float, tracker: int | None,
             telemetry: tuple[int, int, bool] | None = None) -> None:
        """Sets the scale (and the tracker unless None; and unless None the telemetry,
        (steps, skipped steps, last step skipped), that ``poll`` reports next)."""


@runtime_checkable
class DeviceResident(Protocol):
    """Optimizers that skip a step on the device by themselves (torch's fused ones)."""

    def steps_on_device(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` takes ``grad_scale``/``found_inf`` and skips by itself."""

    def device_scale(self, optimizer: Any, scale: float, tracker: int,
                     skipped: int) -> DeviceScale:
        """A device-resident scale for ``optimizer``'s device. GradScaler switches to it
        the first time such an optimizer steps, so that its steps need no host sync."""

    def skip_leaves_uninitialised_state(self, optimizer: Any) -> bool:
        """Whether a step of ``optimizer`` that its kernel skipped on the device would
        leave state that later steps read uninitialised (torch's fused SGD with momentum
        before its first step taken: it makes the momentum buffers with ``empty_like``).
        GradScaler then reads the verdict on the host and skips such a step itself."""


class TracedScale(DeviceScale, Protocol):
    """A device-resident scale a traced step can use: its ``step`` selects the old
    parameters and optimizer state on an overflow, on the device."""

    def write(self, scale: float, tracker: int, skipped: int) -> None:
        """Copies the host's values in (outside a trace)."""


@runtime_checkable
class Tracing(Protocol):
    """A framework's graph tracing (``megengine.jit.trace``), for a traced step that
    trains as the eager one (unified_amp/_tracing.py)."""

    trace_name: str  # how errors name the trace ("megengine.jit.trace")

    def trace_mode(self) -> str | None:
        """None outside a trace; "rerun" where the trace runs the Python function on
        every call; "once" where it replays the graph alone."""

    def trace_refusal(self) -> str | None:
        """Why a step traced now could not train as the eager one (a framework
        setting), or None."""

    def device_scale(self, optimizer: Any, scale: float, tracker: int,
                     skipped: int) -> TracedScale:
        """The device copy of the scale that traced steps use (``optimizer`` None)."""

    def before_traces(self, callback: Any) -> None:
        """Calls ``callback()`` right before each traced call starts, outside the trace,
        for as long as the object of ``callback`` (a bound method, held weakly) lives."""


@runtime_checkable
class NativeScalerClass(Protocol):
    """A GradScaler subclass that is also the framework's own scaler class."""

    def scaler_class(self, device: str | None) -> type:
        """The subclass of unified_amp.GradScaler that ``GradScaler(...)`` instantiates
        (torch: one that is also a torch.amp.GradScaler)."""


@runtime_checkable
class Collectives(Protocol):
    """Process groups and the flag's all-reduce, for cross-rank agreement
    (unified_amp/distributed.py)."""

    def world_group(self) -> Any:
        """The default group if this process is one of several, else None."""

    def check_group(self, group: Any) -> None:
        """Raises TypeError/RuntimeError for a group this adapter cannot use."""

    def grad_kind(self, param: Any) -> str:
        """"local", "dtensor" (the framework agrees the fused check over its own mesh)
        or "sharded" (a per-rank shard, with no agreement of its own)."""

    def zero_grad_like(self, param: Any) -> Any:
        """A zero gradient for ``param`` (a stand-in in the check)."""

    def clean_flag(self, params: Sequence[Any], group: Any) -> Any:
        """A flag that says "no inf", where ``group`` communicates."""

    def all_reduce_max_async(self, flag: Any, group: Any) -> tuple[Any, Any]:
        """Starts a MAX all-reduce of ``flag`` on the device, no host sync: the flag
        and a handle with ``wait()``, or None."""


@runtime_checkable
class DataParallelHooks(Protocol):
    """What data-parallel wrappers expose (DDP's ``no_sync()``, FSDP1's own clip)."""

    def grad_sync_paused(self, module: Any) -> bool:
        """Whether ``module`` is inside a ``no_sync()`` window."""

    def module_clip_grad_norm(self, module: Any, max_norm: float,
                              norm_type: float) -> float | None:
        """The module's own clip-by-total-norm, or None where it has none."""


_P = TypeVar("_P")
_OPTIONAL = (OptLevelCasting, ForensicsProbes, GradVersions, BackwardProbes, DeviceResident,
             Tracing, NativeScalerClass, Collectives, DataParallelHooks)
# (adapter class, Protocol) -> the members of the Protocol the class lacks. A fact about
# classes, not state of any scaler: an adapter's capabilities are its methods.
_missing: dict[tuple[type, type], list[str]] = {}


def _lacks(backend: object, protocol: type) -> list[str]:
    key = (type(backend), protocol)
    lacks = _missing.get(key)
    if lacks is None:
        if protocol not in _OPTIONAL:
            raise TypeError(f"capability() takes one of the optional capabilities"
                            f" {[p.__name__ for p in _OPTIONAL]}; got {protocol!r}.")
        lacks = _missing[key] = missing(backend, protocol)
    return lacks


def capability(backend: object, protocol: type[_P]) -> _P | None:
    """``backend`` as ``protocol``, one of the optional capabilities, if its class
    provides every member of it; else None. Asked once per adapter class and capability."""
    return None if _lacks(backend, protocol) else backend  # type: ignore[return-value]


def require(backend: Any, protocol: type[_P], what: str) -> _P:
    """``backend`` as ``protocol``, which ``what`` (a feature, as the user calls it)
    cannot run without.

    Raises:
        MissingCapabilityError: the adapter does not provide ``protocol``.
    """
    lacks = _lacks(backend, protocol)
    if lacks:
        raise MissingCapabilityError(
            f"{what} needs the {protocol.__name__} capability, which the"
            f" {getattr(backend, 'name', type(backend).__name__)!r} backend does not"
            f" provide: its adapter {type(backend).__name__} has no {', '.join(lacks)}."
            f" Implement unified_amp.capabilities.{protocol.__name__} in the adapter, or"
            f" leave {what} out on this backend."
        )
    return backend
