"""What every framework adapter must provide: the required core.

The core (autocast, GradManager, GradScaler) is written once against these primitives;
an adapter in ``backends/`` maps each one onto its framework's own kernels. Tensors,
parameters, modules and optimizers pass through the core as opaque objects: the core
reads ``optimizer.param_groups``, ``gm.attached_tensors()``, ``module.parameters()`` and
``module.forward`` (both frameworks spell them the same way) and leaves everything
numeric to the adapter.

:class:`Backend` is the required core: ``Basics`` (tensors, modules, casts),
``Autocasting``, ``Gradients`` (with the :class:`Tape` that ``new_tape`` makes) and
``LossScaling`` (the scale, the fused check-and-unscale and its flag): what the scaler and
autocast run on, and what the registry checks when it loads an adapter. Everything else
is an optional capability (``unified_amp.capabilities``: opt levels, forensics probes,
fused optimizers, traces, distributed, ...), asked for by name where a feature needs it.
Each adapter package declares its capability classes as subclasses of these Protocols and
assigns its backend to ``Backend`` for the type checker, so ``make typecheck`` fails when
an adapter drifts from the interface.
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
class Basics(Protocol):
    """The adapter's name, devices, and what tensors and modules are: their dtypes,
    where a tensor lives, a module's submodules, a differentiable cast."""

    name: str

    def cuda_available(self) -> bool:
        """Whether this framework sees a CUDA device."""

    def dtype_name(self, dtype: Any) -> str | None:
        """'float16', 'bfloat16', 'float32', ... for one of the framework's dtype objects,
        or None if ``dtype`` is not one."""

    def device_type(self, tensor: Any) -> str:
        """'cpu' or 'cuda': where ``tensor`` lives."""

    def is_tensor(self, obj: Any) -> bool:
        """Whether ``obj`` is one of the framework's tensors."""

    def is_module(self, obj: Any) -> bool:
        """Whether ``obj`` is one of the framework's modules (it has ``parameters()``
        and ``forward``)."""

    def named_modules(self, model: Any) -> list[tuple[str, Any]]:
        """(dotted name, module) for ``model`` ("") and every submodule, each once."""

    def cast(self, tensor: Any, dtype: str) -> Any:
        """``tensor`` in ``dtype`` ('float32', 'float16', 'bfloat16'), differentiable;
        ``tensor`` itself if it has that dtype already."""


@runtime_checkable
class Autocasting(Protocol):
    """Switching autocast on and off, and which precisions a device computes."""

    def check_precision(self, dtype: str | None, device: str | None) -> None:
        """Raises UnsupportedPrecisionError if ``dtype`` cannot be computed on ``device``
        (None: every device autocast would touch)."""

    def native_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                        contract: bool) -> Any:
        """The framework's own context manager to stand for this block, or None.

        Asked when an ``amp.autocast`` is made; where it answers, ``amp.autocast(...)``
        returns that object. torch answers while dynamo traces a block that is exactly
        one ``torch.autocast``, so that a graph break splits there as in torch.autocast.
        """

    def prepare_rules(self, rules: tuple[tuple[Any, str], ...]) -> None:
        """Resolves a block's rules when it is made (raising on a key the framework
        cannot call), where that can be done before the block is entered."""

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True, rules: tuple[tuple[Any, str], ...] = ()
                       ) -> Any:
        """Switches autocast on or off; returns a token that restores the outer state.
        ``contract`` False leaves the framework's own op lists unchanged (no dtype
        contract inside this block). ``rules``: the block's own (key, kind) pairs, as
        ``_rules.check`` gives them, merged over the enclosing block's."""

    def exit_autocast(self, token: Any) -> None:
        """Restores the state saved in ``token``."""

    def is_autocast_enabled(self) -> bool:
        """Whether autocast is on for the calling thread, on any device."""

    def autocast_low_dtype(self, device: str) -> str | None:
        """The low dtype autocast computes in on ``device`` right now ('float16',
        'bfloat16'), or None where it is off (whoever turned it on: ``amp.autocast``
        or the framework's own)."""


@runtime_checkable
class Gradients(Protocol):
    """Recording for a GradManager, and reading, dropping and clipping gradients."""

    def new_tape(self) -> Tape:
        """A fresh recorder for an ``amp.GradManager``."""

    def grads(self, params: Iterable[Any]) -> list[Any]:
        """The gradients of ``params`` that are not None, in order."""

    def drop_grads(self, params: Iterable[Any]) -> None:
        """Sets ``param.grad`` to None, so that any optimizer step leaves the param alone."""

    def clip_grad_norm(self, params: Sequence[Any], max_norm: float, norm_type: float) -> float:
        """The framework's own clip-by-total-norm, in place; returns the norm before clipping."""


@runtime_checkable
class LossScaling(Protocol):
    """Scaling by the loss scale, and the fused check-and-unscale with its flag."""

    def scale(self, y: Any, scale: float) -> Any:
        """``y`` times the loss scale, as the framework's own scaler would compute it."""

    def scaled_cotangents(
        self, ys: Sequence[Any], dys: Sequence[Any] | None, scale: float
    ) -> list[Any]:
        """The ``dy`` to feed a backward pass so that gradients come out scaled."""

    def unscale_and_check(self, grads: Sequence[Any], inv_scale: float,
                          allow_float16: bool = False) -> Any:
        """Fused kernel: multiplies every gradient by ``inv_scale`` in place and returns a
        device-side flag that is set if any gradient holds an inf or NaN. No host sync.
        (The scaler also passes the scale itself, to bring gradients it unscaled back
        to the scale before an automatic-mode backward accumulates into them.)

        Raises ValueError, before touching any gradient, if one is float16 and
        ``allow_float16`` is False (torch.amp's rule; the scaler words that error
        itself), or has a dtype the kernel cannot take (MegEngine's: float32 only), so
        the scaler never scans the dtypes of a clean step's gradients a second time."""

    def flag_is_set(self, flag: Any) -> bool:
        """Reads a flag from ``unscale_and_check`` on the host: the one sync per step."""


@runtime_checkable
class Backend(Basics, Autocasting, Gradients, LossScaling, Protocol):
    """What every framework adapter provides. One instance per process, made lazily."""


def missing(backend: object, protocol: type) -> list[str]:
    """The members of ``protocol`` (and of the Protocols it is made of) that the class
    of ``backend`` does not define, in order: [] when it provides them all."""
    names: dict[str, bool] = {}
    for part in reversed(protocol.__mro__):
        if part in (object, Protocol) or not getattr(part, "_is_protocol", False):
            continue
        names.update((n, callable(v)) for n, v in vars(part).items()
                     if callable(v) and not n.startswith("_"))
        names.update((n, False) for n in vars(part).get("__annotations__", {}))
    cls = type(backend)
    return [n for n, method in names.items()
            if not (callable(getattr(cls, n, None)) if method else hasattr(cls, n))]
