"""Gradients: GradManager recording on torch autograd, gradient access and clipping."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from unified_amp import capabilities, interface


class _Tape:
    """GradManager recording on torch autograd, with MegEngine's semantics."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self._grad_mode: bool | None = None
        # id(param) -> callbacks, MegEngine's: each gets (param, this backward's
        # gradient) and returns the gradient passed on, then accumulated into .grad.
        self._callbacks: dict[int, list[Any]] = {}

    def attach(self, params: Sequence[torch.Tensor], callbacks: Sequence[Any] = ()) -> None:
        for p in params:
            if not p.is_leaf:
                raise ValueError(
                    f"GradManager can only attach leaf tensors (parameters); got a tensor of"
                    f" shape {tuple(p.shape)} computed by {type(p.grad_fn).__name__}."
                    f" Attach the parameter it was computed from, or .detach() it."
                )
            if not p.requires_grad:
                if not p.is_floating_point():
                    raise ValueError(
                        f"GradManager can only attach floating-point tensors; got dtype"
                        f" {p.dtype} for a tensor of shape {tuple(p.shape)}."
                    )
                # Attaching is what makes a tensor differentiable in MegEngine.
                p.requires_grad_(True)
        known = {id(p) for p in self.params}
        self.params.extend(p for p in params if id(p) not in known)
        if callbacks:
            for p in params:  # concatenated per tensor on repeated attach, as MegEngine
                self._callbacks.setdefault(id(p), []).extend(callbacks)

    def record(self) -> None:
        self._grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(True)

    def release(self) -> None:
        if self._grad_mode is not None:
            torch.set_grad_enabled(self._grad_mode)
            self._grad_mode = None

    def backward(self, ys: Sequence[torch.Tensor], dys: Sequence[Any] | None) -> None:
        if not ys or not self.params:
            return
        if dys is None:
            dys = [torch.ones_like(y) for y in ys]
        hooked = [p for p in self.params if id(p) in self._callbacks]
        if not hooked:
            # inputs= keeps gradients to the attached tensors, as MegEngine does.
            torch.autograd.backward(list(ys), grad_tensors=list(dys), inputs=self.params)
            return
        # The callbacks see this backward's gradient alone, before it joins what .grad
        # holds: set the old gradients aside, run the backward, then pass each new
        # gradient through its callbacks and accumulate it (after backward, in place,
        # as autograd would have).
        kept = [(p, p.grad) for p in hooked]
        for p in hooked:
            p.grad = None
        try:
            torch.autograd.backward(list(ys), grad_tensors=list(dys), inputs=self.params)
        except BaseException:
            for p, old in kept:
                p.grad = old
            raise
        with torch.no_grad():
            for p, old in kept:
                new = p.grad
                if new is None:  # no gradient reached it: its callbacks do not run
                    p.grad = old
                    continue
                for callback in self._callbacks[id(p)]:
                    new = callback(p, new)
                p.grad = new if old is None else old.add_(new)


# The class of autograd's node for ``tensor * tensor`` (what the scale makes).
_MUL_NODE = type((torch.ones(1, requires_grad=True) * torch.ones(1)).grad_fn)
# torch >= 2.10 tells whether a saved tensor was freed without unpacking it
# (SavedTensor.data is None); before, unpacking a freed one raises. Asked of the
# class: a SavedTensor that outlives its node crashes the garbage collector on 2.14.
_SAVED_HAS_DATA = hasattr(torch._C._autograd.SavedTensor, "data")


def _freed(node: Any) -> bool:
    """Whether a backward pass freed what the scale's multiplication saved."""
    if _SAVED_HAS_DATA:
        return node._raw_saved_other.data is None
    try:
        node._saved_other
    except RuntimeError:  # "... after they have already been freed"
        return True
    return False


def _freed_below(node: Any, limit: int = 32) -> bool:
    """Whether a backward pass freed the graph below ``node`` (what its input was
    computed from): the first nodes found that saved tensors say, freed or not."""
    todo = [f for f, _ in node.next_functions if f is not None]
    seen: set[int] = set()
    while todo and len(seen) < limit:
        below = todo.pop(0)
        if id(below) in seen:
            continue
        seen.add(id(below))
        kept = False
        for name in dir(below):
            if name.startswith("_saved_"):
                try:
                    kept = kept or isinstance(getattr(below, name), torch.Tensor)
                except RuntimeError:  # "... after they have already been freed"
                    return True
        if kept:
            return False
        todo += [f for f, _ in below.next_functions if f is not None]
    return False


class Gradients(interface.Gradients, capabilities.GradVersions,
                capabilities.BackwardProbes):
    """A tape per GradManager, the gradients of parameters, and torch's own clip."""

    def new_tape(self) -> _Tape:
        return _Tape()

    def grads(self, params: Any) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]

    def drop_grads(self, params: Any) -> None:
        for p in params:
            p.grad = None

    def grad_version(self, grad: torch.Tensor) -> int:
        # Bumped by every in-place write (a backward accumulating into it, clipping);
        # the fused unscale kernel leaves it alone.
        return grad._version

    def backward_token(self, tensor: torch.Tensor) -> Any:
        # The node that multiplied by the scale. A backward pass through it frees what
        # it saved (the scale), and one through the loss alone frees the loss's graph
        # but not it: autograd leaves that trace at no cost, where a hook called during
        # the backward pass costs about 1% of a small model's step.
        node = tensor.grad_fn
        return node if type(node) is _MUL_NODE else None

    def backward_ran(self, token: Any) -> bool | None:
        if _freed(token):
            return True  # freed by a backward pass through it
        return False if _freed_below(token) else None

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float,
                       norm_type: float) -> float:
        # clip_grad_norm_'s two halves (what it runs), the clip only for a finite norm:
        # a non-finite one leaves the gradients as they are (its clip would make them
        # all NaN), as on MegEngine.
        params = list(params)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                             norm_type)
        # Under FSDP2 the norm is a DTensor; torch 2.7 and 2.8 read its float as this rank's
        # local part, so ask for the global value explicitly.
        full = getattr(norm, "full_tensor", None)
        value = float(full() if full is not None else norm)
        if math.isfinite(value):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return value
