"""``GradScaler``: dynamic loss scaling, one state machine for both frameworks.

The state (scale, growth tracker, per-optimizer stage, the ledger of unscaled gradient
generations) lives here as plain Python; adapters only scale tensors, run the fused
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

Both forms share the ledger (``_ledger.py``), so they compose: ``backward(gm, loss)``
then ``step(optimizer)`` neither unscales twice nor forgets the verdict.

One exception to "state on the host", for optimizers that skip a step on the device by
themselves (torch's ``fused=True`` Adam/AdamW/SGD read ``grad_scale``/``found_inf``
tensors): once such an optimizer steps, the adapter keeps the scale and growth tracker
in device tensors and updates them with the framework's own kernel, so a step needs no
sync at all. The stage logic is the same in both modes; only where the arithmetic runs
differs.

Where the parts live: this module has the constructor and the loop's methods
(``scale``, ``backward``, ``unscale``, ``unscale_``, ``step``, ``update``);
``_scaler_state.py`` the state machine they drive (stages, checks, the ledger, the
device-resident mode); ``_scaler_surface.py`` inspection, settings, checkpoints and
pickling; ``_scale_rule.py`` the scale rule and the checks of its numbers;
``_call_forms.py`` the constructor's two call forms.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any, overload

from . import _foreign, distributed
from ._call_forms import UNIFIED_SIG, bind, device_of_call
from ._ledger import Check, GradLedger
from ._registry import get_backend
from ._scale_rule import check_factors, f32, next_scale
from ._scaler_state import AdapterView, _Stage
from ._scaler_surface import ScalerSurface
from ._targets import is_optimizer, params_of
from ._scaler_forensics import Forensics
from .interface import BackwardHooks, NativeScalerClass, capability

__all__ = ["GradScaler", "AdapterView", "next_scale"]


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler_kwarg(optimizer_class: Any) -> bool:
    # torch's older contract for optimizers that unscale themselves: the scaler passes
    # itself as step(grad_scaler=...). Asked once per class: inspect.signature is slow.
    try:
        return "grad_scaler" in inspect.signature(optimizer_class.step).parameters
    except (TypeError, ValueError):
        return False


class GradScaler(ScalerSurface):
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
        if not isinstance(a["enabled"], bool):
            raise TypeError(f"GradScaler enabled must be a bool; got {a['enabled']!r}.")
        self._backend = None
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
        self._process_group = a["process_group"]
        if self._process_group is not None and self._enabled:
            distributed.check_group(self._be(), self._process_group)
        self._scale_value = f32(float(a["init_scale"]))
        self._growth_factor = float(a["growth_factor"])
        self._backoff_factor = float(a["backoff_factor"])
        self._growth_interval = a["growth_interval"]
        self._tracker = 0
        self._steps = 0
        self._skipped_steps = 0
        self._last_step_skipped = False
        self._as_of_step = 0  # the step the telemetry describes (lags only in device mode)
        self._dev: Any = None  # the adapter's device-resident scale, once a fused step ran
        self._trace_copy: Any = None  # its copy of the scale for traced steps (_tracing.py)
        self._ledger = GradLedger()
        self._param_lists = weakref.WeakKeyDictionary()
        self._updated_by_backward = False  # the last update() was backward()'s own
        self._forensics = Forensics(self, self._enabled)  # overflow reports (forensics.py)
        # optimizer id -> the checks behind its last step after backward()'s update()
        self._tail: dict[int, list[Check]] = {}
        self._new_iteration()
        self._mirror()

    # -- loss scaling -------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list/tuple of tensors) times the current scale."""
        if not self._enabled:
            return outputs
        self._traced("GradScaler.scale()")
        self._forensics.saw_loss(outputs)
        return self._scaled(outputs, "outputs")

    def _scaled(self, val: Any, where: str) -> Any:
        caps = self._caps()
        backend = caps.backend
        if backend.is_tensor(val):
            out = self._dev.scale(val) if self._dev is not None else backend.scale(
                val, self._scale_value)
            hooks = caps.hooks
            if hooks is not None and hooks.watch_backward(out, self._on_scaled_backward):
                self._handed_watched = True
            else:
                self._handed_blind = True
                self._ledger.new_backward(self._version)  # a backward may follow unseen
            return out
        if isinstance(val, (list, tuple)):
            return type(val)(self._scaled(v, f"{where}[{i}]") for i, v in enumerate(val))
        if _foreign.scalable(val, backend.name):
            return map(lambda v: self._scaled(v, f"{where}[...]"), val)
        raise _foreign.not_a_tensor("GradScaler.scale()", backend.name, where, val,
                                    "Scale only the loss (or outputs) you call backward on.")

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
        if not self._enabled:
            gm.backward(y, dy)
            return
        if unscale_grad:
            self._refuse_in_trace("GradScaler.backward(gm, loss)", "backward")
        self._traced("GradScaler.backward(gm, loss, unscale_grad=False)")
        ys = [] if y is None else list(y) if isinstance(y, (list, tuple)) else [y]
        _foreign.require_tensors(self._be(), ys, "GradScaler.backward(gm, y)",
                                 "Pass the loss (or outputs) the forward pass recorded.")
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
            cotangents = self._be().scaled_cotangents(ys, dys, self._scale_value)
        attached = params_of(gm, self._be(), "GradScaler.backward()")
        self._rescale_held(attached)
        # This backward writes a new generation of gm's gradients.
        self._ledger.forget(attached)
        self._ledger.new_backward(self._version)
        self._handed_blind = True
        self._forensics.saw_loss(ys)
        ahead = unscale_grad and update_scale and self._mirror_ahead()
        try:
            gm.backward(ys, cotangents)
            if unscale_grad:
                self._unscale(gm, "unscale()", drop=True, params=attached)
                if update_scale:
                    self._update(None)  # not the user's: the ledger's iteration goes on
                    self._updated_by_backward = True
                self._ledger.weaken()  # the user's step, zero_grad and next forward follow
        except BaseException:
            if ahead:
                self._mirror()  # back to the host's values: this step did not update
            raise

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
        if self._enabled:
            self._refuse_in_trace("GradScaler.unscale()", "unscale")
            self._unscale(target, "unscale()", drop=True)
        return self

    def unscale_(self, optimizer: Any) -> None:
        """torch.amp's ``unscale_``: divides the optimizer's gradients by the scale in
        place and checks them, leaving any inf/NaN in ``.grad`` (``step()`` then skips).

        The verdict is read in ``step()`` (or ``update()``), as torch.amp does. Also
        accepts a GradManager or an iterable of parameters.

        Raises:
            RuntimeError: as ``unscale()``.
        """
        if self._enabled:
            self._traced("GradScaler.unscale_()")
            self._unscale(optimizer, "unscale_()", drop=False)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscales ``optimizer``'s gradients if not yet done, then steps it unless an
        inf/NaN was found in them.

        Returns what ``optimizer.step(*args, **kwargs)`` returns, or None if skipped.

        Raises:
            RuntimeError: the optimizer already stepped since the last ``update()``; its
                gradients need unscaling but nothing was scaled since the last update;
                it has no gradients and none were checked; or a ``closure`` was given.
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
        state = self._opt_state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call"
                " scaler.update() once per iteration, after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False) and \
                _takes_grad_scaler_kwarg(optimizer.__class__):
            # The optimizer unscales and checks by itself, asking this scaler.
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the"
                " passed optimizer. In the near future GradScaler registers `grad_scale:"
                " Tensor` and `found_inf: Tensor` to the passed optimizer and let the"
                " optimizer use them directly.",
                FutureWarning,
                stacklevel=2,
            )
            result = optimizer.step(*args, **dict(kwargs, grad_scaler=self))
            state.stage = _Stage.STEPPED
            return result
        # A fused optimizer skips on the device by itself; inside a trace the adapter's
        # device scale skips for any optimizer (_tracing.py).
        fused = self._steps_on_device(optimizer)
        on_device = fused or self._traced("GradScaler.step()")
        params = self._params_of_optimizer(optimizer)
        pending, grads, done, idle = self._split(params)
        if state.stage is _Stage.READY and not pending and done and not any(
                c is k for c in done for k in self._checks):
            # Every gradient was decided by checks that an update() already consumed:
            # scaler.backward(gm, loss) then step(opt). This step ends that iteration.
            return self._tail_step(optimizer, done, on_device, args, kwargs)
        checks = list(state.checks)
        checks += [c for c in done if all(c is not k for k in checks)]
        fused_unscale = False
        agreement = None
        if state.stage is _Stage.READY and not pending and idle:
            # No gradient here, but another rank may have some: take part in its check.
            agreement = distributed.plan(self._be(), [], idle, self._process_group)
        if state.stage is _Stage.READY and (pending or agreement is not None):
            unscale = True
            if pending:
                agreement, unscale = self._scaled_or_idle(pending, idle, "step()")
            distributed.require_synced(self._be(), pending, "GradScaler.step()")
            # A fused optimizer unscales inside its own kernel (grad_scale), as with
            # torch.amp -- unless some of its gradients were unscaled already.
            fused_unscale = fused and not done and unscale
            check = self._check(pending, grads=grads, idle=idle,
                                agreement=agreement or False,
                                unscale=unscale and not fused_unscale, read=False,
                                allow_fp16=fused_unscale)
            if not fused_unscale:
                # held until update(), which torch.amp's loop calls next
                self._ledger.record(pending, grads, check, weak=False)
            checks.append(check)
        if not checks and not fused:
            raise RuntimeError(
                "No inf checks were recorded for this optimizer: none of its parameters"
                " has a gradient. Run the scaled backward pass before"
                " scaler.step(optimizer)."
            )
        result = self._step_unless_found(optimizer, checks, on_device, fused_unscale,
                                         args, kwargs)
        state.stage = _Stage.STEPPED
        state.checks = checks  # every check that decided this step
        return result

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
        if not self._enabled:
            return
        if new_scale is not None:
            self._refuse_in_trace("GradScaler.update(new_scale=...)", "write")
        self._traced("GradScaler.update()")
        self._update(new_scale)
        self._ledger.new_iteration()
