"""The framework-specific half of the examples, tests and benchmarks: one construction kit.

The training steps in the example modules are written once against unified_amp; what
the two frameworks spell differently (tensors, models, losses, optimizers, a few ops) is
handed to them by one of the two classes here, picked by :func:`get` from the active
unified_amp backend. The contract tests (``tests/kits``) and the benchmarks
(``benchmarks/*_kit.py``) build on the same two classes and add only what is theirs.

Each class imports its framework in ``__init__``, so importing this module imports no
framework until a kit is made.

Devices: a kit has one ``device`` ("cpu" or "cuda"), where a method puts what it makes
unless it is given another one. On MegEngine "where it puts it" without a device is the
default device: on the CPU build that is "xpux", a different comp node from "cpux", and
one op cannot mix the two; so code either lets everything land on the default device (the
examples, the benchmarks) or names the device every time (the contract tests, which also
set the default device with :meth:`MegEngineKit.on_device`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import unified_amp as amp

# What MegEngine's CUDA stub prints to stderr, from C and whatever MegEngine's log level,
# when it finds no CUDA driver: a five-line "works under CPU mode" banner and "failed to
# load cuda func" lines, once when the framework loads and again at the first op.
_CUDA_STUB_NOISE = re.compile(r"^(info: \+.*|debug: failed to load cuda func: \w+)\n?$")


@contextlib.contextmanager
def _without_cuda_stub_noise() -> Iterator[None]:
    """Captures file descriptor 2 for the block and passes on every line but MegEngine's
    CUDA-stub messages (which on a CPU machine only say it runs on the CPU)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(x for x in lines if not _CUDA_STUB_NOISE.match(x)))
            sys.stderr.flush()


def get() -> Any:
    """The framework kit of the active unified_amp backend (``UNIFIED_AMP_BACKEND``)."""
    with _without_cuda_stub_noise():
        name = amp.get_backend().name
        if name not in KITS:
            raise ValueError(
                f"the examples cover the torch and megengine backends; got {name!r}")
        return KITS[name]()


class FrameworkKit:
    """What both kits write once, in the names both frameworks share.

    ``nn`` is the framework's module namespace (``torch.nn`` or ``megengine.module``):
    ``Module``, ``Sequential``, ``Linear``, ``Conv2d``, ``BatchNorm1d``/``2d``,
    ``LayerNorm``, ``ReLU``, ``LeakyReLU``, ``AvgPool2d`` and ``Identity`` take the same
    arguments on both, so a model written with them and the kit's ops is one model.
    """

    name: str
    nn: Any  # the module namespace
    F: Any  # the functional namespace
    device: str

    def device_name(self) -> str:
        """"CPU" or "CUDA", where the kit's tensors live."""
        return self.device.upper()

    def labels(self, a: Any, device: str | None = None) -> Any:
        """Class labels as cross-entropy wants them (int64 on torch, int32 on MegEngine)."""
        return self.tensor(a, device, "int32")

    # -- ops both frameworks spell the same way ----------------------------------------
    def relu(self, x: Any) -> Any:
        return self.F.relu(x)

    def gelu(self, x: Any) -> Any:
        return self.F.gelu(x)

    def mul(self, a: Any, b: Any) -> Any:
        return a * b

    def total(self, t: Any) -> Any:
        return t.sum()

    # -- models ------------------------------------------------------------------------
    def define(self, factory: Callable[[Any], Any]) -> Any:
        """What ``factory(kit)`` returns, made once per kit: for model classes written
        once against ``kit.nn`` (a class statement needs its framework's ``Module``)."""
        made = self.__dict__.setdefault("_defined", {})
        if factory not in made:
            made[factory] = factory(self)
        return made[factory]

    def cnn(self, num_classes: int, width: int, image_size: int) -> Any:
        """conv-BN-ReLU-avgpool twice, then a linear classifier."""
        nn = self.nn
        model = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AvgPool2d(2),
            self.flatten(),
            nn.Linear(2 * width * (image_size // 4) ** 2, num_classes),
        )
        return self.place(model)

    def mlp(self, sizes: Sequence[int], batch_norm: bool = False) -> Any:
        """Linear layers of the given widths with LeakyReLU between them (and
        BatchNorm1d before each LeakyReLU with ``batch_norm``)."""
        layers: list[Any] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i:
                if batch_norm:
                    layers.append(self.nn.BatchNorm1d(fan_in))
                layers.append(self.nn.LeakyReLU(0.2))
            layers.append(self.nn.Linear(fan_in, fan_out))
        return self.place(self.nn.Sequential(*layers))

    def optimizer_state(self, opt: Any) -> list[tuple[str, Any]]:
        """Each parameter's optimizer state as (key, value), parameters in group order,
        keys sorted; values are tensors (momentum buffers, ...) or plain numbers."""
        state = self.state_by_param(opt)
        return [(key, value) for group in opt.param_groups for p in group["params"]
                for key, value in sorted(state.get(p, {}).items())]

    # -- what each framework spells its own way ----------------------------------------
    def tensor(self, a: Any, device: str | None = None, dtype: str = "float32") -> Any:
        """A tensor from an array, on ``device`` (default: the kit's)."""
        raise NotImplementedError

    def flatten(self) -> Any:
        """A module that flattens all but the batch dimension."""
        raise NotImplementedError

    def place(self, model: Any, device: str | None = None) -> Any:
        """The model on ``device`` (default: the kit's)."""
        raise NotImplementedError

    def state_by_param(self, opt: Any) -> dict[Any, dict[str, Any]]:
        """The optimizer's per-parameter state."""
        raise NotImplementedError


def _onednn_avx2_at_most(torch: Any) -> bool:
    """Whether torch's oneDNN runs no AVX-512 kernels here: the CPU lacks them, or
    ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA before oneDNN 2) caps it below them."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and cap != "ALL":
        return not cap.startswith(("AVX512", "AVX10", "AMX"))
    return "AVX512" not in torch.backends.cpu.get_cpu_capability()


class TorchKit(FrameworkKit):
    """PyTorch: ``torch.nn`` models, ``torch.optim`` optimizers, int64 labels.

    Args:
        device: "cpu", "cuda", or "auto": CUDA when torch sees one, as MegEngine's default
            device does by itself.
    """

    name = "torch"

    def __init__(self, device: str = "auto") -> None:
        import torch

        self.torch = torch
        self.nn = torch.nn
        self.F = torch.nn.functional
        self._dtypes = {"float32": torch.float32, "float16": torch.float16,
                        "bfloat16": torch.bfloat16, "int32": torch.int64}
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device

    def has_cuda(self) -> bool:
        return self.torch.cuda.is_available()

    def on_device(self, device: str) -> Any:
        """A context that makes ``device`` the default; torch tensors carry theirs."""
        return contextlib.nullcontext()

    def seed(self, seed: int) -> None:
        """Seeds the framework's RNG, which initialises the model weights."""
        self.torch.manual_seed(seed)

    def synchronize(self) -> None:
        """Waits for the device's queued kernels."""
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    # -- tensors -----------------------------------------------------------------------
    def tensor(self, a: Any, device: str | None = None, dtype: str = "float32") -> Any:
        """A tensor from an array; ``dtype`` "int32" gives the int64 that torch's class
        labels are."""
        return self.torch.tensor(np.asarray(a), device=device or self.device).to(
            self._dtypes[dtype])

    def param(self, a: Any, device: str | None = None, dtype: str = "float32") -> Any:
        return self.nn.Parameter(self.tensor(np.asarray(a, np.float32), device, dtype))

    def numpy(self, t: Any) -> np.ndarray:
        """A numpy copy of a tensor; low-precision floats come back as float32 (numpy
        has no bfloat16)."""
        t = t.detach()
        return (t.float() if t.is_floating_point() else t).cpu().numpy().copy()

    def dtype_name(self, t: Any) -> str:
        """The tensor's dtype as unified_amp spells it ("float32", "bfloat16", ...)."""
        return str(t.dtype).removeprefix("torch.")

    def dtype_object(self, name: str) -> Any:
        return self._dtypes[name]

    def set_grad(self, p: Any, a: Any) -> None:
        p.grad = self.tensor(np.asarray(a, dtype=np.float32), p.device)

    def grad(self, p: Any) -> np.ndarray | None:
        return None if p.grad is None else self.numpy(p.grad)

    def assign(self, p: Any, a: Any) -> None:
        """Overwrites a parameter's values in place."""
        with self.torch.no_grad():
            p.copy_(self.tensor(np.asarray(a, dtype=np.float32), p.device))

    def inference(self) -> Any:
        """A context for evaluation: torch records a graph whenever grad mode is on."""
        return self.torch.no_grad()

    def channels_last(self, x: Any) -> Any:
        """A model or 4-d tensor in the channels-last memory format (NHWC in memory)."""
        return x.to(memory_format=self.torch.channels_last)

    def channels_last_hazard(self, model: Any) -> str | None:
        """Why training ``model`` in channels-last would hang or crash this CPU, or None.

        oneDNN's AVX2 kernel for the weight gradient of a strided 1x1 convolution with
        fewer than 8 input channels, in channels-last float32, spins forever on 2
        threads and corrupts the heap on 1 (torch 2.13.0+cpu on an AMD EPYC without
        AVX-512; docs/CIFAR.md). CPUs whose oneDNN takes its AVX-512 kernels are not
        affected; ONEDNN_MAX_CPU_ISA=AVX2 sends them down the same path.
        """
        if self.device != "cpu" or not _onednn_avx2_at_most(self.torch):
            return None
        for name, m in model.named_modules():
            if (isinstance(m, self.nn.Conv2d) and tuple(m.kernel_size) == (1, 1)
                    and tuple(m.stride) != (1, 1) and m.in_channels < 8):
                return (f"--channels-last would hang or crash this CPU: oneDNN's AVX2 kernel"
                        f" (no AVX-512 here) for the weight gradient of a strided 1x1"
                        f" convolution with fewer than 8 input channels ({name}:"
                        f" {m.in_channels} in) never returns in channels-last float32."
                        f" Use --width 8 or more, or drop --channels-last.")
        return None

    def reset_peak_memory(self) -> None:
        if self.device == "cuda":
            self.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, how it was measured); bytes is None where torch reports nothing."""
        if self.device != "cuda":
            return None, "torch.cuda.max_memory_allocated() counts CUDA memory only"
        self.synchronize()
        return int(self.torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated()"

    # -- ops -------------------------------------------------------------------------
    def linear(self, x: Any, w: Any, b: Any) -> Any:
        return self.F.linear(x, w, b)

    def softmax(self, x: Any, axis: int) -> Any:
        return self.F.softmax(x, dim=axis)

    def matmul(self, a: Any, b: Any, transpose_b: bool = False) -> Any:
        return self.torch.matmul(a, b.transpose(-2, -1) if transpose_b else b)

    def permute(self, x: Any, axes: Sequence[int]) -> Any:
        return x.permute(*axes)

    def float32(self, x: Any) -> Any:
        return x.float()

    # -- losses ------------------------------------------------------------------------
    def cross_entropy(self, logits: Any, labels: Any) -> Any:
        return self.F.cross_entropy(logits, labels)

    def bce_with_logits(self, logits: Any, target: float) -> Any:
        """Mean binary cross-entropy of ``logits`` against the constant label ``target``."""
        # float32 under autocast (a row of unified_amp's dtype contract): a low-precision
        # log-sigmoid would lose the small losses that a GAN lives on.
        return self.F.binary_cross_entropy_with_logits(
            logits, self.torch.full_like(logits, target))

    def mse(self, pred: Any, target: Any) -> Any:
        """Mean squared error."""
        return self.F.mse_loss(pred, target)

    # -- models and optimizers ---------------------------------------------------------
    def flatten(self) -> Any:
        return self.nn.Flatten()

    def place(self, model: Any, device: str | None = None) -> Any:
        return model.to(device or self.device)

    def trainable(self, model: Any) -> list[Any]:
        """The model's parameters that take gradients, in order."""
        return [p for p in model.parameters() if p.requires_grad]

    def sgd(self, params: Any, lr: float, momentum: float = 0.0,
            weight_decay: float = 0.0) -> Any:
        return self.torch.optim.SGD(params, lr=lr, momentum=momentum,
                                    weight_decay=weight_decay)

    def adam(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
        return self.torch.optim.Adam(params, lr=lr, betas=betas)

    def lr_milestones(self, opt: Any, milestones: Sequence[int], gamma: float) -> Any:
        """The learning rate times ``gamma`` at each milestone (MultiStepLR)."""
        return self.torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma)

    def zero_grad(self, opt: Any) -> None:
        opt.zero_grad()

    def state_by_param(self, opt: Any) -> dict[Any, dict[str, Any]]:
        """The optimizer's per-parameter state."""
        return opt.state

    def is_tensor(self, value: Any) -> bool:
        return self.torch.is_tensor(value)


class MegEngineKit(FrameworkKit):
    """MegEngine: ``megengine.module`` models, ``megengine.optimizer``, int32 labels.

    Args:
        device: "cpu", "cuda", or "auto": CUDA when MegEngine sees one. "cpu" on a CUDA
            build makes the CPU the default device, where MegEngine's own code (modules,
            optimizers) makes its tensors.
    """

    name = "megengine"
    _COMP_NODES = {"cpu": "cpux", "cuda": "gpux"}

    def __init__(self, device: str = "auto") -> None:
        import megengine
        import megengine.functional as F
        import megengine.module as M
        import megengine.optimizer as optim

        from megengine.core.tensor.dtype import bfloat16

        self.mge, self.F, self.nn, self.optim = megengine, F, M, optim
        self._bfloat16 = bfloat16
        cuda = bool(megengine.is_cuda_available())
        if device == "auto":
            device = "cuda" if cuda else "cpu"
        if device == "cpu" and cuda:
            megengine.set_default_device("cpux")
        self.device = device
        # The first op initialises the default device (and its CUDA stub: see get()).
        megengine.tensor(np.zeros(1, np.float32)).numpy()

    def has_cuda(self) -> bool:
        return bool(self.mge.is_cuda_available())

    @contextlib.contextmanager
    def on_device(self, device: str) -> Iterator[None]:
        """Makes ``device`` the default for the block: MegEngine's own code (optimizers,
        modules) makes tensors on the default device, and ops only combine tensors on
        one comp node."""
        saved = self.mge.get_default_device()
        self.mge.set_default_device(self._COMP_NODES[device])
        try:
            yield
        finally:
            self.mge.set_default_device(saved)

    def seed(self, seed: int) -> None:
        """Seeds the framework's RNG, which initialises the model weights."""
        self.mge.random.seed(seed)

    def synchronize(self) -> None:
        """Waits for the queued kernels; raises MegEngine's AsyncError if one failed."""
        self.mge._full_sync()

    # -- tensors -----------------------------------------------------------------------
    def _where(self, device: str | None) -> str | None:
        return None if device is None else self._COMP_NODES[device]

    def tensor(self, a: Any, device: str | None = None, dtype: str = "float32") -> Any:
        """A tensor from an array, on ``device`` or else the default device."""
        a = np.asarray(a)
        if dtype == "bfloat16":
            return self.mge.tensor(a.astype(np.float32), device=self._where(device)).astype(
                self._bfloat16)
        return self.mge.tensor(a.astype(dtype), device=self._where(device))

    def param(self, a: Any, device: str | None = None, dtype: str = "float32") -> Any:
        return self.mge.Parameter(np.asarray(a, dtype=dtype), device=self._where(device))

    def numpy(self, t: Any) -> np.ndarray:
        """A numpy copy of a tensor; low-precision floats come back as float32."""
        return t.astype("float32").numpy() if self.dtype_name(t) in ("float16", "bfloat16") \
            else t.numpy()

    def dtype_name(self, t: Any) -> str:
        """The tensor's dtype as unified_amp spells it ("float32", "float16", ...)."""
        return "bfloat16" if "bfloat16" in str(t.dtype) else np.dtype(t.dtype).name

    def dtype_object(self, name: str) -> Any:
        return self._bfloat16 if name == "bfloat16" else np.dtype(name)

    def set_grad(self, p: Any, a: Any) -> None:
        p.grad = self.mge.tensor(np.asarray(a, dtype=np.float32), device=p.device)

    def grad(self, p: Any) -> np.ndarray | None:
        return None if p.grad is None else p.grad.numpy()

    def assign(self, p: Any, a: Any) -> None:
        """Overwrites a parameter's values in place."""
        p._reset(self.mge.tensor(np.asarray(a, dtype=np.float32), device=p.device))

    def inference(self) -> Any:
        """A context for evaluation: MegEngine records only inside a GradManager."""
        return contextlib.nullcontext()

    def reset_peak_memory(self) -> None:
        self.synchronize()
        self.mge.device.reset_max_memory_stats()

    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, how it was measured); bytes is None where MegEngine reports nothing."""
        self.synchronize()
        peak = int(self.mge.device.get_max_allocated_memory())
        if peak == 0 and self.device == "cpu":
            return None, "megengine.device.get_max_allocated_memory() is 0 on the CPU build"
        return peak, "megengine.device.get_max_allocated_memory() after megengine._full_sync()"

    # -- ops -------------------------------------------------------------------------
    def linear(self, x: Any, w: Any, b: Any) -> Any:
        return self.F.nn.linear(x, w, b)

    def softmax(self, x: Any, axis: int) -> Any:
        return self.F.softmax(x, axis=axis)

    def matmul(self, a: Any, b: Any, transpose_b: bool = False) -> Any:
        return self.F.matmul(a, b, transpose_b=transpose_b)

    def permute(self, x: Any, axes: Sequence[int]) -> Any:
        return x.transpose(*axes)

    def float32(self, x: Any) -> Any:
        return x.astype("float32")

    # -- losses ------------------------------------------------------------------------
    def cross_entropy(self, logits: Any, labels: Any) -> Any:
        return self.F.nn.cross_entropy(logits, labels)

    def bce_with_logits(self, logits: Any, target: float) -> Any:
        """Mean binary cross-entropy of ``logits`` against the constant label ``target``."""
        # float32 under autocast, as in TorchKit.bce_with_logits.
        return self.F.nn.binary_cross_entropy(
            logits, self.F.full_like(logits, target), with_logits=True)

    def mse(self, pred: Any, target: Any) -> Any:
        """Mean squared error."""
        return self.F.nn.square_loss(pred, target)

    # -- models and optimizers ---------------------------------------------------------
    def flatten(self) -> Any:
        F = self.F

        class Flatten(self.nn.Module):  # megengine.module has none
            def forward(self, x: Any) -> Any:
                return F.flatten(x, 1)

        return Flatten()

    def place(self, model: Any, device: str | None = None) -> Any:
        # A module's tensors are made on the default device (see on_device).
        return model

    def trainable(self, model: Any) -> list[Any]:
        """The model's parameters, in order."""
        return list(model.parameters())

    def sgd(self, params: Any, lr: float, momentum: float = 0.0,
            weight_decay: float = 0.0) -> Any:
        return self.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    def adam(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
        return self.optim.Adam(params, lr=lr, betas=betas)

    def lr_milestones(self, opt: Any, milestones: Sequence[int], gamma: float) -> Any:
        """The learning rate times ``gamma`` at each milestone (MultiStepLR)."""
        return self.optim.MultiStepLR(opt, milestones, gamma)

    def zero_grad(self, opt: Any) -> None:
        opt.clear_grad()

    def state_by_param(self, opt: Any) -> dict[Any, dict[str, Any]]:
        """The optimizer's per-parameter state (MegEngine's has no public name)."""
        return opt._state

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, self.mge.Tensor)


KITS = {"torch": TorchKit, "megengine": MegEngineKit}
