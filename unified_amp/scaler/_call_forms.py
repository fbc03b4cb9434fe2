"""GradScaler's constructor call forms: unified_amp's (megengine.amp's positional
``init_scale``) and torch.amp's (``device`` first), told apart by the first argument."""

from __future__ import annotations

import inspect
from typing import Any


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


UNIFIED_SIG = inspect.signature(_unified_form)
TORCH_SIG = inspect.signature(_torch_form)
_CALL_FORMS = ("GradScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,"
               " growth_interval=2000, enabled=True, *, device=None, process_group=None)"
               " or torch.amp's GradScaler(device, init_scale, ...)")


def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The constructor's arguments, in either native's call form, with defaults."""
    torch_form = bool(args) and isinstance(args[0], str)
    try:
        bound = (TORCH_SIG if torch_form else UNIFIED_SIG).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"GradScaler(): {exc}. Its call forms: {_CALL_FORMS}.") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def device_of_call(args: tuple, kwargs: dict) -> str | None:
    device = args[0] if args and isinstance(args[0], str) else kwargs.get("device")
    return None if device is None else str(device)
