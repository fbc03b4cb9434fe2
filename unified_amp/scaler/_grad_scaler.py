"""``GradScaler``: dynamic loss scaling, one state machine for both frameworks.

The state (scale, growth tracker, per-optimizer stage, the ledger of unscaled gradient
generations) lives in plain Python; adapters only scale tensors, run the fused
check-and-unscale kernel and read its flag back. That read is the only device-to-host
sync, at most once per optimizer step.

**The call form decides the semantics**, so that a loop copied from either framework
keeps its native behaviour:

- torch.amp's forms (``scale(loss).backward()``, ``unscale_(optimizer)``,
  ``step(optimizer)``) leave non-finite gradients in ``.grad`` and let ``step()`` skip,
  as torch.amp does; the flag is read in ``step()``.
- megengine.amp's forms (``backward(gm, loss)``, ``unscale(gm or tensors)``) read the
  flag at once and, on an overflow, drop the gradients they checked (``.grad = None``),
  so that any optimizer step, the optimizer's own included, leaves the weights alone.

Both forms share the ledger (``scaler/_ledger.py``), so they compose: ``backward(gm, loss)``
then ``step(optimizer)`` neither unscales twice nor forgets the verdict.

One exception to "state on the host", for optimizers that skip a step on the device by
themselves (torch's ``fused=True`` Adam/AdamW/SGD read ``grad_scale``/``found_inf``
tensors): once such an optimizer steps, the adapter keeps the scale and growth tracker
in device tensors and updates them with the framework's own kernel, so a step needs no
sync at all. The stage logic is the same in both modes; only where the arithmetic runs
differs.

Where the parts live: this module has the public class, which holds its state machine
(``self._machine``, a ``ScalerMachine``: _machine.py, with what one iteration records and
every transition) and delegates to it, and the overflow forensics that listens to the
machine (``self._forensics``, forensics.py, which unified_amp/__init__ subscribes:
``subscribe_forensics``, so the scaler imports none of it); ``_state.py`` has the numbers (scale,
tracker, telemetry) and checkpoints, ``unified_amp/_scale_rule.py`` the scale rule and
the checks of its numbers, ``_call_forms.py`` the constructor's two call forms.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Protocol, TypeVar, overload

from .. import _tracing, distributed
from ._adapter_view import AdapterView
from ._call_forms import UNIFIED_SIG, bind, device_of_call
from .._registry import get_backend
from .._scale_rule import check_factors, valid_scale
from ._machine import Listener, ScalerMachine
from ._state import ScaleState
from ._targets import is_optimizer
from ..errors import ScalerStateError
from ..capabilities import NativeScalerClass, capability

__all__ = ["GradScaler", "AdapterView"]

_S = TypeVar("_S", bound="GradScaler")


class Forensics(Listener, Protocol):
    """A scaler's overflow forensics, as GradScaler delegates to it (``watch()``,
    ``last_overflow()``, ``stats()["overflows"]``); it listens to the machine
    (_machine.Listener). unified_amp/__init__ subscribes forensics.py's, so that the
    scaler imports none of it."""

    last: Any  # the newest OverflowReport, or None

    def watch(self, model: Any, warn_after: int, warn_below: float, history: int) -> None:
        ...

    def history_dicts(self) -> list[dict[str, Any]]: ...


class _NoForensics:
    """What a scaler has where nothing subscribed forensics (never, once
    ``import unified_amp`` ran): no reports."""

    last = None

    def watch(self, model: Any, warn_after: int, warn_below: float, history: int) -> None:
        raise RuntimeError("GradScaler.watch() needs the overflow forensics that `import"
                           " unified_amp` subscribes; import unified_amp first.")

    def history_dicts(self) -> list[dict[str, Any]]:
        return []


def subscribe_forensics(make: Callable[[bool], Forensics]) -> None:
    """Every GradScaler made from now on subscribes ``make(enabled)`` to its state
    machine, as its forensics: a listener (_machine.Listener) that is a ``Forensics``.
    Called once, by unified_amp/__init__, which assembles the public API."""
    GradScaler.make_forensics = staticmethod(make)


class GradScaler:
    """Dynamic loss scaling for mixed-precision training, on the active backend.

    Call forms::

        amp.GradScaler()                          # init_scale=2**16 on both backends
        amp.GradScaler("cuda") / GradScaler(device="cpu", init_scale=...)   # torch.amp's
        amp.GradScaler(2.0**4)                    # megengine.amp's (positional init_scale)

    Automatic mode: ``scaler.backward(gm, loss)`` then ``optimizer.step()`` or
    ``scaler.step(optimizer)``.
    Manual mode: ``gm.backward(scaler.scale(loss))`` (any number of times) -> custom
    gradient ops on scaled grads -> ``scaler.unscale(target)`` -> custom ops on true
    grads (clipping) -> ``scaler.step(optimizer)`` or the optimizer's own step ->
    ``scaler.update()``.
    torch.amp's loop: ``scaler.scale(loss).backward()`` -> [``scaler.unscale_(opt)``]
    -> ``scaler.step(opt)`` -> ``scaler.update()``.

    On an inf/NaN gradient the step is skipped and ``update()`` multiplies the scale by
    ``backoff_factor``; after ``growth_interval`` clean updates in a row the scale grows
    by ``growth_factor``. ``unscale()`` and ``backward()`` (megengine.amp's names) drop
    the overflowed gradients so that any optimizer step is safe; ``unscale_()`` and
    ``step()`` (torch.amp's names) leave them in ``.grad``.

    On the torch backend the instance is also a ``torch.amp.GradScaler`` (and, made for
    CUDA, a ``torch.cuda.amp.GradScaler``), so runners that check ``isinstance`` accept it.

    Args:
        init_scale: the first scale, a positive finite number.
        growth_factor: > 1.
        backoff_factor: in (0, 1).
        growth_interval: clean updates before growing; 0 never grows.
        enabled: False makes every method a pass-through (one code path for fp32).
        device: accepted for torch.amp compatibility; "cuda" on a machine without
            CUDA disables the scaler with a warning, as torch.amp does.
        process_group: agree every skip decision over this group with one MAX
            all-reduce of the overflow flag per check (what ``ShardedGradScaler`` does),
            for gradients that differ per rank. None (the default) agrees only where
            needed: FSDP1's sharded parameters over the world group, FSDP2's DTensors
            through torch's own agreement, and nothing for DDP, whose gradients are
            already identical. Not kept by pickling (give it again after loading).
            See docs/DISTRIBUTED.md.
    """

    # What inspect.signature(GradScaler) shows; the overloads below are for type checkers.
    __signature__ = UNIFIED_SIG
    _machine: ScalerMachine  # the state machine this scaler holds and delegates to
    _forensics: "Forensics | _NoForensics"  # its overflow reports, listening to the machine
    # Makes a scaler's forensics from its enabled flag (subscribe_forensics): a factory
    # every scaler calls for its own, no state any two share.
    make_forensics: Callable[[bool], Forensics] | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "GradScaler":
        if cls is GradScaler:
            # The adapter may name a subclass that is also its framework's own scaler
            # class (torch.amp.GradScaler), so that isinstance checks in runners pass.
            native = capability(get_backend(), NativeScalerClass)
            if native is not None:
                cls = native.scaler_class(device_of_call(args, kwargs))
        return super().__new__(cls)

    @overload
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, device: str | None = None,
                 process_group: Any = None) -> None: ...

    @overload
    def __init__(self, device: str, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, process_group: Any = None) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        a = bind(args, kwargs)
        check_factors(a["init_scale"], a["growth_factor"], a["backoff_factor"],
                      a["growth_interval"])
        enabled = a["enabled"]
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler enabled must be a bool; got {enabled!r}.")
        device = a["device"]
        if device is not None and not isinstance(device, str):
            device = str(device)
        if enabled and device is not None and device.split(":")[0] == "cuda":
            if not get_backend().cuda_available():
                warnings.warn(
                    "GradScaler(device='cuda') is enabled, but CUDA is not available."
                    "  Disabling.",
                    stacklevel=2,
                )
                enabled = False
        group = a["process_group"]
        if group is not None and enabled:
            distributed.check_group(get_backend(), group)
        scale_state = ScaleState(a["init_scale"], a["growth_factor"], a["backoff_factor"],
                             a["growth_interval"])
        self._start(ScalerMachine(self, enabled, device, group, scale_state))

    def _start(self, machine: ScalerMachine) -> None:
        self._machine = machine
        make = type(self).make_forensics
        if make is None:
            self._forensics = _NoForensics()
        else:
            self._forensics = make(machine.enabled)
            machine.listeners.append(self._forensics)

    # -- the loop ---------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list/tuple of tensors) times the current scale."""
        machine: ScalerMachine = self._machine
        return machine.scale(outputs) if machine.enabled else outputs

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

        Raises:
            TypeError: ``gm`` is not a GradManager.
        """
        if not (hasattr(gm, "backward") and hasattr(gm, "attached_tensors")):
            hint = (" (that is an optimizer: in automatic mode the optimizer steps after"
                    " scaler.backward(gm, loss), or through scaler.step(optimizer))"
                    if is_optimizer(gm) else "")
            raise TypeError(
                f"GradScaler.backward() expects a GradManager (amp.GradManager or"
                f" MegEngine's own) as its first argument; got {type(gm).__name__}{hint}."
            )
        machine: ScalerMachine = self._machine
        if machine.enabled:
            machine.backward(gm, y, dy, unscale_grad, update_scale)
        else:
            gm.backward(y, dy)

    def unscale(self, target: Any) -> "GradScaler":
        """Divides the gradients of ``target`` by the scale, in place, and checks them
        (megengine.amp's form). On an inf/NaN the checked gradients are dropped
        (``.grad = None``), so any optimizer step then leaves their parameters alone.

        ``target`` is a GradManager, an optimizer, or an iterable of parameters. Call it
        once per set of gradients, after all of their backward passes. Returns self
        (megengine.amp's chaining).

        Raises:
            RuntimeError: these gradients were unscaled already; their optimizer already
                stepped; or nothing was scaled since the last ``update()``.
            ValueError: a gradient is float16.
        """
        machine: ScalerMachine = self._machine
        if machine.enabled:
            machine.refuse_in_trace("GradScaler.unscale()", "unscale")
            machine.unscale(target, "unscale()", drop=True)
        return self

    def unscale_(self, optimizer: Any) -> None:
        """torch.amp's ``unscale_``: divides the optimizer's gradients by the scale in
        place and checks them, leaving any inf/NaN in ``.grad`` (``step()`` then skips).

        The verdict is read in ``step()`` (or ``update()``), as torch.amp does. Also
        accepts a GradManager or an iterable of parameters.

        Raises:
            RuntimeError: as ``unscale()``.
        """
        machine: ScalerMachine = self._machine
        if machine.enabled:
            machine.traced("GradScaler.unscale_()")
            machine.unscale(optimizer, "unscale_()", drop=False)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscales ``optimizer``'s gradients if not yet done, then steps it unless an
        inf/NaN was found in them.

        Returns what ``optimizer.step(*args, **kwargs)`` returns, or None if skipped.

        Raises:
            RuntimeError: the optimizer already stepped since the last ``update()``; its
                gradients need unscaling but nothing was scaled since the last update;
                it has no gradients and none were checked; or a ``closure`` was given.
        """
        if not self._machine.enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if not is_optimizer(optimizer):
            raise TypeError(
                f"GradScaler.step() expects an optimizer (an object with param_groups and"
                f" step()); got {type(optimizer).__name__}."
            )
        machine: ScalerMachine = self._machine
        return machine.step(optimizer, args, kwargs)

    def update(self, new_scale: Any = None) -> None:
        """Ends the iteration: backs the scale off if an overflow was found since the
        last update, else counts a clean step (and grows after ``growth_interval``).

        Args:
            new_scale: set this scale instead (a positive finite number, or a 1-element
                tensor).

        Raises:
            RuntimeError: nothing was unscaled or checked since the last update (and no
                new_scale).
        """
        machine: ScalerMachine = self._machine
        if machine.enabled:
            machine.update(new_scale)

    # -- inspection and settings --------------------------------------------------------------
    @property
    def adapter_view(self) -> AdapterView:
        """The declared members an adapter's subclass may read (:class:`AdapterView`)."""
        return AdapterView(self._machine)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). No device sync,
        except after a fused optimizer moved the scale to the device (as torch.amp)."""
        machine = self._machine
        if not machine.enabled:
            return 1.0
        machine.refuse_in_trace("GradScaler.get_scale() (or scale_factor)", "read")
        return machine.current_scale()

    @property
    def scale_factor(self) -> float:
        """megengine.amp's name for the current scale; assignable.

        Reading it counts as handing the scale out (megengine.amp's manual mode passes
        it as ``dy`` to ``gm.backward``)."""
        machine = self._machine
        machine.refuse_in_trace("GradScaler.get_scale() (or scale_factor)", "read")
        machine.hand_out(None)
        machine.dropped.forget()
        return self.get_scale()

    @scale_factor.setter
    def scale_factor(self, value: Any) -> None:
        machine = self._machine
        value = valid_scale(value, "scale_factor", lambda: machine.backend)
        machine.refuse_in_trace("Setting GradScaler.scale_factor", "write")
        machine.scale_state.set(value)

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: every method is a pass-through)."""
        return self._machine.enabled

    def stats(self) -> dict[str, Any]:
        """Telemetry, as plain Python values, without a device sync.

        Keys: ``scale``, ``growth_tracker``, ``steps`` (updates that followed an
        unscale), ``skipped_steps`` (of those, how many found an inf/NaN),
        ``last_step_skipped``, ``enabled``, ``as_of_step``: the step the other
        values describe (it equals ``steps`` except with fused optimizers on a GPU,
        where the values arrive asynchronously and may trail by a step or two);
        ``checks_since_update`` and ``overflows_since_update``: the gradient checks
        since the last ``update()`` and how many of them found an inf/NaN (a loop that
        unscales without ever calling ``update()`` shows here, its ``steps`` stuck);
        ``overflows``: the recent overflow reports.
        """
        machine = self._machine
        scale_state, iteration = machine.scale_state, machine.iteration
        # Inside a trace the values stay as of the last read (as_of_step says which).
        if machine.enabled and scale_state.device_scale is not None and \
                _tracing.mode(machine.backend) is None:
            scale_state.poll()
        return {
            "scale": scale_state.scale if machine.enabled else 1.0,
            "growth_tracker": scale_state.growth_tracker,
            "steps": scale_state.steps,
            "skipped_steps": scale_state.skipped_steps,
            "last_step_skipped": scale_state.last_step_skipped,
            "enabled": machine.enabled,
            "as_of_step": scale_state.as_of_step,
            "checks_since_update": len(iteration.checks) + iteration.folded_checks,
            "overflows_since_update": iteration.overflows(),
            "overflows": self._forensics.history_dicts(),
        }

    # -- overflow forensics (forensics.py) ------------------------------------------------
    def watch(self: _S, model: Any = None, *, warn_after: int = 10, warn_below: float = 1.0,
              history: int = 16) -> _S:
        """Names ``model``'s parameters in overflow reports, and sets when a run of
        skipped steps warns. Installs no hook; costs nothing on a clean step.

        Every step that a gradient check skips gets a report (``last_overflow()``,
        ``stats()["overflows"]``), with or without ``watch``; unwatched, gradients are
        named by position. ``amp.trace_forward(model)`` adds the first non-finite
        module of the forward pass.

        Args:
            model: a module of the active framework (``torch.nn.Module``,
                ``megengine.module.Module``); None changes only the settings below.
            warn_after: skipped steps in a row after which one ``amp.OverflowWarning``
                is raised for that run of skips.
            warn_below: a loss scale below which a run of skips warns at once
                (0 turns the floor off).
            history: how many reports ``stats()["overflows"]`` keeps (the newest).

        Returns:
            self, so that ``scaler = amp.GradScaler().watch(model)`` reads naturally.

        Raises:
            TypeError: ``model`` is not a module (``model.parameters()`` is not one).
            ValueError: a setting out of range.
        """
        self._forensics.watch(model, warn_after, warn_below, history)
        return self

    def last_overflow(self) -> Any:
        """The report of the newest gradient check that found an inf/NaN (an
        ``amp.OverflowReport``), or None.

        ``str(report)`` is one line: step, scale, loss, which gradients were inf or
        NaN, and the likely cause; ``report.as_dict()`` is the same as plain data.
        """
        return self._forensics.last

    def get_growth_factor(self) -> float:
        return self._machine.scale_state.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        scale_state = self._machine.scale_state
        check_factors(scale_state.scale, new_factor, scale_state.backoff_factor,
                      scale_state.growth_interval)
        scale_state.growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._machine.scale_state.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        scale_state = self._machine.scale_state
        check_factors(scale_state.scale, scale_state.growth_factor, new_factor,
                      scale_state.growth_interval)
        scale_state.backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._machine.scale_state.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        scale_state = self._machine.scale_state
        check_factors(scale_state.scale, scale_state.growth_factor, scale_state.backoff_factor,
                      new_interval)
        scale_state.growth_interval = new_interval

    # -- checkpoints and pickling -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers, the same dict on both backends: torch.amp's keys,
        megengine.amp's ``scale_factor`` and ``stats()``'s counters (``steps``,
        ``skipped_steps``, ``last_step_skipped``), so that either framework's own
        scaler loads it too. Empty when disabled (as torch.amp)."""
        machine = self._machine
        if not machine.enabled:
            return {}
        machine.refuse_in_trace("GradScaler.state_dict()", "read")
        return machine.scale_state.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a dict from ``state_dict()``, torch.amp's or megengine.amp's (then
        ``stats()``'s counters stay as they are). One it cannot load raises
        ``amp.StateDictError`` (also the natives' error types) and changes nothing.
        No-op when disabled."""
        machine = self._machine
        if machine.enabled:
            machine.refuse_in_trace("GradScaler.load_state_dict()", "write")
            machine.scale_state.load(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        machine = self._machine
        if machine.iteration.optimizers or machine.iteration.checked():
            raise ScalerStateError(
                "A GradScaler instance may only be pickled at the beginning of an"
                " iteration, or at the end after scaler.update()."
            )
        scale_state = machine.scale_state
        scale_state.sync_from_device()
        # Settings and numbers only: device tensors, the ledger (live gradients), the
        # overflow reports (models) and a process group (a live communicator) are
        # remade or given again after loading.
        state = {k: v for k, v in self.__dict__.items() if k not in ("_machine", "_forensics")}
        state["_settings"] = (machine.enabled, machine.device, machine.updated_by_backward,
                              scale_state.numbers())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        enabled, device, updated_by_backward, numbers = state.pop("_settings")
        self.__dict__.update(state)
        self._start(ScalerMachine(self, enabled, device, None, ScaleState(*numbers)))
        self._machine.updated_by_backward = updated_by_backward

    def __repr__(self) -> str:
        machine = self._machine
        scale_state = machine.scale_state
        # Inside a trace the scale is on the device, and reading it is refused.
        traced = machine.enabled and _tracing.mode(machine.backend) is not None
        scale = "<on the device, in a trace>" if traced else self.get_scale()
        return (
            f"GradScaler(scale={scale}, growth_factor={scale_state.growth_factor},"
            f" backoff_factor={scale_state.backoff_factor},"
            f" growth_interval={scale_state.growth_interval}, enabled={machine.enabled})"
        )

