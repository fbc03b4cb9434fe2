"""``AdapterView``: the members of a GradScaler's state an adapter may read."""

from __future__ import annotations

from typing import Any

from ._iteration import Check
from ._ledger import by_grad
from ..capabilities import DeviceScale

__all__ = ["AdapterView"]


class AdapterView:
    """What an adapter's GradScaler subclass may read of the core's state (the torch
    adapter's ``TorchGradScaler`` derives torch.amp's private attributes from it), and
    nothing else: ``scaler.adapter_view``. Members:

    - ``enabled``, ``device`` (the constructor's, or None), ``device_scale`` (the
      adapter's :class:`~unified_amp.interface.DeviceScale` once a fused optimizer
      stepped, else None);
    - ``host_scale()``: (scale, growth tracker) as the host holds them, no sync (in
      device mode, as last read back); ``synced_scale()``: the same after reading the
      device values back (a sync in device mode, as ``get_scale()``);
    - ``stages()``: per optimizer (keyed by ``id()``) in this iteration, its stage
      ("READY", "UNSCALED" or "STEPPED", torch.amp's names) and the checks behind it;
      ``checks_of(optimizer)``: those checks. A check's ``flag`` (a device flag or
      None), ``found`` (True, False, or None while unread) and ``ready()`` (the flag,
      once any all-reduce of it finished) are the declared members of a check;
    - ``check_only(optimizer)``: checks the optimizer's gradients without unscaling
      them (torch's older ``step(grad_scaler=...)`` contract: the optimizer unscales),
      recorded for that optimizer and counted by the next ``update()``;
    - ``step_deferred(step, optimizer, args, kwargs)``: runs ``step`` (the scaler's
      ``step``, or any call that may reach it) with the optimizer's own ``step()`` taken
      out, and returns ``(the call to make, or None; step's result)``: what the scaler
      would have called, for the adapter to call where its compiler can follow it.
    """

    __slots__ = ("_machine",)

    def __init__(self, machine: Any) -> None:  # a GradScaler's ScalerMachine
        self._machine = machine

    @property
    def enabled(self) -> bool:
        return self._machine.enabled

    @property
    def device(self) -> str | None:
        return self._machine.device

    @property
    def device_scale(self) -> DeviceScale | None:
        return self._machine.scale_state.device_scale

    def host_scale(self) -> tuple[float, int]:
        scale_state = self._machine.scale_state
        return scale_state.scale, scale_state.growth_tracker

    def synced_scale(self) -> tuple[float, int]:
        self._machine.scale_state.sync_from_device()
        return self.host_scale()

    def stages(self) -> dict[int, tuple[str, list[Check]]]:
        return {key: (stage.stage.name, list(stage.checks))
                for key, stage in self._machine.iteration.optimizers.items()}

    def checks_of(self, optimizer: Any) -> list[Check]:
        stage = self._machine.iteration.optimizers.get(id(optimizer))
        return [] if stage is None else list(stage.checks)

    def step_deferred(self, step: Any, optimizer: Any, args: tuple, kwargs: dict
                      ) -> tuple[tuple[Any, tuple, dict] | None, Any]:
        machine = self._machine
        machine.defer_optimizer_step, machine.deferred_step = True, None
        try:
            result = step(optimizer, *args, **kwargs)
            return machine.deferred_step, result
        finally:
            machine.defer_optimizer_step, machine.deferred_step = False, None

    def check_only(self, optimizer: Any) -> Check:
        machine = self._machine
        params = [p for g in optimizer.param_groups for p in g["params"]]
        check = machine.check(by_grad(params), None, read=False)
        if check is None:  # no gradient here, and no other rank to join
            check = Check(None, False)
            machine.iteration.add(check)
        machine.iteration.optimizers[id(optimizer)].checks.append(check)
        return check
