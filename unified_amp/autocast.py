"""``autocast``: one context manager / decorator over both frameworks' mixed precision."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, TypeVar, cast, overload

from .interface import LOW_PRECISION
from ._registry import get_backend

__all__ = ["autocast", "is_autocast_enabled"]

_F = TypeVar("_F", bound=Callable[..., Any])

_DEVICES = ("cpu", "cuda")
_ALIASES = {"float16": "float16", "half": "float16", "fp16": "float16",
            "bfloat16": "bfloat16", "bf16": "bfloat16"}

# The call forms users bring with them (see autocast's docstring), as signatures to bind.
def _unified_form(enabled: bool = True, dtype: Any = None, *, device: Any = None,
                  contract: bool = True, low_prec_dtype: Any = None,
                  high_prec_dtype: Any = "float32", cache_enabled: bool | None = None) -> None:
    pass


def _torch_form(device_type: str, dtype: Any = None, enabled: bool = True,
                cache_enabled: bool | None = None, *, contract: bool = True) -> None:
    pass


_UNIFIED_SIG = inspect.signature(_unified_form)
_TORCH_SIG = inspect.signature(_torch_form)


def _normalize_dtype(dtype: Any, argname: str = "dtype") -> str | None:
    """'float16' / 'bfloat16' / None from a string or a framework dtype object."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.strip().lower())
    else:
        # A framework dtype object (torch.float16, numpy.float16, ...): the user already
        # imported the framework, so asking the adapter costs nothing.
        name = get_backend().dtype_name(dtype)
        name = name if name in LOW_PRECISION else None
    if name is None:
        raise ValueError(
            f"autocast {argname} must be 'float16' or 'bfloat16' (or the framework's dtype"
            f" object for one of them); got {dtype!r}. For full float32 precision use"
            f" autocast(enabled=False)."
        )
    return name


def _normalize_device(device: Any) -> str | None:
    if device is None:
        return None
    # torch spells devices "cuda:0", MegEngine "gpu0", "cpu0", "xpux" (its default).
    match = re.fullmatch(r"(cpu|cuda|gpu|xpu)(\d+|x)?(:\d+)?", str(device).strip().lower())
    if match is None:
        hint = ""
        if isinstance(device, str) and device.strip().lower() in _ALIASES:
            hint = (f" {device!r} is a dtype: the first positional argument of autocast is"
                    f" torch's device_type; write autocast(dtype={device!r}).")
        raise ValueError(
            f"autocast device must be 'cpu', 'cuda' or None (every device); got"
            f" {device!r}.{hint}"
        )
    return {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "xpu": None}[match.group(1)]


def _bind(args: tuple, kwargs: dict) -> tuple[bool, dict[str, Any]]:
    torch_form = (bool(args) and isinstance(args[0], str)) or "device_type" in kwargs
    try:
        bound = (_TORCH_SIG if torch_form else _UNIFIED_SIG).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"autocast(): {exc}. Its call forms: autocast(enabled=True, dtype=None, *,"
            f" device=None, contract=True), torch's autocast(device_type, dtype=None,"
            f" enabled=True, cache_enabled=None) and megengine.amp's"
            f" autocast(enabled=True, low_prec_dtype=..., high_prec_dtype='float32')."
        ) from None
    bound.apply_defaults()
    return torch_form, dict(bound.arguments)


class autocast:
    """Runs the enclosed region in mixed precision, on the active backend.

    Call forms (all equivalent in effect)::

        amp.autocast()                                  # unified: enabled, dtype=None
        amp.autocast(dtype="bfloat16", device="cpu")
        amp.autocast("cuda", dtype=torch.float16)       # as torch.autocast
        amp.autocast(True, low_prec_dtype="float16")    # as megengine.amp.autocast

    Args:
        enabled: False turns autocast *off* inside the block, also when nested in an
            enabled block.
        dtype: "float16" or "bfloat16" (or a framework dtype object). None picks the
            device's fast low precision: float16 on CUDA; on CPU bfloat16 where the
            backend computes it (torch) and float16 otherwise (MegEngine).
        device: "cpu", "cuda" or None for every device the tensors may live on.
        contract: True (default) applies unified_amp's dtype contract, the same op
            dtypes on both backends (docs/DTYPE_CONTRACT.md). False runs each
            framework's own autocast op lists unchanged, so that a loop that also
            swapped ``torch.autocast``/``megengine.amp.autocast`` for this one
            reproduces a native run bit for bit.

    Raises:
        ValueError: a dtype or device that is not one of the above (on construction).
        UnsupportedPrecisionError: on entering the block, if the framework cannot
            compute ``dtype`` on that device (e.g. bfloat16 on MegEngine's CPU build).
    """

    # What inspect.signature(autocast) shows; the overloads below are for type checkers.
    __signature__ = _UNIFIED_SIG

    @overload
    def __init__(self, enabled: bool = True, dtype: Any = None, *, device: Any = None,
                 contract: bool = True, low_prec_dtype: Any = None,
                 high_prec_dtype: Any = "float32", cache_enabled: bool | None = None
                 ) -> None: ...

    @overload
    def __init__(self, device_type: str, dtype: Any = None, enabled: bool = True,
                 cache_enabled: bool | None = None, *, contract: bool = True) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torch_form, a = _bind(args, kwargs)
        if torch_form:  # torch.autocast(device_type, dtype, enabled, cache_enabled)
            enabled, dtype, device = a["enabled"], a["dtype"], a["device_type"]
        else:
            enabled, device = a["enabled"], a["device"]
            if a["dtype"] is not None and a["low_prec_dtype"] is not None:
                raise TypeError(
                    "autocast got both dtype and low_prec_dtype (its MegEngine spelling);"
                    " pass only one."
                )
            dtype = a["dtype"] if a["dtype"] is not None else a["low_prec_dtype"]
            if a["high_prec_dtype"] not in ("float32", None):
                raise ValueError(
                    f"autocast high_prec_dtype must be 'float32' (the only high precision"
                    f" both frameworks compute); got {a['high_prec_dtype']!r}."
                )
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast enabled must be a bool; got {enabled!r}.")
        if not isinstance(a["contract"], bool):
            raise TypeError(f"autocast contract must be a bool; got {a['contract']!r}.")
        self.enabled = enabled
        self.dtype = _normalize_dtype(dtype)
        self.device = _normalize_device(device)
        self.contract = a["contract"]
        self._tokens: list[Any] = []  # a stack, so one instance may be entered re-entrantly

    def __enter__(self) -> "autocast":
        backend = get_backend()
        if self.enabled:
            backend.check_precision(self.dtype, self.device)
        token = backend.enter_autocast(self.enabled, self.dtype, self.device, self.contract)
        self._tokens.append((backend, token))
        return self

    def __exit__(self, *exc: Any) -> None:
        backend, token = self._tokens.pop()
        backend.exit_autocast(token)

    def __call__(self, func: _F) -> _F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # A twin made per call rather than `with self`: torch.compile traces only a
            # context manager made inside the function it compiles.
            with autocast(self.enabled, self.dtype, device=self.device,
                          contract=self.contract):
                return func(*args, **kwargs)

        return cast(_F, wrapper)

    def __repr__(self) -> str:
        return (f"autocast(enabled={self.enabled}, dtype={self.dtype!r}, device={self.device!r},"
                f" contract={self.contract})")


def is_autocast_enabled() -> bool:
    """Whether autocast is on in the calling thread (on any device) for the active backend."""
    return get_backend().is_autocast_enabled()
