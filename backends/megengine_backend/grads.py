"""Gradients: GradManager recording on MegEngine's own GradManager, gradient access
and clipping."""

from __future__ import annotations

import math
from typing import Any, Sequence

import megengine
import megengine.functional as F
from megengine.autodiff import GradManager as _NativeGradManager

from unified_amp import interface


class _Tape:
    """GradManager recording on MegEngine's own GradManager."""

    def __init__(self) -> None:
        self.gm = _NativeGradManager()

    def attach(self, params: Sequence[Any], callbacks: Sequence[Any] = ()) -> None:
        # Passed straight on, so that MegEngine's own callbacks (make_allreduce_cb, which
        # asks for the GradManager running backward) work unchanged.
        self.gm.attach(params, callbacks=list(callbacks))

    def record(self) -> None:
        self.gm.record()

    def release(self) -> None:
        self.gm.release()

    def backward(self, ys: Sequence[Any], dys: Sequence[Any] | None) -> None:
        if dys is not None and len(dys) == len(ys):
            # torch's autograd casts a cotangent to its output's dtype; MegEngine's
            # backward asserts instead, in an elementwise kernel (a float32 dy for a
            # float16 loss, which the contract leaves float16 where `mean` follows its
            # input). Cast as torch does; a dy of the output's dtype is passed as it is.
            dys = [dy if getattr(dy, "dtype", None) in (None, getattr(y, "dtype", None))
                   else dy.astype(y.dtype) for y, dy in zip(ys, dys)]
        self.gm.backward(list(ys), None if dys is None else list(dys))


class Gradients(interface.Gradients):
    """A tape per GradManager, the gradients of parameters, and MegEngine's own clip."""

    def new_tape(self) -> _Tape:
        return _Tape()

    def grads(self, params: Any) -> list[Any]:
        return [p.grad for p in params if p.grad is not None]

    def drop_grads(self, params: Any) -> None:
        for p in params:
            p.grad = None

    def clip_grad_norm(self, params: Sequence[Any], max_norm: float,
                       norm_type: float) -> float:
        # megengine.optimizer.clip_grad_norm's ops, the clip only for a finite norm: a
        # non-finite one leaves the gradients as they are (its clip would make some NaN,
        # or none), as on torch.
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return 0.0
        norms = [F.norm(p.grad.flatten(), ord=norm_type) for p in with_grad]
        total = F.norm(F.concat(norms), ord=norm_type) if len(norms) > 1 else norms[0]
        value = float(total.item())
        if math.isfinite(value):
            scale = F.minimum(max_norm / (total + 1e-6), 1)
            for p in with_grad:
                p.grad._reset(p.grad * scale)
        return value
