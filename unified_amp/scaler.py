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
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
import operator
import struct
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Sequence, overload

from . import distributed
from ._ledger import MIXED, Check, GradLedger, _no_version
from .forensics import Forensics, OverflowReport
from ._registry import get_backend
from ._targets import _short, is_optimizer, params_of

__all__ = ["GradScaler", "next_scale"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptState:
    """One optimizer's progress through the current iteration (torch.amp's stages)."""

    __slots__ = ("stage", "checks")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.checks: list[Check] = []  # the checks that covered its gradients


def _f32(x: float) -> float:
    """``x`` rounded to float32, the precision torch keeps its scale in (inf past its range)."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
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


# The call forms users bring with them (see GradScaler's docstring), as signatures to bind.
def _unified_form(init_scale: float = 2.0**16, growth_factor: float = 2.0,
                  backoff_factor: float = 0.5, growth_interval: int = 2000,
                  enabled: bool = True, *, device: str | None = None,
                  process_group: Any = None) -> None:
    pass


# ShardedGradScaler's form too: it adds process_group after enabled.
def _torch_form(device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000,
                enabled: bool = True, process_group: Any = None) -> None:
    pass


_UNIFIED_SIG = inspect.signature(_unified_form)
_TORCH_SIG = inspect.signature(_torch_form)
_CALL_FORMS = ("GradScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,"
               " growth_interval=2000, enabled=True, *, device=None, process_group=None)"
               " or torch.amp's GradScaler(device, init_scale, ...)")


def _bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The constructor's arguments, in either native's call form, with defaults."""
    torch_form = bool(args) and isinstance(args[0], str)
    try:
        bound = (_TORCH_SIG if torch_form else _UNIFIED_SIG).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"GradScaler(): {exc}. Its call forms: {_CALL_FORMS}.") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _device_of_call(args: tuple, kwargs: dict) -> str | None:
    device = args[0] if args and isinstance(args[0], str) else kwargs.get("device")
    return None if device is None else str(device)


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler_kwarg(optimizer_class: Any) -> bool:
    # torch's older contract for optimizers that unscale themselves: the scaler passes
    # itself as step(grad_scaler=...). Asked once per class: inspect.signature is slow.
    try:
        return "grad_scaler" in inspect.signature(optimizer_class.step).parameters
    except (TypeError, ValueError):
        return False


_STATE_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


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
    __signature__ = _UNIFIED_SIG

    def __new__(cls, *args: Any, **kwargs: Any) -> "GradScaler":
        if cls is GradScaler:
            # The adapter may name a subclass that is also its framework's own scaler
            # class (torch.amp.GradScaler), so that isinstance checks in runners pass.
            choose = getattr(get_backend(), "scaler_class", None)
            if choose is not None:
                cls = choose(_device_of_call(args, kwargs))
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
        a = _bind(args, kwargs)
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
        self._process_group = a["process_group"]
        if self._process_group is not None and self._enabled:
            distributed.check_group(self._be(), self._process_group)
        self._scale_value = _f32(float(a["init_scale"]))
        self._growth_factor = float(a["growth_factor"])
        self._backoff_factor = float(a["backoff_factor"])
        self._growth_interval = a["growth_interval"]
        self._tracker = 0
        self._steps = 0
        self._skipped_steps = 0
        self._last_step_skipped = False
        self._as_of_step = 0  # the step the telemetry describes (lags only in device mode)
        self._dev: Any = None  # the adapter's device-resident scale, once a fused step ran
        self._ledger = GradLedger()
        # optimizer -> (the shape of its param_groups, its parameters), reused while
        # the groups stay the same lists: rebuilding it is a pass over every parameter
        self._param_lists: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._updated_by_backward = False  # the last update() was backward()'s own
        self._forensics = Forensics(self)  # overflow reports (forensics.py)
        # optimizer id -> the checks behind its last step after backward()'s update()
        self._tail: dict[int, list[Check]] = {}
        self._new_iteration()

    # -- internals ----------------------------------------------------------------------
    def _be(self) -> Any:
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    def _new_iteration(self) -> None:
        # What happened since the last update(): per-optimizer stages keyed by id() as in
        # torch.amp (the keys live for one iteration only), and every check, for update().
        self._opt_states: dict[int, _OptState] = {}
        self._checks: list[Check] = []
        # How the scale was handed out since the last update: through outputs whose
        # backward the adapter can watch, or in a way it cannot (scale_factor, dy=...).
        self._handed_watched = False
        self._handed_blind = False
        self._saw_backward = False
        self._forensics.end_iteration()

    def _opt_state(self, optimizer: Any) -> _OptState:
        state = self._opt_states.get(id(optimizer))
        if state is None:
            state = self._opt_states[id(optimizer)] = _OptState()
        return state

    @property
    def _version(self) -> Any:
        """The adapter's gradient version counter, or a stand-in that has none."""
        return getattr(self._be(), "grad_version", _no_version)

    def _steps_on_device(self, optimizer: Any) -> bool:
        backend = self._be()
        supported = getattr(backend, "steps_on_device", None)
        if supported is None or not supported(optimizer):
            return False
        if self._dev is None:
            self._dev = backend.device_scale(optimizer, self._scale_value, self._tracker,
                                             self._skipped_steps)
        return True

    def _inv_scale(self) -> float:
        # The reciprocal in float64, rounded to float32 by the adapter: torch.amp's
        # "FP32 division can be imprecise" recipe, and what megengine.amp computes too.
        return 1.0 / self._scale_value if self._scale_value else math.inf

    def _params_of_optimizer(self, optimizer: Any) -> list[Any]:
        groups = optimizer.param_groups
        shape = [(id(g["params"]), len(g["params"])) for g in groups]
        try:
            cached = self._param_lists.get(optimizer)
        except TypeError:  # not weak-referenceable: no cache
            return params_of(optimizer, self._be(), "GradScaler.step()")
        if cached is not None and cached[0] == shape:
            return cached[1]
        params = params_of(optimizer, self._be(), "GradScaler.step()")
        self._param_lists[optimizer] = (shape, params)
        return params

    def _read(self, flag: Any) -> bool:
        return bool(self._be().flag_is_set(flag))

    def _split(self, params: list[Any]
               ) -> tuple[list[Any], list[Any], list[Check], list[Any]]:
        """``params`` with a gradient that still needs unscaling and those gradients,
        the checks that already covered others (from the ledger), and the params with
        neither."""
        grads = [p.grad for p in params]
        if self._ledger.empty():  # the usual step: one pass, no lookups
            if not any(map(_is_none, grads)):  # (not `None in`: that calls __eq__)
                return params, grads, [], []
            pending = [p for p, g in zip(params, grads) if g is not None]
            idle = [p for p, g in zip(params, grads) if g is None]
            return pending, [g for g in grads if g is not None], [], idle
        pending, pending_grads, done, idle, mixed = [], [], {}, [], 0
        for p, g, check in zip(params, grads,
                               self._ledger.answers(params, grads, self._version)):
            if check is MIXED:
                mixed += 1
            elif check is not None:
                done[id(check)] = check
            elif g is not None:
                pending.append(p)
                pending_grads.append(g)
            else:
                idle.append(p)
        if mixed:
            raise _mixed_error(mixed, len(params))
        return pending, pending_grads, list(done.values()), idle

    def _rescale_held(self, params: list[Any]) -> None:
        """Brings gradients this scaler unscaled, and that still hold those values,
        back to the current scale, in one fused multiply: the backward about to run
        adds scaled gradients to them, and one unscale afterwards then gives the true
        sum (automatic mode's accumulation; docs/DROP_IN.md)."""
        if self._ledger.empty():
            return
        grads = [p.grad for p in params]
        held, mixed = [], 0
        for g, check in zip(grads, self._ledger.answers(params, grads, self._version)):
            if check is MIXED:
                mixed += 1
            elif check is not None and g is not None:
                held.append(g)  # (a gradient dropped on overflow holds nothing)
        if mixed:
            raise _mixed_error(mixed, len(params))
        if not held:
            return
        grads = held
        # The fused check-and-multiply kernel, given the scale where an unscale gives
        # its reciprocal; the flag is not read: a gradient that is inf/NaN (or becomes
        # so) stays so, and the unscale after the backward finds it.
        if self._dev is not None:
            self._dev.rescale(grads)
        else:
            self._be().unscale_and_check(grads, self._scale_value)

    def _require_scaled(self, what: str) -> None:
        """Raises if unscaling now would shrink gradients that were never scaled."""
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs)"
               " earlier in the iteration.")
        if not (self._handed_watched or self._handed_blind):
            raise RuntimeError(
                f"Attempted {what} but nothing was scaled since the last update().  {fix}"
                f" Unscaling now would divide unscaled gradients by the scale"
                f" ({self._scale_value:g}); call scaler.scale(loss).backward(),"
                f" gm.backward(scaler.scale(loss)) or scaler.backward(gm, loss) first."
            )
        if self._handed_watched and not self._handed_blind and not self._saw_backward:
            raise RuntimeError(
                f"Attempted {what} but no backward pass has gone through a scaler.scale()"
                f" output since the last update(): these gradients were not produced by a"
                f" scaled loss, and unscaling would divide them by the scale"
                f" ({self._scale_value:g}). Call .backward() on scaler.scale(loss), not on"
                f" the loss itself."
            )

    def _scaled_or_idle(self, pending: list[Any], idle: list[Any], what: str
                        ) -> tuple[Any, bool]:
        """Whether ``pending`` may be unscaled: returns ``(agreement, unscale)`` for
        ``_check``, or raises if nothing was scaled since the last update.

        One exception to the raise: a rank of a job whose checks are agreed across ranks
        (a process_group, FSDP) that had no loss this step -- an empty micro-batch, an
        expert that got no tokens -- may still hold gradients (zeroed in place). They are
        not scaled, so they are checked as they are, not divided, and the rank joins the
        other ranks' decision instead of leaving them waiting in the collective.
        """
        if self._handed_watched or self._handed_blind:
            self._require_scaled(what)  # raises only if no backward used the scale
            return False, True
        agreement = distributed.plan(self._be(), pending, idle, self._process_group)
        if agreement is None:
            self._require_scaled(what)  # raises
        return agreement, False

    def _check(self, params: list[Any], *, grads: list[Any] | None = None,
               idle: Sequence[Any] = (), agreement: Any = False,
               unscale: bool = True, read: bool = True, allow_fp16: bool = False) -> Check:
        """Checks the gradients of ``params`` for inf/NaN in one fused call, unscaling
        them too unless a fused optimizer will. ``read`` reads the verdict at once (the
        sync); otherwise it is read when first needed.

        In a multi-process job the verdict is agreed across ranks (distributed.py);
        ``idle`` (the target's params without a gradient here) then take part too, and
        ``agreement`` may pass the plan when the caller made it already.
        """
        backend = self._be()
        if agreement is False:
            agreement = distributed.plan(backend, params, list(idle), self._process_group)
        if grads is None:
            grads = backend.grads(params)
        if agreement is not None and agreement.standins:
            grads = grads + agreement.standins
        if not allow_fp16:
            for dtype in {g.dtype for g in grads}:
                if backend.dtype_name(dtype) == "float16":
                    raise ValueError(
                        "Attempting to unscale FP16 gradients. GradScaler needs float32"
                        " parameters (and so float32 gradients): keep the model in float32"
                        " and let autocast run the low-precision ops."
                    )
        flag = None
        if grads:
            if self._dev is not None:
                flag = self._dev.unscale_and_check(grads) if unscale else self._dev.check(grads)
            else:
                flag = backend.unscale_and_check(grads, self._inv_scale() if unscale else 1.0)
        if agreement is not None:
            check = agreement.check(flag, params or list(idle))
            # Every rank now covers the same parameters, gradient or not.
            self._ledger.record(list(idle), [None] * len(idle), check)
        else:
            check = Check(None, False) if flag is None else Check(flag, None)
        if check.found is None:
            check.on_overflow = self._forensics.hook(params)
        if read:
            check.verdict(self._read)  # the one sync
        self._checks.append(check)
        return check

    def _unscale(self, target: Any, what: str, *, drop: bool) -> None:
        """unscale()/unscale_(): the shared part. ``drop``: megengine.amp's form."""
        state = None
        if is_optimizer(target):
            state = self._opt_state(target)
            if state.stage is _Stage.UNSCALED:
                raise RuntimeError(
                    "unscale_() has already been called on this optimizer since the last"
                    " update(). Unscaling twice would divide its gradients by the scale"
                    " twice; call scaler.update() to finish the iteration first."
                )
            if state.stage is _Stage.STEPPED:
                raise RuntimeError(
                    "unscale_() is being called after step(). Unscale before"
                    " scaler.step(optimizer) (step() unscales by itself when you don't)."
                )
        params = params_of(target, self._be(), f"GradScaler.{what}")
        pending, grads, done, idle = self._split(params)
        if done:
            raise RuntimeError(
                f"{what} has already been called on these gradients: no backward pass"
                f" the scaler could see (through scaler.scale() or scaler.backward()) has"
                f" written them since they were unscaled. Unscaling twice would divide"
                f" them by the scale twice. Unscale each set of gradients once, after all"
                f" of its backward passes (scaler.backward(gm, loss) already unscales"
                f" unless unscale_grad=False); a gm.backward(loss, dy=scale_factor) into"
                f" gradients that were not cleared also adds to unscaled ones."
            )
        agreement, unscale = False, True
        if pending:
            agreement, unscale = self._scaled_or_idle(pending, idle, what)
            distributed.require_synced(self._be(), pending, f"GradScaler.{what}")
        if state is not None:
            self._steps_on_device(target)  # a fused optimizer moves the scale to the device
        # megengine.amp's form must read the verdict now, to drop; torch.amp's reads it
        # in step(), as torch.amp does.
        check = self._check(pending, grads=grads, idle=idle, agreement=agreement,
                            unscale=unscale, read=drop)
        if drop and check.found:
            self._be().drop_grads(pending)
            grads = [None] * len(pending)
        # torch.amp's unscale_ is followed by step() and update() within the iteration;
        # megengine.amp's unscale may be followed by the next forward instead.
        self._ledger.record(pending, grads, check, weak=drop)
        if state is not None:
            state.stage = _Stage.UNSCALED
            state.checks.append(check)

    # -- loss scaling -------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list/tuple of tensors) times the current scale."""
        if not self._enabled:
            return outputs
        self._forensics.saw_loss(outputs)
        backend = self._be()
        watch = getattr(backend, "watch_backward", None)

        def apply(val: Any, where: str) -> Any:
            if backend.is_tensor(val):
                out = self._dev.scale(val) if self._dev is not None else backend.scale(
                    val, self._scale_value)
                if watch is not None and watch(out, self._on_scaled_backward):
                    self._handed_watched = True
                else:
                    self._handed_blind = True
                    self._ledger.new_backward(self._version)  # a backward may follow unseen
                return out
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v, f"{where}[{i}]") for i, v in enumerate(val))
            if isinstance(val, Iterable) and not isinstance(val, (str, bytes, Mapping)):
                return map(lambda v: apply(v, f"{where}[...]"), val)
            raise ValueError(
                f"GradScaler.scale() expects a {backend.name} tensor or a list/tuple of"
                f" them; {where} is {type(val).__name__} {_short(val)}. Scale only the"
                f" loss (or outputs) you call backward on."
            )

        return apply(outputs, "outputs")

    def _on_scaled_backward(self) -> None:
        # Called by the adapter when a backward pass runs through a scale() output.
        self._saw_backward = True
        self._ledger.new_backward(self._version)

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
            cotangents = self._be().scaled_cotangents(ys, dys, self._scale_value)
        attached = [p for p in gm.attached_tensors() if p is not None]
        self._rescale_held(attached)
        # This backward writes a new generation of gm's gradients.
        self._ledger.forget(attached)
        self._ledger.new_backward(self._version)
        self._handed_blind = True
        self._forensics.saw_loss(ys)
        gm.backward(ys, cotangents)
        if unscale_grad:
            self.unscale(gm)
            if update_scale:
                self._update(None)  # not the user's: the ledger's iteration goes on
                self._updated_by_backward = True
            self._ledger.weaken()  # the user's step, zero_grad and next forward follow

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
        on_device = self._steps_on_device(optimizer)
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
            fused_unscale = on_device and not done and unscale
            check = self._check(pending, grads=grads, idle=idle,
                                agreement=agreement or False,
                                unscale=unscale and not fused_unscale, read=False,
                                allow_fp16=fused_unscale)
            if not fused_unscale:
                self._ledger.record(pending, grads, check, weak=False)
            checks.append(check)
        if not checks and not on_device:
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

    def _step_unless_found(self, optimizer: Any, checks: list[Check], on_device: bool,
                           fused_unscale: bool, args: tuple, kwargs: dict) -> Any:
        if any(c.found is True for c in checks):
            return None
        if on_device:
            return self._dev.step(optimizer, fused_unscale,
                                  [c.ready() for c in checks if c.flag is not None],
                                  args, kwargs)
        if any(c.verdict(self._read) for c in checks):  # the one sync per step
            return None
        return optimizer.step(*args, **kwargs)

    def _tail_step(self, optimizer: Any, checks: list[Check], on_device: bool,
                   args: tuple, kwargs: dict) -> Any:
        previous = self._tail.get(id(optimizer))
        if previous is not None and len(previous) == len(checks) and all(
                any(c is k for k in previous) for c in checks):
            raise RuntimeError(
                "step() has already been called on these gradients: scaler.backward(gm,"
                " loss) unscaled them and called update(), and scaler.step(optimizer)"
                " then stepped them once. Run the next backward pass first."
            )
        self._tail[id(optimizer)] = checks
        return self._step_unless_found(optimizer, checks, on_device, False, args, kwargs)

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
        self._update(new_scale)
        self._ledger.new_iteration()

    def _update(self, new_scale: Any) -> None:
        if new_scale is not None:
            new_scale = self._valid_scale(new_scale, "update(new_scale=...)")
        elif not self._checks:
            raise self._nothing_checked()
        checked = bool(self._checks)
        if self._dev is not None:
            if checked:
                self._steps += 1
            found_host = any(c.found is True for c in self._checks)
            flags = [c.ready() for c in self._checks if c.found is None]
            for c in self._checks:
                c.on_overflow = None  # never read on the host, so never reported
            self._dev.update(found_host, flags, self._growth_factor,
                             self._backoff_factor, self._growth_interval,
                             steps=self._steps, count=checked, new_scale=new_scale)
        else:
            found = any([c.verdict(self._read) for c in self._checks])
            if new_scale is not None:
                self._scale_value = new_scale
            else:
                self._scale_value, self._tracker = next_scale(
                    self._scale_value, self._tracker, found,
                    self._growth_factor, self._backoff_factor, self._growth_interval,
                )
            if checked:
                self._count_step(found)
        self._updated_by_backward = False
        self._new_iteration()

    def _nothing_checked(self) -> RuntimeError:
        hint = (" scaler.backward(gm, loss) already unscaled this iteration's gradients and"
                " called update(); drop this update() call, or pass"
                " backward(..., update_scale=False) to update yourself."
                if self._updated_by_backward else
                " Call scaler.step(optimizer), scaler.unscale_(optimizer) or"
                " scaler.unscale(gm) first, or pass update(new_scale=...).")
        return RuntimeError("No inf checks were recorded prior to update()." + hint)

    def _count_step(self, skipped: bool) -> None:
        self._steps += 1
        self._skipped_steps += int(skipped)
        self._last_step_skipped = skipped
        self._as_of_step = self._steps
        self._forensics.counted(skipped, self._scale_value, self._steps)

    def _set_scale(self, value: float) -> None:
        self._scale_value = value
        if self._dev is not None:
            self._dev.load(value, None)

    def _sync_from_device(self) -> None:
        """Reads the device-resident scale and tracker back (a sync, as torch.amp's
        get_scale() is)."""
        if self._dev is not None:
            self._scale_value, self._tracker = self._dev.read()

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
        return self._scale_value

    @property
    def scale_factor(self) -> float:
        """megengine.amp's name for the current scale; assignable.

        Reading it counts as handing the scale out (megengine.amp's manual mode passes
        it as ``dy`` to ``gm.backward``)."""
        self._handed_blind = True
        return self.get_scale()

    @scale_factor.setter
    def scale_factor(self, value: Any) -> None:
        self._set_scale(self._valid_scale(value, "scale_factor"))

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: every method is a pass-through)."""
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
                (self._as_of_step, self._scale_value, self._tracker, self._skipped_steps,
                 self._last_step_skipped) = snapshot
        return {
            "scale": self._scale_value if self._enabled else 1.0,
            "growth_tracker": self._tracker,
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "last_step_skipped": self._last_step_skipped,
            "enabled": self._enabled,
            "as_of_step": self._as_of_step,
            "overflows": self._forensics.history_dicts(),
        }

    # -- overflow forensics (forensics.py) ------------------------------------------------
    def watch(self, model: Any = None, *, warn_after: int = 10, warn_below: float = 1.0,
              history: int = 16) -> "GradScaler":
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

    def last_overflow(self) -> OverflowReport | None:
        """The report of the newest gradient check that found an inf/NaN, or None.

        ``str(report)`` is one line: step, scale, loss, which gradients were inf or
        NaN, and the likely cause; ``report.as_dict()`` is the same as plain data.
        """
        return self._forensics.last

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_factors(self._scale_value, new_factor, self._backoff_factor,
                       self._growth_interval)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factors(self._scale_value, self._growth_factor, new_factor,
                       self._growth_interval)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_factors(self._scale_value, self._growth_factor, self._backoff_factor,
                       new_interval)
        self._growth_interval = new_interval

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.amp's keys, plain Python numbers, loadable by either backend.
        Empty when disabled (as torch.amp)."""
        if not self._enabled:
            return {}
        self._sync_from_device()
        return {
            "scale": self._scale_value,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._tracker,
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
        self._scale_value = _f32(float(scale))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = state_dict["growth_interval"]
        self._tracker = tracker
        if self._dev is not None:
            self._dev.load(self._scale_value, tracker)

    def __getstate__(self) -> dict[str, Any]:
        if self._opt_states or self._checks:
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning of an"
                " iteration, or at the end after scaler.update()."
            )
        self._sync_from_device()
        state = self.__dict__.copy()
        state["_backend"] = None  # re-resolved on first use after unpickling
        state["_dev"] = None  # device tensors are remade at the next fused step
        state["_ledger"] = GradLedger()  # it refers to live tensors
        state["_param_lists"] = None  # (weak references do not pickle)
        state["_forensics"] = None  # it refers to models; watch() again after loading
        state["_process_group"] = None  # a live communicator; give it again after loading
        state["_tail"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._param_lists = weakref.WeakKeyDictionary()
        if self.__dict__.get("_forensics") is None:
            self._forensics = Forensics(self)

    def __repr__(self) -> str:
        return (
            f"GradScaler(scale={self.get_scale()}, growth_factor={self._growth_factor},"
            f" backoff_factor={self._backoff_factor},"
            f" growth_interval={self._growth_interval}, enabled={self._enabled})"
        )


_is_none = functools.partial(operator.is_, None)


def _mixed_error(mixed: int, total: int) -> RuntimeError:
    return RuntimeError(
        f"{mixed} of the {total} gradients were unscaled, then a backward pass added"
        f" scaled gradients to them before update(): they now mix unscaled and scaled"
        f" values, and no unscale can fix that. When accumulating micro-batches, unscale"
        f" once, after the last backward, or accumulate with scaler.backward(gm, loss),"
        f" which rescales what it already unscaled (if you zeroed the gradients in place"
        f" between iterations without calling update(), set them to None instead)."
    )


def _numel(t: Any) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n

