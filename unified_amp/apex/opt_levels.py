"""apex.amp's API -- ``initialize``, ``scale_loss``, opt levels O0-O3 -- on both frameworks.

An opt level is a configuration of the same core: ``autocast`` for the forward pass,
one ``GradScaler`` per ``loss_id``, and (O2, and O3 on MegEngine) float32 master
weights that the optimizer steps. The frameworks' part is a handful of adapter
primitives (cast a module, copy grads to the masters, copy the masters back);
everything about *when* lives here and in ``_patch.py``.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    loss = loss_fn(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()              # torch; gm.backward(scaled_loss) on either
    optimizer.step()                        # skipped after an overflow

docs/APEX.md has the table of what each level does on each backend; the presets and the
resolution of the overrides are _presets.py.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .. import _latest_initialize
from . import _patch, _stale
from ._presets import OptProperties, resolve_properties
from .._registry import get_backend
from ..scaler._targets import is_optimizer
from ..capabilities import OptLevelCasting, require
from ..interface import LOW_PRECISION
from ..scaler._grad_scaler import GradScaler

__all__ = [
    "OptProperties",
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "loss_scaler",
    "opt_properties",
]

_APEX_INIT_SCALE = 2.0**16  # apex's first dynamic scale (before max_loss_scale caps it)
_APEX_GROWTH_INTERVAL = 2000  # apex's scale_window


# -- the state of one initialize() call -----------------------------------------------
class _AmpState:
    """Loss scalers and bookkeeping of one ``initialize`` call; ``props`` is None after
    ``initialize(enabled=False)``, which makes everything a pass-through."""

    def __init__(self, props: OptProperties | None, num_losses: int) -> None:
        self.props = props
        self.backend = get_backend()
        # Each prepared optimizer's _OptimizerAmp, in order, and the models (to name
        # parameters in errors): weakly, since the models and optimizers are what keep
        # this state alive (_latest_initialize.remember).
        self._infos: list[Callable[[], Any]] = []
        self._models: list[Callable[[], Any]] = []
        # id(model parameter) -> its master weight (O2), for amp.keep_float32 after
        # initialize: a pinned module's weights go back to float32 from the masters.
        self.master_of: dict[int, Any] = {}
        # The (min, max) the scale is held within; (None, None) is unbounded.
        self.bounds: tuple[float | None, float | None]
        if props is None:
            self.bounds = (None, None)
            self.scalers = [GradScaler(enabled=False) for _ in range(num_losses)]
            return
        dynamic = props.loss_scale == "dynamic"
        if dynamic:
            self.bounds = (props.min_loss_scale, props.max_loss_scale)
            init = _APEX_INIT_SCALE
        else:  # a fixed scale: a scaler that never grows, held in place after backoffs
            init = float(props.loss_scale)
            self.bounds = (init, init)
        init = self._clamp_value(init)
        self.scalers = [
            GradScaler(init_scale=init, growth_interval=_APEX_GROWTH_INTERVAL if dynamic
                       else 0, enabled=props.scales_loss)
            for _ in range(num_losses)
        ]

    def add_info(self, info: Any) -> None:
        self._infos.append(_weak(info))

    def set_models(self, models: list[Any]) -> None:
        self._models = [_weak(m) for m in models]

    @property
    def infos(self) -> list[Any]:
        return [i for ref in self._infos if (i := ref()) is not None]

    @property
    def models(self) -> list[Any]:
        return [m for ref in self._models if (m := ref()) is not None]

    def _clamp_value(self, scale: float) -> float:
        low, high = self.bounds
        if high is not None and scale > high:
            scale = high
        if low is not None and scale < low:
            scale = low
        return scale

    def clamp(self, scaler: GradScaler) -> None:
        """apex's min/max loss scale, applied after update() (the tracker is kept)."""
        scale = scaler.get_scale()
        clamped = self._clamp_value(scale)
        if clamped != scale:
            scaler.scale_factor = clamped


def latest() -> _AmpState | None:
    """The state of the latest ``initialize()`` call whose models or optimizers are
    still alive, or None."""
    return _latest_initialize.latest()


def _current(what: str) -> _AmpState:
    state = latest()
    if state is None:
        raise RuntimeError(
            f"amp.{what} was called before amp.initialize(). Call"
            f" `model, optimizer = amp.initialize(model, optimizer, opt_level=...)` first.")
    return state


# -- initialize -------------------------------------------------------------------------
def _as_list(x: Any, kind: str, check: Any) -> tuple[list[Any], bool]:
    if isinstance(x, (list, tuple)):
        items, was_list = list(x), True
    else:
        items, was_list = [x], False
    for item in items:
        if not check(item):
            raise TypeError(
                f"amp.initialize expects {kind} or a list of them; got"
                f" {type(item).__name__}.")
    return items, was_list


def initialize(models: Any, optimizers: Any = None, opt_level: str = "O1",
               num_losses: int = 1, *, cast_model_type: Any = None,
               keep_batchnorm_fp32: Any = None, master_weights: Any = None,
               loss_scale: Any = None, min_loss_scale: Any = None,
               max_loss_scale: Any = 2.0**24, low_dtype: Any = None,
               enabled: bool = True, verbosity: int = 1) -> Any:
    """Prepares models and optimizers for mixed precision at an apex opt level.

    Args:
        models: a module (torch or MegEngine) or a list of them, in float32.
        optimizers: an optimizer or a list of them over those models' parameters, or
            None for inference.
        opt_level: "O0" (float32), "O1" (autocast), "O2" (low-precision weights, float32
            master weights) or "O3" (everything low). docs/APEX.md has the details.
        num_losses: how many loss scales to keep; ``scale_loss(..., loss_id=k)``
            uses the k-th.
        cast_model_type, keep_batchnorm_fp32, master_weights, loss_scale: apex's
            overrides of the opt level's properties (None keeps the level's value).
        min_loss_scale, max_loss_scale: bounds of a dynamic loss scale.
        low_dtype: "float16" or "bfloat16"; None picks the device's, as
            ``amp.autocast(dtype=None)`` does.
        enabled: False returns the models and optimizers untouched, and ``scale_loss``
            passes the loss through.
        verbosity: accepted for apex compatibility; unified_amp prints nothing.

    Returns:
        The models and optimizers, in the shapes they were given (the same objects,
        changed in place); only the models when ``optimizers`` is None.

    Raises:
        TypeError, ValueError: a bad argument or an impossible combination of them.
        UnsupportedPrecisionError: a precision the backend cannot compute here.
        RuntimeError: a model or optimizer went through ``initialize`` already.
    """
    backend = get_backend()
    model_list, models_was_list = _as_list(models, f"a {backend.name} module",
                                           backend.is_module)
    opt_list: list[Any]
    if optimizers is None:
        opt_list, opts_was_list = [], False
    else:
        opt_list, opts_was_list = _as_list(optimizers, "an optimizer", is_optimizer)
    if isinstance(num_losses, bool) or not isinstance(num_losses, int):
        raise TypeError(f"amp.initialize num_losses must be an int; got {num_losses!r}.")
    if num_losses < 1:
        raise ValueError(f"amp.initialize num_losses must be >= 1; got {num_losses!r}.")
    if not isinstance(enabled, bool):
        raise TypeError(f"amp.initialize enabled must be a bool; got {enabled!r}.")

    def result() -> Any:
        m = (type(models)(model_list) if isinstance(models, tuple) else model_list) \
            if models_was_list else model_list[0]
        if optimizers is None:
            return m
        o = (type(optimizers)(opt_list) if isinstance(optimizers, tuple) else opt_list) \
            if opts_was_list else opt_list[0]
        return m, o

    _patch.check_fresh(model_list, opt_list)
    if not enabled:
        _latest_initialize.remember(_AmpState(None, num_losses), model_list + opt_list)
        return result()

    require(backend, OptLevelCasting, "amp.initialize")
    params = [p for m in model_list for p in m.parameters()]
    for p in params:
        name = backend.dtype_name(p.dtype)
        if name in LOW_PRECISION or name == "float64":
            raise ValueError(
                f"amp.initialize expects float32 models; got a {name} parameter of shape"
                f" {tuple(p.shape)}. Pass the float32 model: initialize casts it for the"
                f" opt level (there is no need to call .half() first).")
    device = backend.device_type(params[0]) if params else None
    props = resolve_properties(
        backend, opt_level, device=device, optimizers=opt_list,
        cast_model_type=cast_model_type, keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights, loss_scale=loss_scale,
        min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale, low_dtype=low_dtype)
    state = _AmpState(props, num_losses)
    state.set_models(model_list)
    _patch.prepare(state, model_list, opt_list)
    _latest_initialize.remember(state, model_list + opt_list)
    return result()


def _weak(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weakly referenceable: held (it then keeps the state alive)
        return lambda: obj


# -- scale_loss -------------------------------------------------------------------------
@contextlib.contextmanager
def scale_loss(loss: Any, optimizers: Any, loss_id: int = 0,
               delay_unscale: bool = False) -> Iterator[Any]:
    """Yields the loss times loss scale ``loss_id``; on exit, unscales and checks the
    gradients of ``optimizers``' parameters and updates that scale.

    ``scaled_loss.backward()`` (torch) or ``gm.backward(scaled_loss)`` (either
    framework) goes inside the block; ``optimizer.step()`` after it. On an overflow
    the gradients are dropped, the next ``step()`` of each of ``optimizers`` is skipped
    (parameters and master weights stay bit for bit), and only this loss's scale backs
    off.

    Args:
        loss: the loss tensor (cast to float32 before scaling).
        optimizers: the optimizer, or list of them, whose parameters this backward pass
            fills, as returned by ``amp.initialize``.
        loss_id: which of the ``num_losses`` scales to use.
        delay_unscale: leave the gradients scaled, to accumulate more backward passes
            with the same ``loss_id``; the last pass before ``step()`` must not delay.

    Each optimizer keeps the loss scalers of the ``initialize`` call that prepared it,
    so models initialized separately (at different opt levels, say) train side by side.

    Raises:
        RuntimeError: an optimizer ``initialize`` did not prepare; optimizers from two
            ``initialize`` calls in one pass; a pass that mixes gradients scaled by two
            different loss_ids.
        ValueError: ``loss_id`` out of range.
    """
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    latest_state = latest()
    if latest_state is not None and latest_state.props is None and not any(
            _patch.info_of(o) for o in opts):
        yield loss  # initialize(enabled=False)
        return
    state = _patch.state_of(opts, latest_state)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int):
        raise TypeError(f"amp.scale_loss loss_id must be an int; got {loss_id!r}.")
    if not 0 <= loss_id < len(state.scalers):
        raise ValueError(
            f"amp.scale_loss loss_id={loss_id} is out of range: amp.initialize was called"
            f" with num_losses={len(state.scalers)}, so loss_id must be in"
            f" 0..{len(state.scalers) - 1}.")
    # state_of() above raised for any optimizer initialize() did not prepare.
    infos = [info for opt in opts if (info := _patch.info_of(opt)) is not None]
    backend = state.backend
    scaler = state.scalers[loss_id]
    if not state.props.scales_loss:
        yield backend.cast(loss, "float32")
        return
    what = f"amp.scale_loss(loss, ..., loss_id={loss_id})"
    for info in infos:
        _stale.refuse(info, what)
    for info in infos:
        info.begin_pass(loss_id)
    # the others' gradients before the backward, to see which of them it scales
    others = _stale.snapshot([i for i in state.infos if all(i is not k for k in infos)])
    try:
        yield scaler.scale(backend.cast(loss, "float32"))
    except BaseException:
        for info in infos:
            info.abort_pass()
        raise
    _stale.note_block(others, loss_id)
    if delay_unscale:
        for info in infos:
            info.scaled_by = loss_id
        return
    targets: list[Any] = []
    for info in infos:
        targets.extend(info.collect_grads())
    scaler.unscale(targets)  # one fused check over every optimizer: one host sync
    scaler.update()
    state.clamp(scaler)
    overflow = scaler.stats()["last_step_skipped"]
    for info in infos:
        info.end_pass(overflow)


# -- the rest of apex's surface -----------------------------------------------------------
def master_params(optimizer: Any) -> Iterator[Any]:
    """The parameters ``optimizer`` steps: the float32 master weights where the opt level
    keeps them (O2), else the model's own. Clip these after ``scale_loss``'s block."""
    if not is_optimizer(optimizer):
        raise TypeError(f"amp.master_params expects an optimizer; got"
                        f" {type(optimizer).__name__}.")
    for group in optimizer.param_groups:
        yield from group["params"]


def loss_scaler(loss_id: int = 0) -> GradScaler:
    """The GradScaler behind ``loss_id`` (for ``stats()``, ``get_scale()``)."""
    state = _current("loss_scaler()")
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not (
            0 <= loss_id < len(state.scalers)):
        raise ValueError(f"amp.loss_scaler loss_id must be in 0..{len(state.scalers) - 1};"
                         f" got {loss_id!r}.")
    return state.scalers[loss_id]


def opt_properties() -> OptProperties | None:
    """The properties the last ``initialize`` resolved (after overrides and backend
    limits); None after ``initialize(enabled=False)``."""
    return _current("opt_properties()").props


def state_dict() -> dict[str, dict[str, Any]]:
    """Every loss scale of the latest ``initialize``, as ``{"loss_scaler0":
    GradScaler.state_dict(), ...}``: plain Python numbers, loadable on either backend."""
    state = _current("state_dict()")
    return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(state.scalers)}


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Loads ``amp.state_dict()``'s output, or apex's (``{"loss_scaler0": {"loss_scale":
    ..., "unskipped": ...}}``), into the loss scalers of the last ``initialize``.

    Raises:
        ValueError: a different number of loss scalers, or a malformed entry (nothing
            is loaded then).
    """
    state = _current("load_state_dict()")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"amp.load_state_dict expects a dict from amp.state_dict(); got"
                        f" {type(state_dict).__name__}.")
    want = [f"loss_scaler{i}" for i in range(len(state.scalers))]
    if sorted(state_dict) != sorted(want):
        raise ValueError(
            f"amp.load_state_dict got the entries {sorted(state_dict)}, but"
            f" amp.initialize was called with num_losses={len(state.scalers)}, which"
            f" expects {want}.")
    entries = []
    for key, scaler in zip(want, state.scalers):
        entry = state_dict[key]
        if isinstance(entry, Mapping) and "loss_scale" in entry:  # apex's format
            entry = {"scale": entry["loss_scale"],
                     "growth_factor": scaler.get_growth_factor(),
                     "backoff_factor": scaler.get_backoff_factor(),
                     "growth_interval": scaler.get_growth_interval(),
                     "_growth_tracker": entry.get("unskipped", 0)}
        entries.append(entry)
    # Check every entry on a scratch scaler first, so a bad one loads nothing.
    for key, entry, scaler in zip(want, entries, state.scalers):
        if scaler.is_enabled():
            try:
                GradScaler().load_state_dict(entry)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"amp.load_state_dict: entry {key!r}: {exc}") from None
    for entry, scaler in zip(entries, state.scalers):
        scaler.load_state_dict(entry)
