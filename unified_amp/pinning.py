"""``amp.keep_float32``: run chosen modules in float32 inside a mixed-precision model.

The fix an overflow report points to: a layer whose float16 output overflows runs in
float32 while the rest of the model keeps autocast's dtypes.

    amp.keep_float32(model.encoder.layer3)

A pinned module's ``forward`` is replaced by a :class:`_Float32Forward`, an ordinary
picklable object stored on the module (not a bound method), so ``pickle``,
``copy.deepcopy`` and the frameworks' own ``save`` carry the pin with the model, and
``state_dict`` is unchanged. It runs the original forward under the public
``autocast(enabled=False)`` -- what makes it trace under ``torch.compile`` and
MegEngine's ``trace`` is autocast's own business -- with floating inputs cast to
float32. ``amp.initialize`` leaves the weights of pinned modules float32 (O2, O3);
pinning after it casts them back, and their master weights keep feeding them.
"""

from __future__ import annotations

from typing import Any

from . import _latest_initialize
from . import _foreign
from ._casting import _cast_tree
from .capabilities import OptLevelCasting, require
from .interface import LOW_PRECISION
from ._registry import get_backend
from .autocast import autocast

__all__ = ["keep_float32", "is_kept_float32"]

_ATTR = "_unified_amp_keep_float32"  # the module's _Float32Forward, pinned or not
# The keyword through which the pin's forward pre-hook hands the pin the module object
# being called (a DataParallel replica shares the original's pin; see _Float32Forward).
_CALLER = "_unified_amp_caller"


def _first_low_dtype(tree: Any, backend: Any) -> str | None:
    """The dtype of the first low-precision tensor in ``tree`` (lists, tuples, dicts)."""
    if backend.is_tensor(tree):
        name = backend.dtype_name(tree.dtype)
        return name if name in LOW_PRECISION else None
    items = tree.values() if isinstance(tree, dict) else (
        tree if isinstance(tree, (list, tuple)) else ())
    for item in items:
        found = _first_low_dtype(item, backend)
        if found is not None:
            return found
    return None


class _Float32Forward:
    """A pinned module's forward: floating inputs cast to float32, the module's own
    forward under ``autocast(enabled=False)``.

    The outputs stay float32 where autocast is on around the module (the next layers
    cast what they take, as autocast does). Where it is off and the inputs came in a
    low precision -- a model whose weights were cast, as at O3 -- they are cast back to
    that dtype, since the next layer's low-precision weights would refuse float32.

    The pin is the module's ``forward`` attribute, and attributes are not bound to the
    object they are read from: torch's DataParallel copies a module's attributes into
    each replica, pin included. So where the framework's forward pre-hooks can pass
    keyword arguments (torch), a pre-hook hands the pin the module actually called,
    and the pin runs that module's forward (a replica's weights on the replica's
    device) instead of the one it was made for.

    Attributes:
        module: the module it runs when no pre-hook says otherwise.
        inner: the instance-level forward it replaced (``amp.initialize``'s, a user's),
            or None for the class's own ``forward``.
        hook: the pre-hook's handle, or None where the framework has no such hooks.
        active: False after ``keep_float32(module, enabled=False)`` where the wrapper
            could not be taken off (something wrapped it since); then a pass-through.
        recast: the low dtype ``keep_float32`` cast this module's weights up from
            (pinned after ``amp.initialize`` at O2/O3), for unpinning; else None.
    """

    def __init__(self, module: Any, inner: Any) -> None:
        self.module = module
        self.inner = inner
        self.active = True
        self.recast: str | None = None
        self.hook: Any = None

    def pass_caller(self, module: Any, args: tuple, kwargs: dict) -> Any:
        """The forward pre-hook: the called module, while this pin is its forward
        (nothing wrapped it since, which might not take an extra keyword)."""
        # __dict__, not vars(): dynamo before torch 2.8 cannot trace vars() of a module
        if module.__dict__.get("forward") is not self:
            return None
        return args, {**kwargs, _CALLER: module}

    def _call_inner(self, module: Any, args: tuple, kwargs: dict) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = kwargs.pop(_CALLER, self.module)
        if not self.active:
            return self._call_inner(module, args, kwargs)
        backend = get_backend()
        back_to = None
        if not backend.is_autocast_enabled():
            back_to = _first_low_dtype((args, kwargs), backend)
        args = _cast_tree(args, "float32", backend, only_low=True)
        kwargs = _cast_tree(kwargs, "float32", backend, only_low=True)
        # A fresh block per call: an autocast instance keeps a stack of tokens, which
        # two threads running this module at once (DataParallel's replicas) would mix.
        with autocast(enabled=False):
            out = self._call_inner(module, args, kwargs)
        if back_to is not None:
            out = _cast_tree(out, back_to, backend, only_low=False)
        return out

    def __repr__(self) -> str:
        state = "pinned" if self.active else "inactive"
        return f"<keep_float32 forward of {type(self.module).__name__} ({state})>"


def _pin_of(module: Any) -> _Float32Forward | None:
    pin = getattr(module, _ATTR, None)
    return pin if isinstance(pin, _Float32Forward) else None


def is_kept_float32(module: Any) -> bool:
    """Whether ``module`` itself is pinned to float32 by :func:`keep_float32`."""
    pin = _pin_of(module)
    return pin is not None and pin.active


def pinned_modules(model: Any, backend: Any) -> list[Any]:
    """The pinned modules among ``model`` and its submodules (amp.initialize leaves
    their weights float32)."""
    return [m for _, m in backend.named_modules(model) if is_kept_float32(m)]


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def _low_params(module: Any, backend: Any) -> list[Any]:
    return [p for p in module.parameters()
            if backend.dtype_name(p.dtype) in LOW_PRECISION]


def _pin(module: Any, backend: Any) -> None:
    pin = _pin_of(module)
    if pin is not None:
        pin.active = True  # idempotent; also revives a pass-through left by unpinning
    else:
        pin = _Float32Forward(module, vars(module).get("forward"))
        setattr(module, _ATTR, pin)
        module.forward = pin
        # torch's modules; MegEngine's pre-hooks take no keyword arguments (and it has
        # no replicas), other modules may have no pre-hooks at all.
        register = getattr(module, "register_forward_pre_hook", None)
        try:
            pin.hook = None if register is None else register(pin.pass_caller,
                                                              with_kwargs=True)
        except TypeError:
            pin.hook = None
    low = _low_params(module, backend)
    if low:
        # Pinned after amp.initialize cast the weights (O2, O3): float32 again, the same
        # parameter objects. Where a master weight holds the exact value, it is used;
        # O2 copies the masters in after every step anyway.
        pin.recast = backend.dtype_name(low[0].dtype)
        casting = require(backend, OptLevelCasting,
                          f"amp.keep_float32 of a module with {pin.recast} weights")
        casting.cast_module(module, "float32", False)
        _refill_from_masters(module, casting)


def _refill_from_masters(module: Any, backend: Any) -> None:
    state = _latest_initialize.latest()
    master_of = getattr(state, "master_of", None) if state is not None else None
    if not master_of:
        return
    params = [p for p in module.parameters() if id(p) in master_of]
    if params:
        backend.copy_params(params, [master_of[id(p)] for p in params])


def _unpin(module: Any, backend: Any) -> None:
    pin = _pin_of(module)
    if pin is None:
        return
    if pin.recast is not None:
        require(backend, OptLevelCasting, "amp.keep_float32(..., enabled=False)"
                ).cast_module(module, pin.recast, True)
    if vars(module).get("forward") is pin:
        if pin.inner is None:
            del module.forward
        else:
            module.forward = pin.inner
        delattr(module, _ATTR)
        if pin.hook is not None:
            pin.hook.remove()
    else:
        pin.active = False  # wrapped since (e.g. by amp.initialize): a pass-through
        pin.recast = None


def keep_float32(*modules: Any, enabled: bool = True) -> Any:
    """Runs each module in float32 inside a mixed-precision model.

    Each module's forward runs with autocast off and its floating-point inputs cast to
    float32; its outputs stay float32 and the layers after it keep autocast's dtypes.
    The fix for a layer whose float16 output overflows (the overflow report names it)::

        amp.keep_float32(model.encoder.layer3)

    Works with ``amp.autocast``, the framework's own autocast and ``amp.initialize``
    (whose O2/O3 then leave the module's weights float32; pinned after ``initialize``,
    its low-precision weights are cast back to float32 and keep their master weights).
    The pin is stored on the module, so it survives ``pickle``/``copy.deepcopy`` of the
    model and leaves ``state_dict`` unchanged. Pinning a pinned module does nothing.

    Args:
        *modules: one or more modules of the active backend's framework.
        enabled: False takes the pin off again (weights this call cast to float32 go
            back to the dtype they had).

    Returns:
        The first module (so ``layer = amp.keep_float32(Layer(...))`` reads naturally).

    Raises:
        TypeError: an argument is not a module of the active framework (nothing is
            changed then), or ``enabled`` is not a bool.
    """
    backend = get_backend()
    if not isinstance(enabled, bool):
        raise TypeError(f"amp.keep_float32 enabled must be a bool; got {enabled!r}.")
    if not modules:
        raise TypeError("amp.keep_float32() needs at least one module, e.g."
                        " amp.keep_float32(model.encoder.layer3).")
    for i, module in enumerate(modules):
        if not backend.is_module(module):
            hint = ""
            if isinstance(module, (list, tuple)):
                hint = " Unpack a list of modules: amp.keep_float32(*layers)."
            elif backend.is_tensor(module) or hasattr(module, "__next__"):
                hint = " Pass the module, not its parameters or outputs."
            raise TypeError(
                f"amp.keep_float32 expects {backend.name} modules; argument {i} is a"
                f" {type(module).__name__}: {_describe(module)}."
                f"{hint or _foreign.hint(module, backend.name)}")
    for module in modules:
        (_pin if enabled else _unpin)(module, backend)
    return modules[0]
