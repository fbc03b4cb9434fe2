"""Gradients that a ``scale_loss`` block scaled and nothing will unscale.

The backward pass inside ``amp.scale_loss(loss_D, opt_D, loss_id=0)`` writes into every
parameter the loss depends on: a GAN's discriminator loss computed from the generator's
output, not detached, fills G's gradients too, scaled by loss scale 0. The block unscales
only ``opt_D``'s. Left alone, G's next ``scale_loss`` would set them aside as true-scale
gradients and add them (apex's stash), and ``opt_G.step()`` would step on gradients
thousands of times too large, silently. So each block notes which gradients of the other
optimizers of its ``initialize`` it wrote, and the first use of any that are still
there raises, naming the optimizer, the parameters and the fix.

A gradient stops counting once it is no longer the one the block left: dropped or
replaced (``zero_grad()``), or (torch) written in place outside a block
(``zero_grad(set_to_none=False)``). One pass over the other optimizers' parameters per
block, on the host; no device work.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ..capabilities import GradVersions, capability

__all__: list[str] = []


def _no_version(grad: Any) -> int:
    return 0


class StaleGrads:
    """One optimizer's gradients that a ``scale_loss`` block for other optimizers wrote."""

    def __init__(self, backend: Any) -> None:
        versions = capability(backend, GradVersions)
        self.version: Callable[[Any], int] = (
            _no_version if versions is None else versions.grad_version)
        # id(param) -> (param, weak ref to the gradient the block left, its version, loss_id)
        self.entries: dict[int, tuple[Any, Any, int, int]] = {}

    def token(self, param: Any) -> tuple[int, int] | None:
        g = param.grad
        return None if g is None else (id(g), self.version(g))

    def note(self, params: list[Any], before: list[Any], loss_id: int) -> None:
        """Records the gradients of ``params`` that changed since ``before``."""
        for p, was in zip(params, before):
            g = p.grad
            if g is None or self.token(p) == was:
                continue
            try:
                ref: Any = weakref.ref(g)
            except TypeError:  # a tensor type without weak references: hold it
                ref = (lambda g=g: g)
            self.entries[id(p)] = (p, ref, self.version(g), loss_id)

    def still_there(self) -> list[tuple[Any, int]]:
        """(param, loss_id) of the noted gradients nobody has dropped or rewritten; forgets
        the others."""
        left = []
        for key, (p, ref, version, loss_id) in list(self.entries.items()):
            g = p.grad
            if g is not None and g is ref() and self.version(g) == version:
                left.append((p, loss_id))
            else:
                del self.entries[key]
        return left


def snapshot(infos: list[Any]) -> list[tuple[Any, list[Any], list[Any]]]:
    """Each optimizer's parameters and their gradients' tokens, before a block."""
    out = []
    for info in infos:
        params = info.params()
        out.append((info, params, [info.stale.token(p) for p in params]))
    return out


def note_block(before: list[tuple[Any, list[Any], list[Any]]], loss_id: int) -> None:
    """After a block: notes what its backward pass wrote into the others' gradients."""
    for info, params, tokens in before:
        info.stale.note(params, tokens, loss_id)


def refuse(info: Any, what: str) -> None:
    """Raises if ``info``'s optimizer holds gradients that another block scaled."""
    left = info.stale.still_there()
    if not left:
        return
    state = info.state
    names = _param_names(state)
    shown = [names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p, _ in left]
    listed = ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")
    ids = sorted({k for _, k in left})
    scales = " and ".join(f"{state.scalers[k].get_scale():g} (loss_id={k})" for k in ids)
    opt = info.optimizer
    index = next((i for i, o in enumerate(state.infos) if o is info), None)
    label = f"{type(opt).__name__}" + ("" if index is None else
                                       f" (optimizer {index} of amp.initialize)")
    raise RuntimeError(
        f"{what}: {len(left)} gradient(s) of {label} ({listed}) were written by the"
        f" backward pass of an amp.scale_loss(..., loss_id={ids[0]}) block that was not"
        f" given this optimizer. They are scaled by loss scale {scales}, and nothing"
        f" will unscale them: that block unscales only its own optimizers' gradients."
        f" Stepping now would use them that many times too large. Fix: detach what this"
        f" model feeds into that loss (model_D(model_G(z).detach()) for a GAN's"
        f" discriminator loss), or zero this optimizer's gradients"
        f" (optimizer.zero_grad()) before its own scale_loss; or pass this optimizer to"
        f" that scale_loss too."
    )


def _param_names(state: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    for i, model in enumerate(state.models):
        named = getattr(model, "named_parameters", None)
        if named is None:
            continue
        prefix = f"model {i}: " if len(state.models) > 1 else ""
        for name, p in named():
            names.setdefault(id(p), prefix + name)
            master = state.master_of.get(id(p))
            if master is not None:
                names.setdefault(id(master), prefix + name)
    return names
