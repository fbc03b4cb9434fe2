"""``autocast``: one context manager / decorator over both frameworks' mixed precision."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar, cast, overload

from . import rules as _rules
from .interface import LOW_PRECISION
from ._registry import get_backend, ready_backend

__all__ = ["autocast", "is_autocast_enabled"]

_F = TypeVar("_F", bound=Callable[..., Any])

_DEVICES = ("cpu", "cuda")
# The exact spellings dtype= takes as a string, on every backend: the dtypes' own names
# and the documented short forms. No case folding and no blanks, as neither framework's
# own dtype names fold them: "FP16" or "float16 " is a typo, refused the same everywhere.
_ALIASES = {"float16": "float16", "half": "float16", "fp16": "float16",
            "bfloat16": "bfloat16", "bf16": "bfloat16"}
_SPELLINGS = ", ".join(map(repr, _ALIASES))

# The call forms users bring with them (see autocast's docstring). Python binds the
# arguments (fast, and traced by dynamo as plain calls, where inspect.Signature.bind was
# traced line by line); the signatures are also what inspect.signature(autocast) shows.
def _unified_form(enabled: bool = True, dtype: Any = None, *, device: Any = None,
                  contract: bool = True, low_prec_dtype: Any = None,
                  high_prec_dtype: Any = "float32", cache_enabled: bool | None = None,
                  rules: Any = None) -> tuple[bool, Any, Any, bool, Any, Any, Any]:
    return enabled, dtype, device, contract, low_prec_dtype, high_prec_dtype, rules


def _torch_form(device_type: str, dtype: Any = None, enabled: bool = True,
                cache_enabled: bool | None = None, *, contract: bool = True,
                rules: Any = None) -> tuple[bool, Any, Any, bool, Any, Any, Any]:
    return enabled, dtype, device_type, contract, None, "float32", rules


_UNIFIED_SIG = inspect.signature(_unified_form).replace(return_annotation=inspect.Signature.empty)


def _normalize_dtype(dtype: Any, argname: str = "dtype") -> str | None:
    """'float16' / 'bfloat16' / None from an exact string, a framework dtype object or a
    NumPy dtype (or scalar type), the same spellings on every backend."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype)
    else:
        # A framework dtype object (torch.float16, MegEngine's bfloat16, ...): the user
        # already imported the framework, so asking the adapter costs nothing. A NumPy
        # one is named by NumPy, so np.float16 means the same on every backend.
        name = get_backend().dtype_name(dtype)
        if name is None:
            name = _numpy_dtype_name(dtype)
        name = name if name in LOW_PRECISION else None
    if name is None:
        raise ValueError(
            f"autocast {argname} must be one of {_SPELLINGS} (exactly: no capitals, no"
            f" blanks), numpy.float16, or the framework's dtype object for float16 or"
            f" bfloat16; got {dtype!r}. For full float32 precision use"
            f" autocast(enabled=False)."
        )
    return name


def _numpy_dtype_name(dtype: Any) -> str | None:
    """NumPy's name for a NumPy dtype or scalar type (``np.float16``), else None; NumPy
    is imported only when the value is NumPy's (then it is imported already)."""
    module = getattr(dtype, "__module__", None) or type(dtype).__module__
    if str(module).partition(".")[0] != "numpy":
        return None
    import numpy

    try:
        return str(numpy.dtype(dtype).name)
    except TypeError:
        return None


# torch spells devices "cuda:0", MegEngine "gpu0", "cpu0", "xpux" (its default).
_DEVICE_KINDS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "xpu": None}


def _device_kind(text: str) -> str | None | bool:
    """"cpu" / "cuda" / None (every device) for a device spelling, False if it is none.

    String methods only: a regular expression would be compiled inside dynamo's trace
    on a cache miss, which some torch versions cannot trace.
    """
    name, colon, index = text.partition(":")
    if colon and not (index.isdigit() and index.isascii()):
        return False
    kind = name.rstrip("0123456789")
    number = name[len(kind):]
    if not number and kind.endswith("x") and kind[:-1] in _DEVICE_KINDS:
        kind, number = kind[:-1], "x"  # MegEngine's "xpux", "cpux", "gpux"
    if kind not in _DEVICE_KINDS:
        return False
    return _DEVICE_KINDS[kind]


def _normalize_device(device: Any) -> str | None:
    if device is None:
        return None
    kind = _device_kind(str(device).strip().lower())
    if kind is False:
        hint = ""
        if isinstance(device, str) and device.strip().lower() in _ALIASES:
            hint = (f" {device!r} is a dtype: the first positional argument of autocast is"
                    f" torch's device_type; write autocast(dtype={device!r}).")
        raise ValueError(
            f"autocast device must be 'cpu', 'cuda' or None (every device); got"
            f" {device!r}.{hint}"
        )
    return kind  # type: ignore[return-value]


def _bind(args: tuple, kwargs: dict) -> tuple[bool, Any, Any, bool, Any, Any, Any]:
    torch_form = (bool(args) and isinstance(args[0], str)) or "device_type" in kwargs
    try:
        return (_torch_form if torch_form else _unified_form)(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"autocast(): {exc}. Its call forms: autocast(enabled=True, dtype=None, *,"
            f" device=None, contract=True, rules=None), torch's autocast(device_type, dtype=None,"
            f" enabled=True, cache_enabled=None) and megengine.amp's"
            f" autocast(enabled=True, low_prec_dtype=..., high_prec_dtype='float32')."
        ) from None


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
        device: "cpu", "cuda" or None: the device the backend puts work on (on torch,
            CUDA where torch sees a GPU, else the CPU; a disabled block: every device).
        contract: True (default) applies unified_amp's dtype contract, the same op
            dtypes on both backends (docs/DTYPE_CONTRACT.md). False runs each
            framework's own autocast op lists unchanged, so that a loop that also
            swapped ``torch.autocast``/``megengine.amp.autocast`` for this one
            reproduces a native run bit for bit.
        rules: this block's own rules over the contract's, ``{op: kind}``: the op a
            row name (``"softmax"``), a framework function, a ``torch.library``
            custom op or a function of yours; the kind one of "low", "float32",
            "promote", "input", "refuse". Nested blocks merge them, the inner block
            winning (docs/API.md, "Your own rules").

    Raises:
        ValueError: a dtype, device or rule kind that is not one of the above, or
            rules with ``contract=False`` (on construction).
        TypeError: a rule whose key is no op (on construction).
        UnsupportedPrecisionError: on entering the block, if the framework cannot
            compute ``dtype`` on that device (e.g. bfloat16 on MegEngine's CPU build).
    """

    # What inspect.signature(autocast) shows; the overloads below are for type checkers.
    __signature__ = _UNIFIED_SIG

    @overload
    def __new__(cls, enabled: bool = True, dtype: Any = None, *, device: Any = None,
                contract: bool = True, low_prec_dtype: Any = None,
                high_prec_dtype: Any = "float32", cache_enabled: bool | None = None,
                rules: Any = None) -> "autocast": ...

    @overload
    def __new__(cls, device_type: str, dtype: Any = None, enabled: bool = True,
                cache_enabled: bool | None = None, *, contract: bool = True,
                rules: Any = None) -> "autocast": ...

    def __new__(cls, *args: Any, **kwargs: Any) -> "autocast":
        self = super().__new__(cls)
        self._configure(*args, **kwargs)
        # A backend may stand its own context manager in for the block (torch does while
        # dynamo traces a block that is exactly one torch.autocast: dynamo splits the
        # graph at a break inside that, and at none inside a class of ours). Making a
        # block loads no framework: only an adapter whose framework is imported already
        # is asked (and loaded, so that it may tell the framework's compiler about
        # blocks made before anything is compiled).
        backend = ready_backend()
        if backend is None:
            return self
        if self.rules:
            backend.prepare_rules(self.rules)
            return self
        native = backend.native_autocast(self.enabled, self.dtype, self.device, self.contract)
        if native is None:
            return self
        if self.enabled:
            backend.check_precision(self.dtype, self.device)
        return cast("autocast", native)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # __new__ did the work: it may return another object than this class's

    def _configure(self, *args: Any, **kwargs: Any) -> None:
        enabled, dtype, device, contract, low_prec_dtype, high_prec_dtype, rules = \
            _bind(args, kwargs)
        if low_prec_dtype is not None:
            if dtype is not None:
                raise TypeError(
                    "autocast got both dtype and low_prec_dtype (its MegEngine spelling);"
                    " pass only one."
                )
            dtype = low_prec_dtype
        if high_prec_dtype not in ("float32", None):
            raise ValueError(
                f"autocast high_prec_dtype must be 'float32' (the only high precision"
                f" both frameworks compute); got {high_prec_dtype!r}."
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast enabled must be a bool; got {enabled!r}.")
        if not isinstance(contract, bool):
            raise TypeError(f"autocast contract must be a bool; got {contract!r}.")
        self.enabled = enabled
        self.dtype = _normalize_dtype(dtype)
        self.device = _normalize_device(device)
        self.contract = contract
        self.rules = _rules.check(rules)
        if self.rules and not contract:
            raise ValueError(
                "autocast rules change the dtype contract's rules, and contract=False"
                " runs the framework's own op lists, which no rule changes: drop"
                " contract=False, or the rules.")
        self._tokens: list[Any] = []  # a stack, so one instance may be entered re-entrantly

    def __enter__(self) -> "autocast":
        backend = get_backend()
        if self.enabled:
            backend.check_precision(self.dtype, self.device)
        token = backend.enter_autocast(self.enabled, self.dtype, self.device, self.contract,
                                       self.rules)
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
                          contract=self.contract, rules=dict(self.rules) or None):
                return func(*args, **kwargs)

        return cast(_F, wrapper)

    def __repr__(self) -> str:
        rules = ", rules={" + ", ".join(f"{_rules.describe(k)}: {v!r}" for k, v in self.rules) \
            + "}" if self.rules else ""
        return (f"autocast(enabled={self.enabled}, dtype={self.dtype!r}, device={self.device!r},"
                f" contract={self.contract}{rules})")


def is_autocast_enabled() -> bool:
    """Whether autocast is on in the calling thread (on any device) for the active backend."""
    return get_backend().is_autocast_enabled()
