"""Which gradients a GradScaler has unscaled, and what their check found.

The scaler must never unscale the same gradients twice, must allow unscaling *new*
gradients as often as a loop produces them, and must remember a verdict for as long as
the gradients it describes exist -- across ``update()``, so that
``scaler.backward(gm, loss)`` (which unscales and updates) followed by
``scaler.step(optimizer)`` neither unscales again nor forgets an overflow.

So the ledger follows gradient *generations*, not parameters. A record says: this
parameter's gradient object, as it stood after backward pass number ``epoch``, was
unscaled by ``check``. It stops describing the parameter's gradient when

- the gradient is another object (a backward into a None ``.grad``, ``zero_grad()``,
  the scaler dropping it, the user replacing it), or
- a later scaled backward pass ran (the epoch moved) and the gradient was written to
  since (its version moved). Where the framework has no version counter (MegEngine),
  a moved epoch alone ends the record.

Records hold their parameter and gradient weakly: MegEngine's GradManager holds tensors
weakly too, and a freed tensor's ``id()`` may be reused by the next iteration's.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


class Check:
    """One fused check (usually with unscale) over a set of gradients.

    ``flag`` is the adapter's device-side flag (None when there were no gradients);
    ``found`` is the host verdict once read (None while unread). ``pending`` is the
    handle of a cross-rank all-reduce still running on ``flag`` (see distributed.py),
    waited for before the flag is first used. ``on_overflow`` runs once if the read
    finds an inf/NaN (the overflow report, forensics.py); it is dropped unrun once the
    verdict is known, so a clean check costs nothing more.
    """

    __slots__ = ("flag", "found", "pending", "on_overflow", "__weakref__")

    def __init__(self, flag: Any, found: bool | None, pending: Any = None,
                 on_overflow: Callable[[], None] | None = None) -> None:
        self.flag = flag
        self.found = found
        self.pending = pending
        self.on_overflow = on_overflow

    def ready(self) -> Any:
        """The flag, once any all-reduce on it has completed (on a GPU this orders the
        streams and does not wait on the host)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
        return self.flag

    def verdict(self, read: Callable[[Any], bool]) -> bool:
        """The host verdict, reading the flag (a host sync) the first time only."""
        if self.found is None:
            self.found = bool(read(self.ready()))
            hook, self.on_overflow = self.on_overflow, None
            if self.found and hook is not None:
                hook()  # before anyone drops the gradients it describes
        return self.found


class _Record:
    __slots__ = ("param", "grad", "version", "epoch", "iteration", "check")

    def __init__(self, param: Any, grad: Any, version: int | None, epoch: int,
                 iteration: int, check: Check) -> None:
        self.param = weakref.ref(param)
        self.grad = None if grad is None else weakref.ref(grad)  # None: we dropped it
        self.version = version
        self.epoch = epoch
        self.iteration = iteration
        self.check = check


# lookup()'s answer for a gradient that a backward pass accumulated into after it was
# unscaled, in the same iteration: part unscaled, part scaled, so no unscale is right.
MIXED = object()


class GradLedger:
    """The scaler's records of unscaled gradient generations (see the module docstring)."""

    def __init__(self) -> None:
        self._records: dict[int, _Record] = {}
        self.epoch = 0  # scaled backward passes seen (or announced) so far
        self.iteration = 0  # the user's update() calls so far

    def new_backward(self) -> None:
        """A scaled backward pass ran, or is about to."""
        self.epoch += 1

    def new_iteration(self) -> None:
        """The user called update(): a backward the scaler could not see (MegEngine's
        ``gm.backward(loss, dy=scale_factor)`` into gradients zeroed in place) may
        follow, so records without a version counter stop speaking for their gradient."""
        self.iteration += 1

    def forget(self, params: list[Any]) -> None:
        """Ends the records of ``params`` (a backward through them is about to run)."""
        for p in params:
            self._records.pop(id(p), None)

    def record(self, params: list[Any], check: Check,
               version: Callable[[Any], int | None]) -> None:
        """Notes that the current gradients of ``params`` went through ``check``
        (a parameter whose gradient the scaler dropped is recorded as such)."""
        for p in params:
            g = p.grad
            self._records[id(p)] = _Record(p, g, None if g is None else version(g),
                                           self.epoch, self.iteration, check)

    def lookup(self, p: Any, version: Callable[[Any], int | None]) -> Any:
        """The check that unscaled ``p``'s current gradient; None if the gradient is a
        new generation; ``MIXED`` if a backward accumulated into it since it was
        unscaled in this iteration."""
        rec = self._records.get(id(p))
        if rec is None:
            return None
        g = p.grad
        same_iteration = rec.iteration == self.iteration
        if rec.param() is not p:
            answer = None
        elif rec.grad is None:  # dropped on overflow: valid until the next backward
            answer = rec.check if (g is None and rec.epoch == self.epoch
                                   and same_iteration) else None
        elif g is None or rec.grad() is not g:
            answer = None  # another gradient object: a new generation
        else:
            if rec.version is not None:
                # torch: written since iff the version moved -- after a scaled backward,
                # or across an update() (a zero_grad(set_to_none=False) in between)
                written = version(g) != rec.version and (
                    rec.epoch != self.epoch or not same_iteration)
            else:
                written = rec.epoch != self.epoch or not same_iteration
            if not written:
                return rec.check
            if same_iteration:
                return MIXED  # kept: every later unscale of it must refuse too
            answer = None
        del self._records[id(p)]
        return answer

    def prune(self) -> None:
        """Drops records whose parameter no longer exists."""
        dead = [k for k, rec in self._records.items() if rec.param() is None]
        for k in dead:
            del self._records[k]
