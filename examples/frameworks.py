"""The framework-specific half of the examples: models, losses, optimizers and tensors.

The training steps in the example modules are written once against unified_amp; what
the two frameworks spell differently is handed to them by one of the two classes here,
picked by :func:`get` from the active unified_amp backend. Each class imports its
framework in ``__init__``, so importing an example imports no framework until it runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Iterator, Sequence

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
    kits = {"torch": TorchKit, "megengine": MegEngineKit}
    with _without_cuda_stub_noise():
        name = amp.get_backend().name
        if name not in kits:
            raise ValueError(
                f"the examples cover the torch and megengine backends; got {name!r}")
        return kits[name]()


class TorchKit:
    """PyTorch: ``torch.nn`` models, ``torch.optim`` optimizers, int64 labels.

    Models and tensors go to the GPU when torch sees one, as MegEngine's default device
    does by itself.
    """

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.nn = torch.nn
        self.F = torch.nn.functional
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def device_name(self) -> str:
        """"CPU" or "CUDA", where the examples' tensors live."""
        return self.device.type.upper()

    def seed(self, seed: int) -> None:
        """Seeds the framework's RNG, which initialises the model weights."""
        self.torch.manual_seed(seed)

    def tensor(self, a: np.ndarray) -> Any:
        """A float32 tensor from a numpy array."""
        return self.torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(self.device)

    def labels(self, a: np.ndarray) -> Any:
        """Class labels as cross-entropy wants them (int64)."""
        return self.torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(self.device)

    def numpy(self, t: Any) -> np.ndarray:
        """A float32 numpy copy of a tensor (numpy has no bfloat16)."""
        return t.detach().float().cpu().numpy()

    def dtype_name(self, t: Any) -> str:
        """The tensor's dtype as unified_amp spells it ("float32", "bfloat16", ...)."""
        return str(t.dtype).removeprefix("torch.")

    def inference(self) -> Any:
        """A context for evaluation: torch records a graph whenever grad mode is on."""
        return self.torch.no_grad()

    def cnn(self, num_classes: int, width: int, image_size: int) -> Any:
        """conv-BN-ReLU-avgpool twice, then a linear classifier."""
        # Both kits build the same network, so that their runs compare.
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
            nn.Flatten(),
            nn.Linear(2 * width * (image_size // 4) ** 2, num_classes),
        )
        return model.to(self.device)

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
        return self.nn.Sequential(*layers).to(self.device)

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

    def adam(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
        return self.torch.optim.Adam(params, lr=lr, betas=betas)

    def sgd(self, params: Any, lr: float, momentum: float = 0.0) -> Any:
        return self.torch.optim.SGD(params, lr=lr, momentum=momentum)


class MegEngineKit:
    """MegEngine: ``megengine.module`` models, ``megengine.optimizer``, int32 labels.

    Tensors are made on MegEngine's default device: on the CPU build that is "xpux",
    a different comp node from "cpux", and one op cannot mix the two.
    """

    name = "megengine"

    def __init__(self) -> None:
        import megengine
        import megengine.functional as F
        import megengine.module as M
        import megengine.optimizer as optim

        self.mge, self.F, self.M, self.optim = megengine, F, M, optim
        # The first op initialises the default device (and its CUDA stub: see get()).
        megengine.tensor(np.zeros(1, np.float32)).numpy()

    def device_name(self) -> str:
        """"CPU" or "CUDA", where the examples' tensors live."""
        return "CUDA" if self.mge.is_cuda_available() else "CPU"

    def seed(self, seed: int) -> None:
        """Seeds the framework's RNG, which initialises the model weights."""
        self.mge.random.seed(seed)

    def tensor(self, a: np.ndarray) -> Any:
        """A float32 tensor from a numpy array."""
        return self.mge.tensor(np.asarray(a, dtype=np.float32))

    def labels(self, a: np.ndarray) -> Any:
        """Class labels as cross-entropy wants them (int32)."""
        return self.mge.tensor(np.asarray(a, dtype=np.int32))

    def numpy(self, t: Any) -> np.ndarray:
        """A float32 numpy copy of a tensor."""
        return t.numpy().astype(np.float32)

    def dtype_name(self, t: Any) -> str:
        """The tensor's dtype as unified_amp spells it ("float32", "float16", ...)."""
        return "bfloat16" if "bfloat16" in str(t.dtype) else np.dtype(t.dtype).name

    def inference(self) -> Any:
        """A context for evaluation: MegEngine records only inside a GradManager."""
        return contextlib.nullcontext()

    def cnn(self, num_classes: int, width: int, image_size: int) -> Any:
        """conv-BN-ReLU-avgpool twice, then a linear classifier (see TorchKit.cnn)."""
        M, F = self.M, self.F

        class Flatten(M.Module):  # megengine.module has none
            def forward(self, x):
                return F.flatten(x, 1)

        return M.Sequential(
            M.Conv2d(1, width, 3, padding=1, bias=False),
            M.BatchNorm2d(width),
            M.ReLU(),
            M.AvgPool2d(2),
            M.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            M.BatchNorm2d(2 * width),
            M.ReLU(),
            M.AvgPool2d(2),
            Flatten(),
            M.Linear(2 * width * (image_size // 4) ** 2, num_classes),
        )

    def mlp(self, sizes: Sequence[int], batch_norm: bool = False) -> Any:
        """Linear layers of the given widths with LeakyReLU between them (and
        BatchNorm1d before each LeakyReLU with ``batch_norm``)."""
        layers: list[Any] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i:
                if batch_norm:
                    layers.append(self.M.BatchNorm1d(fan_in))
                layers.append(self.M.LeakyReLU(0.2))
            layers.append(self.M.Linear(fan_in, fan_out))
        return self.M.Sequential(*layers)

    def cross_entropy(self, logits: Any, labels: Any) -> Any:
        return self.F.nn.cross_entropy(logits, labels)

    def bce_with_logits(self, logits: Any, target: float) -> Any:
        """Mean binary cross-entropy of ``logits`` against the constant label ``target``."""
        # float32 under autocast (a row of unified_amp's dtype contract): a low-precision
        # log-sigmoid would lose the small losses that a GAN lives on.
        return self.F.nn.binary_cross_entropy(
            logits, self.F.full_like(logits, target), with_logits=True)

    def mse(self, pred: Any, target: Any) -> Any:
        """Mean squared error."""
        return self.F.nn.square_loss(pred, target)

    def adam(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
        return self.optim.Adam(params, lr=lr, betas=betas)

    def sgd(self, params: Any, lr: float, momentum: float = 0.0) -> Any:
        return self.optim.SGD(params, lr=lr, momentum=momentum)
