"""Fake CUDA on a CPU-only torch build: the CUDA *dispatch* path without a GPU.

Inside ``fake_cuda()``, ``torch.empty(..., device="cuda")`` makes a FakeTensor (torch's
own ``FakeTensorMode``): a tensor with a device, a dtype and a shape but no data. What
runs for real is everything that decides *which* kernel would run and *what it returns*:
torch's dispatcher, its AutocastCUDA policy, the kernels unified_amp registers on the
AutocastCUDA key, the meta kernels that propagate dtypes and devices (fused optimizers,
``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``), and all of
unified_amp's Python code. What does not run: kernels (there are no values), streams,
events, and autograd on CUDA leaves. Tests built on this module therefore check
dispatch, dtypes, devices and host syncs -- never numerics; those need a real GPU
(tests/native/test_torch_cuda_syncs.py and the contract's ``cuda`` cases).

Every place where the fake differs from a GPU machine is here, once, with the reason:

1. ``torch.cuda.is_available()`` answers True. unified_amp refuses
   ``autocast(device="cuda")`` with UnsupportedPrecisionError when torch sees no GPU,
   picks its CUDA scaler class and its devices from it, and ``torch.autocast("cuda")``
   disables itself (with a warning) when it is False.
2. ``torch.cuda.is_bf16_supported()`` answers True: both torch.autocast and unified_amp
   ask the (absent) device before a bfloat16 block.
3. FakeTensorMode always behaves as on a machine without CUDA (``avoid_device_init``),
   although (1) says otherwise: it reads ``is_available()`` to decide whether it may run
   real kernels on constant tensors, and on this build any real CUDA kernel fails.
4. ``torch.cuda.Event`` is a stand-in whose ``query()`` answers what the test sets in
   ``FakeCuda.events_done``: the real one needs the CUDA runtime. unified_amp's
   telemetry (``TorchDeviceScale``) records one per step and must never wait on it.
5. No autograd: the block runs under ``torch.no_grad()``, and tests set ``.grad``
   themselves where a GPU run would call backward. Building an autograd graph on a CUDA
   leaf asks the C++ runtime for a CUDA device guard, which a CPU build lacks: the
   process aborts (``terminate``), it does not raise. For the same reason, module
   cases (a BatchNorm's forward) run without a graph; autocast's cache of weight casts
   is off in the block (it builds an autograd edge for a float32 weight that requires
   grad even under ``no_grad``); and tensors are made with CUDA factories
   (``empty``/``zeros`` with ``device="cuda"``), never ``.to("cuda")`` from CPU data or
   ``copy_`` between CUDA tensors (those take the guard in C++ too).
6. Batch norm runs without running statistics: updating them copies between CUDA
   tensors (5). The output dtype, which is what the contract fixes, does not depend
   on them in training mode.
7. Host reads return fixed values: a fake tensor has none. Reads of CUDA tensors
   answer ``SyncCounter.value`` (0: "no inf/NaN"; a test may say otherwise); reads of
   host tensors answer 1 (an optimizer's step count lives there: 1 keeps Adam's bias
   correction finite). The counter is what makes the reads visible at all.
8. The torch adapter's caches of scale tensors and of their reciprocals (one per
   device, kept across scalers) are emptied when a block starts and ends: a fake tensor
   from one block must not reach another block's fake mode, nor a real GPU's tests in
   the same process.
9. Fused SGD (``aten::_fused_sgd_``) has no meta kernel in torch 2.13, so fake mode
   cannot run it; inside the block it gets one that does nothing (it only updates
   values in place, and there are none). Fused Adam and AdamW have torch's own.
10. Under ``torch.compile`` with (1) in force, dynamo saves and restores the CUDA
   generator's state around each trace, which needs the runtime. ``report_a_gpu``
   answers with an empty state: no CUDA tensor is made there, so none is kept.
"""

from __future__ import annotations

import contextlib
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import unified_amp as amp

from .kits.torch_kit import Kit

aten = torch.ops.aten


class _CpuBuildFakeMode(FakeTensorMode):
    """FakeTensorMode that never tries a real CUDA kernel (bypass 3)."""

    @property
    def avoid_device_init(self) -> bool:
        return True


class FakeEvent:
    """``torch.cuda.Event`` for fake CUDA (bypass 4)."""

    def __init__(self, owner: "FakeCuda", *args, **kwargs):
        self._owner = owner
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def query(self) -> bool:
        assert self.recorded, "query() of an event that was never recorded"
        return self._owner.events_done

    def synchronize(self):
        self._owner.syncs.count("Event.synchronize")

    def wait(self, stream=None):
        pass


class SyncCounter(TorchDispatchMode):
    """Counts the host syncs a GPU would make, as torch's sync debug mode reports them.

    A sync is: ``aten._local_scalar_dense`` of a CUDA tensor (``item()``, ``bool()``,
    ``float()``, ``int()``; ``tolist()`` of a fake CUDA tensor makes one per element,
    where a GPU copies once: code under test copies to the host first); a copy from
    CUDA into host memory that is blocking, or non-blocking into memory that was not
    allocated pinned (the copy cannot be asynchronous then); ``torch.cuda.synchronize()``
    and ``Event.synchronize()``. Each is logged in ``events`` and counted in ``n``.
    Reads answer ``value`` (or ``value(tensor)``) for CUDA tensors and 1 for host ones
    (bypass 7).
    """

    def __init__(self, value=0):
        super().__init__()
        self.value = value
        self.events: list[str] = []
        # id -> weak reference of each tensor allocated pinned (by id: a tensor's ==
        # is elementwise)
        self._pinned: dict[int, weakref.ref] = {}
        self.pinned = 0  # host tensors allocated in pinned memory so far

    @property
    def n(self) -> int:
        return len(self.events)

    def count(self, what: str) -> None:
        self.events.append(what)

    def reset(self) -> None:
        self.events.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if args[0].device.type == "cuda":
                self.count(f"item() of a {args[0].dtype} CUDA tensor")
                value = self.value(args[0]) if callable(self.value) else self.value
            else:
                value = 1
            if args[0].dtype == torch.bool:
                return bool(value)
            return float(value) if args[0].dtype.is_floating_point else int(value)
        out = func(*args, **kwargs)
        if func is aten.empty.memory_format and kwargs.get("pin_memory"):
            self._pinned[id(out)] = weakref.ref(out)
            self.pinned += 1
        elif func is aten._to_copy.default and args[0].device.type == "cuda" \
                and out.device.type == "cpu" and not kwargs.get("non_blocking"):
            self.count(f"blocking copy of a {tuple(args[0].shape)} CUDA tensor to the host")
        elif func is aten.copy_.default and args[1].device.type == "cuda" \
                and args[0].device.type == "cpu":
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            pinned = self._pinned.get(id(args[0]), lambda: None)() is args[0]
            if not (non_blocking and pinned):
                self.count(f"copy of a {tuple(args[1].shape)} CUDA tensor into"
                           f" {'pageable' if non_blocking else 'host'} memory")
        return out


class FakeCuda:
    """What a test sees of the fake: the sync counter and the events' state."""

    def __init__(self, syncs: SyncCounter):
        self.syncs = syncs
        self.events_done = True  # bypass 4: whether recorded work has "finished"

    def tensor(self, shape, dtype=torch.float32):
        """A CUDA tensor of ``shape`` and ``dtype`` (made by a factory: bypass 5)."""
        return torch.empty(tuple(shape), dtype=dtype, device="cuda")

    def module(self, build):
        """``build()``'s module with its parameters and buffers on fake CUDA: built on
        the meta device, then each tensor replaced by a CUDA factory's (bypass 5;
        ``Module.to`` and the initialisers copy, and fake values mean nothing anyway)."""
        with torch.device("meta"):
            module = build()
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                setattr(sub, name, torch.nn.Parameter(self.tensor(p.shape, p.dtype),
                                                      requires_grad=p.requires_grad))
            for name, b in list(sub.named_buffers(recurse=False)):
                if b is not None:
                    setattr(sub, name, self.tensor(b.shape, b.dtype))
        return module


@contextlib.contextmanager
def fake_cuda(value=0):
    """A block in which ``device="cuda"`` tensors are fake and host syncs are counted.

    Args:
        value: what every read of a CUDA tensor returns (``SyncCounter.value``); a
            callable gets the tensor being read.

    Yields:
        FakeCuda: ``.syncs`` counts the syncs; ``.events_done`` drives CUDA events.
    """
    fake = FakeCuda(SyncCounter(value))
    backend = amp.get_backend()
    with contextlib.ExitStack() as stack:
        for cache in (backend._scale_cache, backend._inv_cache):  # bypass 8
            cache.clear()
            stack.callback(cache.clear)
        stack.enter_context(_CpuBuildFakeMode())
        stack.enter_context(fake.syncs)  # innermost: sees each op before fake mode
        stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: True))
        stack.enter_context(mock.patch.object(torch.cuda, "is_bf16_supported",
                                              lambda *a, **k: True))
        stack.enter_context(mock.patch.object(
            torch.cuda, "Event", lambda *a, **k: FakeEvent(fake, *a, **k)))
        stack.enter_context(mock.patch.object(
            torch.cuda, "synchronize", lambda *a, **k: fake.syncs.count("synchronize()")))
        # bypass 3 again: older torch (2.7) makes a real CUDA tensor the first time fake
        # mode sees a CUDA device when is_available() answers True (1); a CUDA build
        # then fails with "no NVIDIA driver". Newer torch asks the accelerator instead.
        stack.enter_context(mock.patch.object(
            torch._subclasses.fake_tensor, "init_gpu_context", lambda device: None))
        if torch.backends.cuda.is_built():
            # bypass 3 on a CUDA build of torch without a driver (make test-oldest): with
            # is_available() True (1), an optimizer's step asks the CUDA runtime whether a
            # graph is being captured, and fake convolution asks it for a conv backend
            # (which only picks a memory format, never a dtype). Neither may reach it.
            stack.enter_context(mock.patch.object(
                torch.cuda, "is_current_stream_capturing", lambda: False))
            stack.enter_context(mock.patch.object(
                torch._C, "_select_conv_backend",
                lambda *a, **k: torch._C._ConvBackend.Slow2d))
            # Likewise cuDNN's RNN and the fused attention kernels, which ask the device
            # whether they may run: the LSTM and the attention take the kernels they take
            # on a CPU build (make test's fake CUDA); cuDNN's and the fused kernels' own
            # dtypes are a GPU run's to check (the contract's cuda cases).
            stack.enter_context(torch.backends.cudnn.flags(enabled=False))
            stack.enter_context(torch.nn.attention.sdpa_kernel(
                [torch.nn.attention.SDPBackend.MATH]))
        stack.enter_context(torch.no_grad())  # bypass 5
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_sgd_", "Meta"):
            meta = torch.library.Library("aten", "IMPL")  # bypass 9, undone on exit
            for overload in ("_fused_sgd_", "_fused_sgd_.tensor_lr"):
                meta.impl(overload, lambda *args, **kwargs: None, "Meta")
            stack.callback(meta._destroy)
        # bypass 5 again: autocast's cache of weight casts builds an autograd edge for a
        # float32 leaf that requires grad even under no_grad; torch.autocast blocks
        # entered inside inherit this setting.
        weight_casts = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        stack.callback(torch.set_autocast_cache_enabled, weight_casts)
        yield fake


def report_a_gpu(monkeypatch) -> None:
    """torch.cuda says a GPU is here (bypass 1), for code that only asks and makes no
    CUDA tensor: what a block's entry sees on a GPU machine, under torch.compile too
    (bypass 10). Undone by ``monkeypatch`` at the end of the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda *a, **k: torch.empty(0, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)


@pytest.fixture
def fc():
    """The fake-CUDA block for one test (import it into a test module to use it)."""
    with fake_cuda() as fake:
        yield fake


class FakeCudaKit(Kit):
    """The torch test kit's dtype-table ops on fake CUDA tensors: the same calls, with
    the tensors made by factories (bypass 5) and the batch norm module without running
    statistics (bypass 6). Only dtypes and devices of the results mean anything."""

    def __init__(self, fake: FakeCuda):
        super().__init__("cpu")  # not "auto": torch.cuda.is_available() is faked here
        self.fake = fake

    def tensor(self, a, dev, dtype="float32"):
        return torch.empty(np.shape(a), dtype=self.dtype_object(dtype), device=dev)

    def run_module(self, row, inp, dev, low):
        x = self.tensor(inp["x"], dev, low)
        img = self.tensor(inp["img"], dev, low)
        if row == "softmax":
            return torch.nn.Softmax(dim=-1)(x)
        if row == "batch norm":
            return self.fake.module(
                lambda: torch.nn.BatchNorm2d(2, track_running_stats=False))(img)
        if row == "layer norm":
            return self.fake.module(lambda: torch.nn.LayerNorm(8))(x)
        raise KeyError(row)
