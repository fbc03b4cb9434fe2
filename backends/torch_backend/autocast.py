"""Autocasting: torch.autocast per device, and the dtype contract, both in a form that
``torch.compile`` traces (docs/COMPILE.md).

The contract is a ``TorchFunctionMode`` on torch's function-mode stack rather than a
Python flag read inside dispatcher kernels. Dynamo guards on that stack and inlines the
mode's ``__torch_function__``, so the float32 casts become ordinary nodes of the captured
graph: a graph traced with the contract differs from one traced without it, in dynamo's
cache and in AOTAutograd's and inductor's (also on disk), and plain ``torch.autocast``
never meets the contract. Eagerly the mode does the same casts, so eager and compiled
code agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from unified_amp import interface
from unified_amp.errors import UnsupportedPrecisionError

from .basics import DTYPES, LOW, default_dtype, devices

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# The ops the contract puts in float32 whatever their input (docs/DTYPE_CONTRACT.md):
# each aten op, and the Python spellings that reach it first.
_SPELLINGS: dict[str, tuple[Any, ...]] = {
    "softmax.int": (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax,
                    F.softmin),  # softmin: the softmax of -x, in one Python function
    "log_softmax.int": (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                        torch.special.log_softmax),
    "sum": (torch.sum, torch.Tensor.sum),
    "mean": (torch.mean, torch.Tensor.mean),
    "exp": (torch.exp, torch.Tensor.exp),
    "log": (torch.log, torch.Tensor.log),
    "layer_norm": (F.layer_norm, torch.layer_norm),
    "avg_pool2d": (F.avg_pool2d,),
    "adaptive_avg_pool2d": (F.adaptive_avg_pool2d,),
}


def _fp32_functions() -> dict[Any, frozenset[str]]:
    """function -> the device types on which the contract must cast its inputs.

    Where torch's autocast already runs an op in float32 on a device (on CUDA: softmax,
    log_softmax, sum, exp, log, layer_norm) the contract adds nothing there, so a
    compiled graph stays exactly torch.autocast's. Read once, at import, from torch's
    own dispatcher table (nothing of ours is ever registered in it).
    """
    table: dict[Any, frozenset[str]] = {}
    for op, functions in _SPELLINGS.items():
        where = frozenset(
            dev for dev, key in _AUTOCAST_KEYS.items()
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key))
        for fn in functions:
            table[fn] = where
    return table


_FP32 = _fp32_functions()


def _up(value: Any, where: frozenset[str]) -> Any:
    """``value`` in float32 if it is a low-precision tensor on a device whose autocast
    is on and where the contract applies; otherwise ``value`` itself."""
    if (isinstance(value, torch.Tensor) and value.dtype in LOW
            and value.device.type in where and torch.is_autocast_enabled(value.device.type)):
        return value.float()
    return value


class ContractMode(TorchFunctionMode):
    """Casts the low-precision inputs of the contract's float32 ops to float32.

    Pushed by an enabled unified autocast block with ``contract=True`` (and popped by a
    nested block that turns the contract off). Active only where torch's autocast is on
    for the tensor's device, as a kernel on torch's Autocast key would be.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        where = _FP32.get(func)
        if where:
            args = tuple(_up(a, where) for a in args)
            kwargs = {k: v if k == "out" else _up(v, where) for k, v in kwargs.items()}
        return func(*args, **kwargs)


# One instance serves every block: dynamo guards on the stack's mode types, and the
# mode keeps no state.
CONTRACT = ContractMode()


@torch.compiler.assume_constant_result
def _cuda_lacking_bfloat16() -> str:
    """The current CUDA device's name if it does not compute bfloat16, else "".

    Asked on each block's entry, which may be inside a compiled function. Dynamo cannot
    put ``torch.cuda``'s queries in a graph (they return a bool or a str, not a tensor):
    asked there directly, they break the graph, and ``fullgraph=True`` fails, on a GPU
    machine only. The answer is a fact of the hardware, so dynamo may ask it once, while
    tracing, and keep it as a constant of the graph.
    """
    return "" if torch.cuda.is_bf16_supported() else torch.cuda.get_device_name()


class _Autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast``, under a name dynamo does not special-case.

    Dynamo traces ``torch.autocast`` only as the subject of a ``with`` statement; the
    unified block enters and exits in two calls, so it enters this subclass, whose
    ``__enter__``/``__exit__`` (torch's own) dynamo inlines into the autocast state
    switches it tracks.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, enabled: bool) -> None:
        if device_type == "cuda" and enabled and torch.compiler.is_compiling():
            # torch's constructor asks CUDA whether autocast can run there and whether it
            # computes bfloat16; dynamo inlines it and cannot trace either question (see
            # _cuda_lacking_bfloat16), so on a GPU machine the block would break the
            # graph. check_precision has answered both, traceably: built while tracing as
            # a CPU block (which asks nothing of CUDA; the same two dtypes are valid
            # there), then pointed at CUDA. Eagerly, torch's constructor runs as is.
            super().__init__("cpu", dtype=dtype, enabled=enabled)
            self.device = device_type
        else:
            super().__init__(device_type, dtype=dtype, enabled=enabled)


def _top_is_contract() -> bool:
    n = torch._C._len_torch_function_stack()
    return n > 0 and isinstance(torch._C._get_function_stack_at(n - 1), ContractMode)


def _enter(devs: list[str], dtypes: list[torch.dtype], enabled: bool,
           contract: bool) -> tuple[list[Any], str]:
    """Enters torch's autocast on each device, then sets the contract for the block.

    Returns the token ``_exit`` takes: the autocast contexts and what was done to the
    mode stack ("pushed", "popped" or "").
    """
    contexts = []
    for dev, dtype in zip(devs, dtypes):
        ctx = _Autocast(dev, dtype=dtype, enabled=enabled)
        ctx.__enter__()
        contexts.append(ctx)
    want = enabled and contract
    action = ""
    if want and not _top_is_contract():
        torch._C._push_on_torch_function_stack(CONTRACT)
        action = "pushed"
    elif not want and _top_is_contract():
        # A block that turns the contract off inside one that has it.
        torch._C._pop_torch_function_stack()
        action = "popped"
    return contexts, action


def _exit(token: tuple[list[Any], str]) -> None:
    """Undoes ``_enter``: the mode stack first, then autocast, innermost first."""
    contexts, action = token
    lost = [ctx.device for ctx in contexts
            if torch.is_autocast_enabled(ctx.device) != ctx._enabled
            or (ctx._enabled and torch.get_autocast_dtype(ctx.device) != ctx.fast_dtype)]
    if action == "pushed" and _top_is_contract():
        torch._C._pop_torch_function_stack()
    elif action == "popped":
        torch._C._push_on_torch_function_stack(CONTRACT)
    if not lost:
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)
    else:  # their entry never took effect here: exiting would unbalance torch's nesting
        # Dynamo ran the entries inside a graph of their own and never their exits: take
        # back the nesting they left (never below zero), or torch would not clear its
        # weight-cast cache at the end of any later autocast block in this process.
        current = torch.autocast_increment_nesting() - 1
        torch.autocast_decrement_nesting()
        for _ in range(min(2 * len(contexts), current)):
            torch.autocast_decrement_nesting()
        torch.clear_autocast_cache()  # no weight cast made in the broken block is reused
        # What a graph break inside the block does under torch.compile: dynamo compiles
        # the block's entry into a graph of its own, whose autocast switches AOTAutograd
        # drops, and resumes the body without autocast. Say so before the body's results
        # can reach a backward or an optimizer.
        raise RuntimeError(
            f"amp.autocast was not in force on {', '.join(lost)} when its block ended:"
            f" under torch.compile this is a graph break inside the amp.autocast block,"
            f" which dynamo cannot resume inside a user-defined context manager, or an"
            f" amp.autocast object made outside the compiled function and entered inside"
            f" it. Move what breaks the graph (print, .item(), an unsupported call) out of"
            f" the block (compile with fullgraph=True to find it); make the amp.autocast"
            f" object inside the compiled function, or use it as a decorator; or enter the"
            f" block outside the compiled function (docs/COMPILE.md).")


def _dynamo_traces_autocast_switches() -> bool:
    """Whether dynamo records torch's autocast state switches as graph operations.

    Torch added that in "[dynamo] Support tracing _enter_autocast and _exit_autocast"
    (pytorch#173877, after 2.7); before it dynamo skips ``autocast_increment_nesting``
    and a block entered in two calls cannot be traced (torch 2.7 fails or crashes in
    dynamo). There the block's entry and exit run eagerly instead: dynamo breaks the
    graph at them and compiles the body's calls with autocast and the contract already
    in force, which it guards on.
    """
    try:
        from torch._dynamo import trace_rules
        from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

        return trace_rules.lookup(torch.autocast_increment_nesting) is TorchInGraphFunctionVariable
    except Exception:  # dynamo's internals moved: take the safe, eager path
        return False


#: Whether ``amp.autocast`` traces whole under ``torch.compile(fullgraph=True)``; read
#: at each entry (dynamo guards on it), so a test can take the other path.
TRACEABLE = _dynamo_traces_autocast_switches()
_enter_eagerly = torch.compiler.disable(_enter)
_exit_eagerly = torch.compiler.disable(_exit)


class Autocasting(interface.Autocasting):
    """Switching autocast on and off, and which precisions a device computes."""

    def check_precision(self, dtype: str | None, device: str | None) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise UnsupportedPrecisionError(
                "autocast(device='cuda') was requested, but torch sees no CUDA device"
                f" (torch {torch.__version__}). Use device='cpu' or device=None."
            )
        for dev in devices(device):
            want = dtype or default_dtype(dev)
            lacking = dev == "cuda" and want == "bfloat16" and _cuda_lacking_bfloat16()
            if lacking:
                raise UnsupportedPrecisionError(
                    f"autocast dtype 'bfloat16' is not supported by this CUDA device"
                    f" ({lacking}); use dtype='float16'."
                )

    def enter_autocast(self, enabled: bool, dtype: str | None, device: str | None,
                       contract: bool = True) -> Any:
        devs = devices(device)
        enter = _enter if TRACEABLE else _enter_eagerly
        return enter(devs, [DTYPES[dtype or default_dtype(dev)] for dev in devs], enabled,
                     contract)

    def exit_autocast(self, token: Any) -> None:
        (_exit if TRACEABLE else _exit_eagerly)(token)

    def is_autocast_enabled(self) -> bool:
        return any(torch.is_autocast_enabled(dev) for dev in devices(None))

    def autocast_low_dtype(self, device: str) -> str | None:
        if not torch.is_autocast_enabled(device):
            return None
        return str(torch.get_autocast_dtype(device)).removeprefix("torch.")
