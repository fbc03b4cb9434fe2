"""GradScaler's public surface beside the training loop: the scale under both natives'
names, telemetry (``stats``), overflow reports (``watch``, ``last_overflow``), the
hyper-parameters' getters and setters, checkpoints (``state_dict``) and pickling."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, TypeVar

from . import _tracing
from ._ledger import GradLedger
from ._scale_rule import check_factors, f32
from ._scaler_state import ScalerState
from ._scaler_forensics import Forensics
from .forensics import OverflowReport

__all__: list[str] = []

_S = TypeVar("_S", bound="ScalerSurface")

_STATE_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class ScalerSurface(ScalerState):
    """Inspection, settings, checkpoints and pickling of a GradScaler."""

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). No device sync,
        except after a fused optimizer moved the scale to the device (as torch.amp)."""
        if not self._enabled:
            return 1.0
        self._refuse_in_trace("GradScaler.get_scale() (or scale_factor)", "read")
        self._sync_from_device()
        return self._scale_value

    @property
    def scale_factor(self) -> float:
        """megengine.amp's name for the current scale; assignable.

        Reading it counts as handing the scale out (megengine.amp's manual mode passes
        it as ``dy`` to ``gm.backward``)."""
        self._refuse_in_trace("GradScaler.get_scale() (or scale_factor)", "read")
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
        # Inside a trace the values stay as of the last read (as_of_step says which).
        if self._enabled and self._dev is not None and _tracing.mode(self._be()) is None:
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
    def watch(self: _S, model: Any = None, *, warn_after: int = 10, warn_below: float = 1.0,
              history: int = 16) -> _S:
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
        check_factors(self._scale_value, new_factor, self._backoff_factor,
                       self._growth_interval)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        check_factors(self._scale_value, self._growth_factor, new_factor,
                       self._growth_interval)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        check_factors(self._scale_value, self._growth_factor, self._backoff_factor,
                       new_interval)
        self._growth_interval = new_interval

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.amp's keys, plain Python numbers, loadable by either backend; on
        MegEngine also "scale_factor", so megengine.amp's scaler can load it too.
        Empty when disabled (as torch.amp)."""
        if not self._enabled:
            return {}
        self._refuse_in_trace("GradScaler.state_dict()", "read")
        self._sync_from_device()
        aliases = self._be().scale_key_aliases
        return {
            "scale": self._scale_value,
            **{alias: self._scale_value for alias in aliases},
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
        self._refuse_in_trace("GradScaler.load_state_dict()", "write")
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
            check_factors(scale, state_dict["growth_factor"], state_dict["backoff_factor"],
                           state_dict["growth_interval"], scale_name="scale")
            if not isinstance(tracker, int) or isinstance(tracker, bool) or tracker < 0:
                raise ValueError(f"_growth_tracker must be an int >= 0; got {tracker!r}.")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"GradScaler state dict is malformed: {exc}") from None
        self._scale_value = f32(float(scale))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = state_dict["growth_interval"]
        self._tracker = tracker
        if self._dev is not None:
            self._dev.load(self._scale_value, tracker)
        self._mirror()

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
        state["_trace_copy"] = None  # remade at the next call outside a trace
        state["_ledger"] = GradLedger()  # it refers to live tensors
        state["_param_lists"] = None  # weak references do not pickle
        state["_caps_known"] = None  # asked again of the adapter after loading
        state["_forensics"] = None  # it refers to models; watch() again after loading
        state["_process_group"] = None  # a live communicator; give it again after loading
        state["_tail"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_trace_copy", None)  # pickled before traces were known
        self._param_lists = weakref.WeakKeyDictionary()
        if self.__dict__.get("_forensics") is None:
            self._forensics = Forensics(self, self._enabled)

    def __repr__(self) -> str:
        # Inside a trace the scale is on the device, and reading it is refused.
        traced = self._enabled and _tracing.mode(self._be()) is not None
        scale = "<on the device, in a trace>" if traced else self.get_scale()
        return (
            f"GradScaler(scale={scale}, growth_factor={self._growth_factor},"
            f" backoff_factor={self._backoff_factor},"
            f" growth_interval={self._growth_interval}, enabled={self._enabled})"
        )
