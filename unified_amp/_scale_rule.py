"""The loss-scale rule and the checks of GradScaler's numbers.

Pure Python, the same on every backend: ``next_scale`` is one ``update()`` in torch's
float32 arithmetic; ``check_factors`` and ``valid_scale`` reject a bad hyper-parameter
or scale with an error that names it. A leaf below the scaler (scaler/_state.py) and
the trace policy (_tracing.py), which both use the rule.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable

from .errors import ScalerArgumentError

__all__ = ["next_scale"]


def f32(x: float) -> float:
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
        return f32(scale * backoff_factor), 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = f32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_factors(init_scale: Any, growth_factor: Any, backoff_factor: Any,
                   growth_interval: Any, scale_name: str = "init_scale") -> None:
    """Raises TypeError / ValueError naming the first bad hyper-parameter."""
    for name, value in ((scale_name, init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor)):
        if not is_number(value):
            raise TypeError(f"GradScaler {name} must be a number; got {value!r}.")
    _positive_finite(init_scale, scale_name, " The usual start is 2.0**16.")
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ScalerArgumentError(
            f"GradScaler growth_factor must be > 1.0 (the scale is multiplied by it after"
            f" growth_interval clean steps); got {growth_factor!r}. The usual value is 2.0."
        )
    if not (0.0 < backoff_factor < 1.0):
        raise ScalerArgumentError(
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


def valid_scale(value: Any, what: str, backend: Callable[[], Any]) -> float:
    """``value`` (a number, or a 1-element tensor of ``backend()``, asked only for a
    non-number) as a float32 scale.

    Raises:
        TypeError: neither a number nor a 1-element tensor.
        ValueError: not positive and finite.
    """
    if not is_number(value):
        if backend().is_tensor(value) and numel(value) == 1:
            value = float(value.item())
        elif backend().is_tensor(value):
            raise ScalerArgumentError(
                f"GradScaler {what} must be a number or a 1-element tensor; got a tensor"
                f" of shape {tuple(value.shape)}. Pass float(t) or a 1-element tensor."
            )
        else:
            raise TypeError(
                f"GradScaler {what} must be a number or a 1-element tensor;"
                f" got {value!r}."
            )
    _positive_finite(value, what)
    return f32(float(value))


def _positive_finite(value: float, name: str, usual: str = "") -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"GradScaler {name} must be a positive finite number; got {value!r}.{usual}"
        )


def numel(t: Any) -> int:
    """The number of elements of a tensor of any framework (both spell ``shape``)."""
    n = 1
    for d in t.shape:
        n *= int(d)
    return n
