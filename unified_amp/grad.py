"""``GradManager`` and ``clip_grad_norm``: gradient recording that reads the same on both
frameworks, so that one training step serves both."""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any

from . import _overflowed, _scaled, _tracing, distributed
from ._registry import get_backend
from .errors import PortabilityWarning, ScalerStateError
from .scaler._targets import params_of
from .capabilities import DataParallelHooks, GradVersions, capability

__all__ = ["GradManager", "clip_grad_norm"]


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


class GradManager:
    """Records a forward pass and accumulates gradients into attached parameters.

    The semantics are MegEngine's, on both backends::

        gm = amp.GradManager(model.parameters())
        with gm:                      # records the forward pass
            loss = model(x).mean()
            gm.backward(loss)         # adds d loss / d p into p.grad; ends the recording
        gm.zero_grad()                # gradients accumulate until this

    Only attached parameters receive gradients.

    Callbacks are MegEngine's: ``callback(param, grad) -> grad`` gets the gradient this
    backward pass computed for ``param`` (before it is added to ``param.grad``) and
    returns the gradient to pass on; the last one's result is accumulated. On MegEngine
    they go straight to its own GradManager, so ``dist.make_allreduce_cb("mean")``
    works; on torch they run right after the backward pass, with the same semantics.

    Args:
        params: as ``attach()``.
        callbacks: as ``attach()``.
    """

    def __init__(self, params: Any = None, callbacks: Any = None) -> None:
        self._backend = get_backend()
        self._tape = self._backend.new_tape()
        self._params: list[Any] = []
        self._recording = False
        # Where a tensor has a backward() of its own (torch: the adapter's gradients have
        # versions), the gradients as a block began, to tell a backward this
        # GradManager did not run.
        versions = capability(self._backend, GradVersions)
        self._version = None if versions is None else versions.grad_version
        self._before: tuple[list[Any], list[Any]] | None = None
        # Set when backward() has ended the recording of the current block, so that a
        # second backward() in the same block is told so (not "nothing recorded").
        self._spent = False
        if params is not None:
            self.attach(params, callbacks=callbacks)
        elif callbacks is not None:
            raise ValueError(
                "GradManager(callbacks=...) needs params to attach them to; pass"
                " GradManager(params, callbacks=...) or call attach(params, callbacks=...)."
            )

    def attach(self, params: Any, callbacks: Any = None) -> "GradManager":
        """Adds a parameter, an iterable of parameters, or a module's parameters.

        Args:
            params: a tensor, an iterable of tensors, a module, or an optimizer.
            callbacks: a callable or a list of callables ``(param, grad) -> grad`` to
                run on each new gradient of these parameters during backward; attaching
                a parameter again adds its callbacks after the ones it has (MegEngine's
                rule).

        Returns:
            self.

        Raises:
            TypeError: a callback is not callable.
        """
        callbacks = _callbacks(callbacks)
        given = params_of(params, self._backend, "GradManager.attach()")
        distributed.note_module(self._backend, params)
        known = {id(p) for p in self._params}
        self._params.extend(p for p in given if id(p) not in known)
        self._tape.attach(given, callbacks)
        return self

    def attached_tensors(self) -> list[Any]:
        """The attached parameters, in the order they were attached."""
        return list(self._params)

    def record(self) -> None:
        """Starts recording (what ``with gm:`` does on entry)."""
        if self._recording:
            raise RuntimeError(
                "GradManager is already recording: a `with gm:` block was entered twice."
                " Finish the first block (or call gm.backward()) before starting another."
            )
        self._tape.record()
        self._recording = True
        self._spent = False
        if self._version is not None:
            self._before = self._grads()

    def release(self) -> None:
        """Stops recording and frees the recorded graph (what leaving ``with gm:`` does)."""
        self._left(3)

    def _left(self, stacklevel: int) -> None:
        before, self._before = self._before, None
        if before is not None and not self._spent and self._recording and \
                self._written_since(before):
            warnings.warn(
                "The gradients of parameters attached to this amp.GradManager were"
                " written inside its `with gm:` block by a backward pass it did not run"
                " (loss.backward() or scaler.scale(loss).backward()). That trains on torch"
                " but fails on MegEngine, whose tensors have no backward(): call"
                " gm.backward(loss) inside the block (gm.backward(scaler.scale(loss)), or"
                " scaler.backward(gm, loss)) for code that runs on both.",
                PortabilityWarning, stacklevel=stacklevel)
        self._spent = False
        self._stop()

    def _written_since(self, before: tuple[list[Any], list[Any]]) -> bool:
        grads, versions = self._grads()
        # (by identity: == on tensors compares their elements)
        return any(map(operator.is_not, grads, before[0])) or versions != before[1]

    def _grads(self) -> tuple[list[Any], list[Any]]:
        """The attached gradients and their versions (an in-place accumulation moves
        the version, a backward into a None gradient makes a new object)."""
        grads = list(map(_grad_of, self._params))
        version = self._version
        assert version is not None
        return grads, [None if g is None else version(g) for g in grads]

    def _stop(self) -> None:
        self._recording = False
        self._tape.release()

    def __enter__(self) -> "GradManager":
        self.record()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._left(3)

    def backward(self, y: Any = None, dy: Any = None) -> None:
        """Accumulates gradients of ``y`` (a tensor or list of tensors) into ``p.grad``.

        Args:
            y: the output(s) to differentiate, usually the loss.
            dy: cotangent(s) matching ``y``; defaults to ones, so a scalar loss gives
                plain gradients.

        Ends the recording, as MegEngine does: one backward per ``with gm:`` block.

        Raises:
            RuntimeError: no ``with gm:`` block is recording, or ``backward()`` already
                ran in this one.
        """
        if self._spent:
            raise RuntimeError(
                "GradManager.backward() was already called in this `with gm:` block: a"
                " block records the forward pass for one backward() call, which frees it."
                " Run each backward() in its own `with gm:` block (gradients accumulate"
                " across blocks), or differentiate several outputs in one call:"
                " gm.backward([y1, y2])."
            )
        if not self._recording:
            raise RuntimeError(
                "GradManager.backward() was called with no recorded computation: run the"
                " forward pass and call backward() inside `with gm:` (a block records for"
                " one backward() call)."
            )
        ys = _as_list(y)
        dys = None if dy is None else _as_list(dy)
        if dys is not None and len(dys) != len(ys):
            raise ValueError(
                f"GradManager.backward() got {len(ys)} output(s) y but {len(dys)}"
                f" cotangent(s) dy; pass one dy per y, or dy=None for ones."
            )
        try:
            self._tape.backward(ys, dys)
        finally:
            self._stop()
            self._spent = True
        _scaled.note_backward(self._params, ys, dys)  # a scaled one: clip_grad_norm asks

    def zero_grad(self) -> None:
        """Drops the accumulated gradients of every attached parameter (sets them to None)."""
        self._backend.drop_grads(self._params)
        _overflowed.unmark(self._params)


_grad_of = operator.attrgetter("grad")


def _callbacks(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    listed = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for cb in listed:
        if not callable(cb):
            raise TypeError(
                f"GradManager callbacks must be callables (param, grad) -> grad, or a list"
                f" of them; got {type(cb).__name__} {cb!r}."
            )
    return listed


def clip_grad_norm(target: Any, max_norm: float, norm_type: float = 2.0, *,
                   scaled: bool = False) -> float:
    """Scales gradients in place so that their total norm is at most ``max_norm``.

    Args:
        target: a GradManager, an optimizer, a module, or an iterable of parameters.
            For an FSDP1 model pass the FSDP module itself, whose own clip computes the
            norm over all ranks' shards; FSDP2's DTensor gradients give the global norm
            whatever the target.
        max_norm: the largest allowed total norm, a positive finite number.
        norm_type: the p of the p-norm (2.0, or ``float("inf")``).
        scaled: True clips gradients that a GradScaler's scale still multiplies, on
            purpose (``max_norm`` is then a bound on the scaled norm: multiply it by
            ``scaler.get_scale()``). False (the default) refuses them.

    Returns:
        The total norm of the gradients before clipping, as a Python float (this reads
        one number back from the device). inf where a GradScaler dropped the
        gradients of an overflowed step (``scaler.backward(gm, loss)``,
        ``scaler.unscale(gm)``), as torch's ``clip_grad_norm_`` says of the inf/NaN
        gradients that torch.amp's ``unscale_`` keeps.

    Uses the framework's own clipping (``torch.nn.utils.clip_grad_norm_``,
    ``megengine.optimizer.clip_grad_norm``), so results match theirs bit for bit where
    the norm is finite. A non-finite norm is returned and the gradients are left as
    they are, on both backends (the step that follows is skipped; torch's own clip
    would make every gradient NaN, MegEngine's only some). In manual mode call it after
    ``scaler.unscale(...)``, so it sees true-scale gradients.

    Raises:
        ScalerStateError: (a ``RuntimeError``) a live GradScaler scaled these gradients
            and has not unscaled them: call ``scaler.unscale(gm)`` (or
            ``scaler.unscale_(optimizer)``) first, or pass ``scaled=True``.
        UnsupportedTraceError: inside ``megengine.jit.trace``, where the norm cannot be
            read back as a number; clip with the framework's own function there.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
        math.isfinite(max_norm) and max_norm > 0
    ):
        raise ValueError(
            f"clip_grad_norm max_norm must be a positive finite number; got {max_norm!r}."
        )
    if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool) or not (
        norm_type > 0
    ):
        raise ValueError(
            f"clip_grad_norm norm_type must be a positive number or float('inf');"
            f" got {norm_type!r}."
        )
    backend = get_backend()
    if _tracing.mode(backend) is not None:
        raise _tracing.refuse(backend, "amp.clip_grad_norm()", "clip")
    params = params_of(target, backend, "clip_grad_norm()")
    distributed.note_module(backend, target)
    if _overflowed.dropped(params):
        return math.inf
    if not scaled:
        scale = _scaled.scale_held(params)
        if scale is not None:
            raise ScalerStateError(
                f"clip_grad_norm() got gradients that are still scaled by the GradScaler's"
                f" scale ({scale:g}): clipping them would clip a norm {scale:g} times too"
                f" large and shrink the true gradients by as much. Call"
                f" scaler.unscale(gm) (or scaler.unscale_(optimizer)) first, then clip."
                f" To clip the scaled gradients on purpose, pass"
                f" clip_grad_norm(..., scaled=True) with a max_norm scaled too."
            )
    if backend.is_module(target):
        hooks = capability(backend, DataParallelHooks)
        norm = None if hooks is None else hooks.module_clip_grad_norm(
            target, float(max_norm), float(norm_type))
        if norm is not None:
            return norm
    if distributed.sharded_params(backend, params):
        raise ValueError(
            "clip_grad_norm() got FSDP1 parameters (each rank holds a shard of their"
            " gradients), whose local norm is not the total norm: pass the root FSDP"
            " module instead, amp.clip_grad_norm(fsdp_model, max_norm), which clips by"
            " the norm over all ranks."
        )
    return backend.clip_grad_norm(params, float(max_norm), float(norm_type))

