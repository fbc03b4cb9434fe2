"""Autocasting: MegEngine's autocast state, switched per block, and the dtype contract
(dtype_contract.py) asked of its wrappers."""

from __future__ import annotations

from typing import Any

import megengine
from megengine.core._imperative_rt.core2 import _get_amp_low_prec_dtype
from megengine.core.tensor import amp as _amp_state

from unified_amp import interface
from unified_amp.errors import UnsupportedPrecisionError

from . import dtype_contract
from .basics import dtype_name
from .dtype_contract import restore_autocast, set_autocast


class Autocasting(interface.Autocasting):
    """Switching autocast on and off, and which precisions a device computes."""

    def check_precision(self, dtype: str | None, device: str | None) -> None:
        cuda = bool(megengine.is_cuda_available())
        if device == "cuda" and not cuda:
            raise UnsupportedPrecisionError(
                "autocast(device='cuda') was requested, but MegEngine sees no CUDA device"
                " (its CPU build, or no driver). Use device='cpu' or device=None."
            )
        # Where tensors land when no device is named: the default device, a GPU if any.
        on_cpu = device == "cpu" or (device is None and not cuda)
        if dtype == "bfloat16" and on_cpu:
            raise UnsupportedPrecisionError(
                "autocast dtype 'bfloat16' cannot run on MegEngine's CPU build: its"
                " matmul/conv kernels have no bfloat16 implementation and fail"
                " asynchronously. Use dtype='float16' (or None) with MegEngine on CPU."
            )

    def native_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                        contract: bool) -> Any:
        return None  # megengine.jit.trace replays what the block does; it needs no stand-in

    def prepare_rules(self, rules: tuple[tuple[Any, str], ...]) -> None:
        if rules:
            dtype_contract.install()
            dtype_contract.resolve_rules(rules)

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True, rules: tuple[tuple[Any, str], ...] = ()
                       ) -> Any:
        state = None
        if contract:
            # an enabled block keeps the contract; a disabled one inside an enabled one
            # promotes mixed inputs (dtype_contract.py)
            state = dtype_contract.CONTRACT if enabled else (
                dtype_contract.PROMOTE if _amp_state._enabled else None)
        if state is not None:
            # Installed by the first such block, not on load: a drop-in user who only
            # swaps GradScaler (or runs contract=False) keeps MegEngine's functions
            # untouched.
            dtype_contract.install()
        # the block's rules over the enclosing block's, in this thread; none where
        # autocast is off or the contract is
        own = dtype_contract.thread_rules
        merged: dict[Any, str] = {}
        if state == dtype_contract.CONTRACT:
            merged = own.rules
            if rules:
                merged = {**own.rules, **dtype_contract.resolve_rules(rules)}
        saved = set_autocast(enabled, dtype or "float16")
        dtype_contract.policy_stack.append(state)
        own.stack.append(own.rules)
        own.rules = merged
        return saved

    def exit_autocast(self, token: Any) -> None:
        own = dtype_contract.thread_rules
        own.rules = own.stack.pop()
        dtype_contract.policy_stack.pop()
        restore_autocast(token)

    def is_autocast_enabled(self) -> bool:
        return bool(_amp_state._enabled)

    def autocast_low_dtype(self, device: str) -> str | None:
        if not _amp_state._enabled:  # one process-wide state for every device
            return None
        return dtype_name(_get_amp_low_prec_dtype())
