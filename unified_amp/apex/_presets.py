"""apex's opt levels as data: ``OptProperties``, the O0-O3 presets, and
``resolve_properties``, which applies ``amp.initialize``'s overrides and what the
adapter says the build can do (opt_levels.py runs the result)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..autocast import _normalize_dtype
from ..errors import UnsupportedPrecisionError
from ..interface import LOW_PRECISION

__all__ = ["OptProperties", "OPT_LEVELS", "resolve_properties"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")


@dataclass(frozen=True)
class OptProperties:
    """What an opt level does, after overrides and the backend's limits are applied.

    Attributes:
        opt_level: "O0" .. "O3".
        cast_model_type: the dtype the model's weights are cast to ("float16",
            "bfloat16"), "float32" (O0: checked, not cast), or None (O1: untouched).
        autocast: whether the model's forward runs under ``amp.autocast(low_dtype)``.
        keep_batchnorm_fp32: batch norm weights and statistics stay float32 when the
            model is cast (None when it is not).
        master_weights: float32 copies of the low-precision weights are what the
            optimizer steps.
        loss_scale: "dynamic" or a fixed number (1.0: no scaling).
        low_dtype: the low precision of this run ("float16" or "bfloat16").
        min_loss_scale, max_loss_scale: bounds of a dynamic scale.
    """

    opt_level: str
    cast_model_type: str | None
    autocast: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: str | float
    low_dtype: str
    min_loss_scale: float | None
    max_loss_scale: float

    @property
    def casts_model(self) -> bool:
        return self.cast_model_type in LOW_PRECISION

    @property
    def scales_loss(self) -> bool:
        """Whether scale_loss goes through a GradScaler. A fixed scale of 1.0 without
        master weights is a pass-through, as in apex."""
        return self.loss_scale == "dynamic" or self.loss_scale != 1.0 or self.master_weights


# apex's presets, in unified_amp's terms. "low" is resolved to low_dtype. O2 runs its
# forward under autocast, unlike apex: see docs/APEX.md ("What differs").
_PRESETS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type="float32", autocast=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, autocast=True, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale="dynamic"),
    "O2": dict(cast_model_type="low", autocast=True, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type="low", autocast=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}


# -- validating the arguments ---------------------------------------------------------
def _positive(value: Any, name: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"amp.initialize {name} must be a positive finite number; got"
                         f" {value!r}.")
    return float(value)


def _loss_scale(value: Any) -> str | float:
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    try:
        return _positive(value, "loss_scale")
    except ValueError:
        raise ValueError(
            f"amp.initialize loss_scale must be 'dynamic' or a positive finite number"
            f" (a number in a string, such as '128.0', is accepted); got {value!r}."
        ) from None


def _flag(value: Any, name: str) -> bool | None:
    """None, a bool, or apex's "True"/"False" strings."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise TypeError(f"amp.initialize {name} must be True, False, 'True', 'False' or None;"
                    f" got {value!r}.")


def _cast_type(value: Any, backend: Any) -> str | None:
    """None (leave the weights alone), "float32", "float16" or "bfloat16"."""
    if value is None or value is False:
        return None
    name = value.strip().lower() if isinstance(value, str) else backend.dtype_name(value)
    name = {"fp32": "float32", "float": "float32"}.get(name, name)
    if name == "float32":
        return "float32"
    try:
        return _normalize_dtype(value, "cast_model_type")
    except ValueError:
        raise ValueError(
            f"amp.initialize cast_model_type must be 'float16', 'bfloat16', 'float32',"
            f" None or the framework's dtype object for one of them; got {value!r}."
        ) from None


def resolve_properties(backend: Any, opt_level: Any, *, device: str | None,
                       optimizers: list[Any], cast_model_type: Any = None,
                       keep_batchnorm_fp32: Any = None, master_weights: Any = None,
                       loss_scale: Any = None, min_loss_scale: Any = None,
                       max_loss_scale: Any = 2.0**24, low_dtype: Any = None
                       ) -> OptProperties:
    """The preset of ``opt_level`` with the overrides applied, checked for combinations
    that cannot work here. Raises ValueError / TypeError / UnsupportedPrecisionError."""
    if opt_level not in _PRESETS:
        hint = " (the letter O, not zero)" if str(opt_level).startswith("0") else ""
        raise ValueError(f"amp.initialize opt_level must be one of {', '.join(OPT_LEVELS)}"
                         f"{hint}; got {opt_level!r}.")
    p = dict(_PRESETS[opt_level])
    low = _normalize_dtype(low_dtype, "low_dtype")
    cast = _cast_type(cast_model_type, backend)
    if cast in LOW_PRECISION:
        if low is not None and low != cast:
            raise ValueError(f"amp.initialize got cast_model_type={cast!r} and"
                             f" low_dtype={low!r}; they name the same low precision, so"
                             f" pass one of them (or the same dtype twice).")
        low = cast
    if low is None:
        low = backend.default_low_dtype(device or ("cuda" if backend.cuda_available()
                                                   else "cpu"))
    if cast_model_type is not None and cast_model_type is not False:
        if opt_level == "O1" and cast != "float32":
            raise ValueError(
                f"amp.initialize: O1 keeps the weights float32 and casts per op (autocast);"
                f" cast_model_type={cast_model_type!r} contradicts it. For low-precision"
                f" weights use opt_level='O2' (float32 master weights) or 'O3'.")
        p["cast_model_type"] = cast
    elif cast_model_type is False:
        p["cast_model_type"] = None
    if p["cast_model_type"] == "low":
        p["cast_model_type"] = low
    casts = p["cast_model_type"] in LOW_PRECISION

    keep_bn = _flag(keep_batchnorm_fp32, "keep_batchnorm_fp32")
    if keep_bn is not None:
        if not casts:
            raise ValueError(
                f"amp.initialize keep_batchnorm_fp32={keep_bn!r} applies only when the"
                f" model is cast to a low precision (O2, O3 or a low cast_model_type);"
                f" at {opt_level} with cast_model_type={p['cast_model_type']!r} leave it"
                f" None." + (" O1 runs batch norm in float32 by itself." if opt_level == "O1"
                             else ""))
        if keep_bn is False and not backend.low_precision_batch_norm(low):
            raise UnsupportedPrecisionError(
                f"amp.initialize keep_batchnorm_fp32=False: {backend.name} cannot run"
                f" batch norm with {low} weights on this build (MegEngine's CPU build"
                f" aborts the process). Leave keep_batchnorm_fp32 at None; batch norm then"
                f" stays float32 (docs/APEX.md).")
        p["keep_batchnorm_fp32"] = keep_bn
    if not casts:
        p["keep_batchnorm_fp32"] = None
    elif not p["keep_batchnorm_fp32"] and not backend.low_precision_batch_norm(low):
        p["keep_batchnorm_fp32"] = True  # O3's default where low batch norm cannot run

    masters = _flag(master_weights, "master_weights")
    if masters is not None:
        if masters and not casts:
            raise ValueError(
                f"amp.initialize master_weights=True needs a model cast to a low"
                f" precision (O2, O3 or a low cast_model_type); at {opt_level} the"
                f" weights are already float32" + (": O1 casts per op, not the weights."
                                                  if opt_level == "O1" else "."))
        p["master_weights"] = masters
    if casts and not p["master_weights"] and optimizers:
        cannot = [o for o in optimizers if not backend.steps_low_precision(o)]
        if cannot and masters is False:
            raise UnsupportedPrecisionError(
                f"amp.initialize master_weights=False: {type(cannot[0]).__name__} on"
                f" {backend.name} cannot update {low} parameters. Leave master_weights at"
                f" None (float32 master weights are then used) or use opt_level='O2'.")
        if cannot:
            p["master_weights"] = True  # O3 on a backend whose optimizers need float32

    if loss_scale is not None:
        p["loss_scale"] = _loss_scale(loss_scale)
    max_scale = _positive(max_loss_scale, "max_loss_scale")
    min_scale = None if min_loss_scale is None else _positive(min_loss_scale,
                                                               "min_loss_scale")
    if min_scale is not None and min_scale > max_scale:
        raise ValueError(f"amp.initialize min_loss_scale ({min_scale!r}) is above"
                         f" max_loss_scale ({max_scale!r}).")
    props = OptProperties(opt_level=opt_level, autocast=p["autocast"],
                          cast_model_type=p["cast_model_type"],
                          keep_batchnorm_fp32=p["keep_batchnorm_fp32"],
                          master_weights=p["master_weights"], loss_scale=p["loss_scale"],
                          low_dtype=low, min_loss_scale=min_scale, max_loss_scale=max_scale)
    if (props.scales_loss and props.cast_model_type == "float16"
            and not props.master_weights and optimizers):
        raise ValueError(
            f"amp.initialize at {opt_level} with loss_scale={props.loss_scale!r}: the"
            f" gradients of float16 weights would be float16, and unscaling them loses what"
            f" the scaling protected. Pass master_weights=True (float32 master weights),"
            f" or loss_scale=1.0.")
    if props.autocast or props.casts_model:
        backend.check_precision(low, device)
    return props
