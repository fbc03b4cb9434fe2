"""megengine.amp loop patterns that the first drop-in tests did not cover, run twice:
with megengine.amp.GradScaler and with unified_amp.GradScaler. Same weights and scale
history, byte for byte; and, where the two must differ, the difference pinned down."""

import numpy as np
import pytest

import megengine as mge
import megengine.amp
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as optim
from megengine.autodiff import GradManager

import unified_amp

from .test_megengine_dropin import batch, model_and_data

NATIVE, OURS = megengine.amp.GradScaler, unified_amp.GradScaler


def weights(model):
    return [p.numpy().tobytes() for p in model.parameters()]


def backward_without_update(GradScaler, update_every=None, overflow_at=(3,)):
    """scaler.backward(gm, loss, update_scale=False) every iteration: each unscales a
    fresh generation of gradients without an update() in between."""
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=2)
    history = []
    for i in range(8):
        x, y = batch(batches, i, i in overflow_at)
        with megengine.amp.autocast():
            with gm:
                scaler.backward(gm, F.nn.cross_entropy(model(x), y), update_scale=False)
        opt.step().clear_grad()
        if update_every and i % update_every == update_every - 1:
            scaler.update()
        history.append(scaler.scale_factor)
    return weights(model), history


@pytest.mark.parametrize("update_every", [None, 2], ids=["never-update", "update-every-2"])
def test_backward_with_update_scale_false_every_iteration(update_every):
    native = backward_without_update(NATIVE, update_every)
    ours = backward_without_update(OURS, update_every)
    assert native == ours
    if update_every:
        assert len(set(native[1])) > 1  # the scale did move


def repeated_manual_unscale(GradScaler, overflow_at=(2, 5)):
    """megengine.amp's manual split, with update() only every third iteration: unscale()
    meets a new generation of gradients each time."""
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=1)
    history = []
    for i in range(9):
        x, y = batch(batches, i, i in overflow_at)
        with megengine.amp.autocast():
            with gm:
                gm.backward(F.nn.cross_entropy(model(x), y), dy=mge.tensor(scaler.scale_factor))
        scaler.unscale(gm.attached_tensors())
        opt.step().clear_grad()
        if i % 3 == 2:
            scaler.update()
        history.append(scaler.scale_factor)
    return weights(model), history


def test_repeated_unscale_of_fresh_gradients_without_update():
    native, ours = repeated_manual_unscale(NATIVE), repeated_manual_unscale(OURS)
    assert native == ours
    assert min(native[1]) < max(native[1])


def attached_intermediates(GradScaler, unscale_again):
    """The pattern of MegEngine's own scaler test: a fresh non-leaf tensor attached to
    MegEngine's GradManager (which holds it weakly) every iteration; the freed tensor
    of one iteration and the new one of the next may share an id()."""
    gm = GradManager()
    scaler = GradScaler(init_scale=2.0**4)
    x = mge.tensor(1.0)
    seen, ids = [], set()
    for _ in range(3):
        with gm:
            y = x + 1
            gm.attach(y)
            scaler.backward(gm, y * 3, unscale_grad=False)
        seen.append(float(y.grad.numpy()))
        ids.add(id(y))
        scaler.unscale(gm.attached_tensors())
        seen.append(float(y.grad.numpy()))
    if unscale_again:  # the same y.grad a second time, no backward in between
        scaler.unscale(gm.attached_tensors())
        seen.append(float(y.grad.numpy()))
    return seen


def test_attached_intermediates_held_weakly():
    native = attached_intermediates(NATIVE, unscale_again=False)
    ours = attached_intermediates(OURS, unscale_again=False)
    assert native == ours == [3.0 * 2**4, 3.0] * 3


def test_unscaling_the_same_gradient_again_raises_where_megengine_divides_twice():
    """A documented difference (docs/DROP_IN.md): megengine.amp silently divides the
    gradient by the scale a second time; unified_amp refuses."""
    native = attached_intermediates(NATIVE, unscale_again=True)
    assert native[-1] == native[-2] / 2**4  # the silent damage
    with pytest.raises(RuntimeError, match="already been called on these gradients"):
        attached_intermediates(OURS, unscale_again=True)


def test_forgetting_to_scale_raises_on_megengine_too():
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    scaler = OURS()
    x, y = batch(batches, 0, False)
    with gm:
        gm.backward(F.nn.cross_entropy(model(x), y))  # no dy=scale_factor, no scale()
    before = [p.grad.numpy().copy() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="did not use scaler.scale"):
        scaler.unscale(gm.attached_tensors())
    assert all(np.array_equal(b, p.grad.numpy()) for b, p in zip(before, model.parameters()))


def manual_with_zero_grad_in_place(GradScaler, overflow_at=(2,)):
    """megengine.amp's manual split with opt.zero_grad(), which zeroes the gradients in
    place: the next gm.backward(loss, dy=scale_factor) writes into the same objects."""
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=2)
    history = []
    for i in range(6):
        x, y = batch(batches, i, i in overflow_at)
        with megengine.amp.autocast():
            with gm:
                gm.backward(F.nn.cross_entropy(model(x), y), dy=mge.tensor(scaler.scale_factor))
        scaler.unscale(gm.attached_tensors())
        scaler.update()
        opt.step()
        opt.zero_grad()
        history.append(scaler.scale_factor)
    return weights(model), history


@pytest.mark.filterwarnings("ignore:Call to deprecated method:DeprecationWarning")
def test_gradients_zeroed_in_place_between_iterations():
    native = manual_with_zero_grad_in_place(NATIVE)
    ours = manual_with_zero_grad_in_place(OURS)
    assert native == ours
    assert min(native[1]) < max(native[1])


def test_unscaling_after_every_micro_batch_raises_where_megengine_mixes_scales():
    """Accumulating micro-batches with unscale() after each: megengine.amp returns
    gradients that mix unscaled and scaled parts (here 0.25x the true ones); we raise."""

    def run(GradScaler):
        w = mge.Parameter(np.ones(2, "float32"))
        gm = GradManager().attach([w])
        scaler = GradScaler(init_scale=4.0)
        for _ in range(2):
            with gm:
                gm.backward((w * 1.0).sum(), dy=mge.tensor(scaler.scale_factor))
            scaler.unscale([w])
        return w.grad.numpy().tolist()

    assert run(NATIVE) == [1.25, 1.25]  # the true accumulated gradient is 2.0
    # dy=scale_factor hides the second backward from the scaler: it sees the same,
    # already unscaled gradient objects
    with pytest.raises(RuntimeError, match="already been called on these gradients.*"
                                           "dy=scale_factor"):
        run(OURS)


def test_unscaling_after_every_scaled_micro_batch_raises():
    """The same with scaler.scale(): the scaler sees the second backward, and the
    error says what happened."""
    w = mge.Parameter(np.ones(2, "float32"))
    gm = GradManager().attach([w])
    scaler = OURS(init_scale=4.0)
    for i in range(2):
        with gm:
            gm.backward(scaler.scale((w * 1.0).sum()))
        if i == 0:
            scaler.unscale([w])
    with pytest.raises(RuntimeError, match="mix unscaled and scaled values"):
        scaler.unscale([w])
    assert w.grad.numpy().tolist() == [5.0, 5.0]  # untouched by the refused unscale
