"""Which gradients a GradScaler has unscaled, and what their check found.

The scaler must never unscale the same gradients twice, must allow unscaling *new*
gradients as often as a loop produces them, and must remember a verdict for as long as
the gradients it describes exist -- across the ``update()`` that
``scaler.backward(gm, loss)`` runs itself, so that ``scaler.backward(gm, loss)``
followed by ``scaler.step(optimizer)`` neither unscales again nor forgets an overflow.

So the ledger follows gradient *generations*, not parameters. A record says: this
parameter's gradient object, as it stood after backward pass number ``epoch``, was
unscaled by ``check``. It stops describing the parameter's gradient when

- the gradient is another object (a backward into a None ``.grad``, ``zero_grad()``,
  the scaler dropping it, the user replacing it),
- a later scaled backward pass ran (the epoch moved) and the gradient was written to
  since (its version moved; where the framework has no version counter, MegEngine, a
  moved epoch alone counts as written) -- within one iteration such a gradient mixes
  unscaled and scaled values (``MIXED``), or
- the user called ``update()``: that ends the iteration, and every record with it
  (gradients zeroed in place, or written by a backward the scaler could not see, are a
  new generation afterwards).

**Cost.** The records of one check are kept together, as parallel lists (a *batch*),
not as an object per parameter: a step of torch.amp's loop records one batch and its
``update()`` drops it, so the ledger adds no per-parameter objects, weak references or
dictionary entries to the step. Until an ``update()`` a batch holds its gradients (the
parameters hold them too); one that outlives the ``update()`` of ``scaler.backward`` is
then made weak, so it keeps no gradient alive that the user frees, and a freed tensor's
``id()`` reused by a new one is never mistaken for it. A lookup over the same parameter
list a batch recorded (a GradManager's, an optimizer's) compares position by position;
other lookups go through an index built once per batch.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, Callable, NamedTuple

Version = Callable[[Any], "int | None"]
# A record's check: a Check of the machine's (_machine.py), kept and handed back unread.
CheckRef = Any


class Split(NamedTuple):
    """A target's parameters as the ledger sees them: ``pending``, those whose gradient
    still needs unscaling, and ``grads``, those gradients; ``done``, the checks that
    already unscaled the others; ``idle``, the parameters without a gradient."""

    pending: list[Any]
    grads: list[Any]
    done: list[Any]
    idle: list[Any]


# lookup's answer for a gradient that a backward pass accumulated into after it was
# unscaled, in the same iteration: part unscaled, part scaled, so no unscale is right.
MIXED = object()
# A batch position that records nothing (forgotten, or not covered by the check).
_ABSENT = object()
# Batches kept before a new record compacts the older ones.
_MAX_BATCHES = 16


class _Batch:
    """The records of one check: position ``j`` says that ``params[j]``'s gradient
    ``grads[j]`` (None: dropped by the scaler, or agreed without one) was unscaled by
    ``check`` after backward pass ``epoch``; ``versions[j]`` is its version when the
    next backward pass began (None until then, and where there are no versions)."""

    __slots__ = ("_key", "params", "grads", "versions", "epoch", "check", "weak", "index")

    def __init__(self, params: list[Any], grads: list[Any], versions: list[Any] | None,
                 epoch: int, check: CheckRef) -> None:
        # The ids of ``params``, made when first needed: torch.amp's loop records a
        # batch at step() and drops it at update() without ever looking it up.
        self._key: tuple[int, ...] | None = None
        self.params = params
        self.grads = grads
        self.versions = versions
        self.epoch = epoch
        self.check = check
        self.weak = False
        self.index: dict[int, int] | None = None

    @property
    def key(self) -> tuple[int, ...]:
        if self._key is None:  # (never weak here: weaken() makes it first)
            self._key = tuple(map(id, self.params))
        return self._key

    def weaken(self) -> None:
        if self.weak:
            return
        self.key  # noqa: B018 -- made from the parameters while they are held
        ref, grads = weakref.ref, self.grads
        # A recorded gradient is found by its own identity, so its parameter needs no
        # reference; a parameter whose gradient was dropped (None) keeps a weak one.
        if any(map(_is_none, grads)) or any(map(_is_absent, grads)):
            self.params = [ref(p) if g is None else None for p, g in zip(self.params, grads)]
            self.grads = [g if g is None or g is _ABSENT else ref(g) for g in grads]
        else:  # the usual record: every gradient there
            self.params = [None] * len(grads)
            self.grads = list(map(ref, grads))
        self.weak = True

    def param(self, j: int, p: Any) -> bool:
        """Whether position ``j`` records ``p`` (a parameter with this id)."""
        if not self.weak:
            return self.params[j] is p
        ref = self.params[j]
        return ref is None or ref() is p

    def grad(self, j: int) -> Any:
        """The recorded gradient object, None (dropped), _ABSENT, or -- weak and since
        freed -- a fresh object that no live gradient is."""
        g = self.grads[j]
        if self.weak and g is not None and g is not _ABSENT:
            g = g()
            return _ABSENT if g is None else g
        return g

    def position(self, p: Any) -> int | None:
        if self.index is None:
            self.index = {k: j for j, k in enumerate(self.key)}
        j = self.index.get(id(p))
        if j is None or self.grads[j] is _ABSENT or not self.param(j, p):
            return None
        return j


class GradLedger:
    """The scaler's records of unscaled gradient generations (see the module docstring)."""

    def __init__(self) -> None:
        self._batches: list[_Batch] = []  # oldest first; a newer record shadows an older
        self.epoch = 0  # scaled backward passes seen (or announced) so far
        self._strong = False  # some batch holds its gradients (weaken() has work)

    def new_backward(self, version: Version = None) -> None:  # type: ignore[assignment]
        """A scaled backward pass is about to run (or ran, unseen).

        The recorded gradients' versions are read here, when the first backward after
        the record is about to write, not at the record: the usual step's record ends
        at update() with no backward in between, so it never reads them at all."""
        self.epoch += 1
        if version is None or version is _no_version:
            return
        for b in self._batches:
            if b.versions is None:
                b.versions = [None if g is None or g is _ABSENT else version(g)
                              for g in (b.grad(j) for j in range(len(b.grads)))]

    def new_iteration(self) -> None:
        """The user called update(): every record ends (see the module docstring)."""
        self._batches = []

    def record(self, params: list[Any], grads: list[Any], check: CheckRef,
               weak: bool = True, version: Version | None = None) -> None:
        """Notes that ``grads`` (the current gradients of ``params``, None where the
        scaler dropped one or the rank had none) went through ``check``.

        ``weak=False`` holds the gradients until the next ``update()`` or backward: for
        torch.amp's forms, whose ``update()`` follows within the iteration; it saves
        making a weak reference per gradient on every step. ``version``: read the
        gradients' versions now rather than when the next backward begins (a backward
        the scaler learns of only afterwards may write to them)."""
        if not params:
            return
        if len(self._batches) >= _MAX_BATCHES:  # never reached by the usual loops
            self._forget_ids({id(p) for p in params})
        versions = None if version is None else [None if g is None else version(g)
                                                 for g in grads]
        batch = _Batch(params, grads, versions, self.epoch, check)
        if weak:
            batch.weaken()
        else:
            self._strong = True
        self._batches.append(batch)

    def weaken(self) -> None:
        """From now on hold no gradient alive (a backward or a forward may follow
        before the next update())."""
        if self._strong:
            for b in self._batches:
                b.weaken()
            self._strong = False

    def begin_backward(self, params: list[Any], version: Version) -> list[Any]:
        """A scaled backward pass into the gradients of ``params`` is about to run (the
        scaler's own: ``backward(gm, loss)``): returns the gradients that still hold the
        values a check unscaled (``held``), then ends the records of ``params``
        (``forget``) and moves the epoch (``new_backward``), in one call.

        Raises:
            RuntimeError: a gradient mixes unscaled and scaled values (``MIXED``).
        """
        held: list[Any] = []
        if self._batches:
            if not all(map(_is_none, map(_grad_of, params))):  # (usually all cleared)
                held = self.held(params, version)
            self.forget(params)
        self.new_backward(version)
        return held

    def forget(self, params: list[Any]) -> None:
        """Ends the records of ``params`` (a backward through them is about to run)."""
        if not self._batches:
            return
        key = tuple(map(id, params))
        kept = [b for b in self._batches if b.key != key]
        self._batches = kept
        if kept:
            self._forget_ids(set(key))

    def _forget_ids(self, ids: set[int]) -> None:
        kept = []
        for b in self._batches:
            if ids.isdisjoint(b.key):
                kept.append(b)
                continue
            grads = list(b.grads)
            for j, k in enumerate(b.key):
                if k in ids:
                    grads[j] = _ABSENT
            if any(g is not _ABSENT for g in grads):
                b.grads = grads
                kept.append(b)
        self._batches = kept

    def answers(self, params: list[Any], grads: list[Any], version: Version) -> list[Any]:
        """Per parameter: the check that unscaled its current gradient ``grads[i]``;
        None if that gradient is a new generation; ``MIXED`` if a backward accumulated
        into it since it was unscaled. Only called while some batch exists."""
        out: list[Any] = [None] * len(params)
        todo = list(range(len(params)))
        key = None
        for b in reversed(self._batches):  # the newest record of a parameter decides
            if not todo:
                break
            if key is None:
                key = tuple(map(id, params))
            if b.key == key:  # the same parameter list: compare position by position
                if b.weak:
                    pairs = [(i, i) for i in todo if b.param(i, params[i])]
                else:
                    pairs = [(i, i) for i in todo]
            else:
                pairs = []
                for i in todo:
                    j = b.position(params[i])
                    if j is not None:
                        pairs.append((i, j))
            decided = set()
            for i, j in pairs:
                rg = b.grad(j)
                if rg is _ABSENT:
                    continue
                decided.add(i)
                out[i] = self._answer(b, j, rg, grads[i], version)
            if decided:
                todo = [i for i in todo if i not in decided]
        return out

    def _answer(self, b: _Batch, j: int, recorded: Any, g: Any, version: Version) -> Any:
        if recorded is None:  # dropped (or agreed without one): valid until a backward
            return b.check if g is None and b.epoch == self.epoch else None
        if g is not recorded:
            return None  # another gradient object: a new generation
        if b.epoch == self.epoch:
            return b.check  # no scaled backward since: still the unscaled generation
        if b.versions is not None and version(g) == b.versions[j]:
            return b.check  # a backward ran, but did not write to this gradient
        return MIXED  # the record is kept: every later unscale of it must refuse too

    def empty(self) -> bool:
        return not self._batches

    def split(self, params: list[Any], version: Version) -> Split:
        """``params`` whose current gradient is a new generation, and those gradients;
        the checks that unscaled the others; the params without a gradient. With no
        record alive (the usual step), one pass and no lookups: ``by_grad``.

        Raises:
            RuntimeError: a gradient mixes unscaled and scaled values (``MIXED``).
        """
        if not self._batches:
            return by_grad(params)
        grads = [p.grad for p in params]
        pending, pending_grads, done, idle, mixed = [], [], {}, [], 0
        for p, g, check in zip(params, grads, self.answers(params, grads, version)):
            if check is MIXED:
                mixed += 1
            elif check is not None:
                done[id(check)] = check
            elif g is not None:
                pending.append(p)
                pending_grads.append(g)
            else:
                idle.append(p)
        if mixed:
            raise _mixed_error(mixed, len(params))
        return Split(pending, pending_grads, list(done.values()), idle)

    def held(self, params: list[Any], version: Version) -> list[Any]:
        """The gradients of ``params`` that still hold the values a check unscaled.

        Raises:
            RuntimeError: a gradient mixes unscaled and scaled values (``MIXED``).
        """
        if not self._batches:
            return []
        grads = [p.grad for p in params]
        if all(map(_is_none, grads)):
            # The usual automatic-mode step (the optimizer cleared the gradients): a
            # None gradient holds nothing and cannot mix, whatever the records say.
            return []
        held, mixed = [], 0
        for g, check in zip(grads, self.answers(params, grads, version)):
            if check is MIXED:
                mixed += 1
            elif check is not None and g is not None:
                held.append(g)  # (a gradient dropped on overflow holds nothing)
        if mixed:
            raise _mixed_error(mixed, len(params))
        return held


def by_grad(params: list[Any]) -> Split:
    """``split`` where the ledger has nothing to say: ``params`` with a gradient and
    those gradients, no checks, and ``params`` without one."""
    grads = list(map(_grad_of, params))
    if not any(map(_is_none, grads)):  # (not `None in`: that calls __eq__)
        return Split(params, grads, [], [])
    return Split([p for p, g in zip(params, grads) if g is not None],
                 [g for g in grads if g is not None], [],
                 [p for p, g in zip(params, grads) if g is None])


def _no_version(grad: Any) -> None:
    """The version counter of a framework without one."""
    return None


_is_none = functools.partial(operator.is_, None)
_grad_of = operator.attrgetter("grad")  # (map() with it: no Python frame per parameter)
_is_absent = functools.partial(operator.is_, _ABSENT)


def _mixed_error(mixed: int, total: int) -> RuntimeError:
    return RuntimeError(
        f"{mixed} of the {total} gradients were unscaled, then a backward pass added"
        f" scaled gradients to them before update(): they now mix unscaled and scaled"
        f" values, and no unscale can fix that. When accumulating micro-batches, unscale"
        f" once, after the last backward, or accumulate with scaler.backward(gm, loss),"
        f" which rescales what it already unscaled (if you zeroed the gradients in place"
        f" between iterations without calling update(), set them to None instead)."
    )
