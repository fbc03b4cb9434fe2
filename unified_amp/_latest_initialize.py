"""Which ``amp.initialize()`` call is the latest still alive: apex's module functions
(apex/opt_levels.py), the pins (pinning.py) and the function registries
(apex/cast_registry.py) ask. A leaf module below apex/ and pinning.py, so that none of
them imports another for it."""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__: list[str] = []

# apex's module functions (loss_scaler(), state_dict(), opt_properties(), ...) speak for
# the latest initialize() call. Its state belongs to the models and optimizers it was
# given: each holds it (weakly keyed here), and the latest is only pointed at weakly, so
# once they are gone it is as if initialize() had not been called. Two initialize()
# calls share nothing: each has its own _AmpState.
_held: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_latest: "Callable[[], Any]" = lambda: None


def remember(state: Any, objects: list[Any]) -> None:
    """Makes ``state`` the latest, kept alive by ``objects`` (the call's models and
    optimizers)."""
    global _latest
    held = False
    for obj in objects:
        try:
            _held[obj] = state
            held = True
        except TypeError:  # not weakly referenceable: then the latest is held strongly
            held = False
            break
    _latest = weakref.ref(state) if held else (lambda: state)


def latest() -> Any:
    """The latest call's ``opt_levels._AmpState``, or None once its models and
    optimizers are gone (or before any call)."""
    return _latest()
