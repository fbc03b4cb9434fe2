"""Automatic mode over several micro-batches: ``scaler.backward(gm, loss)`` into
gradients that an earlier ``backward`` already unscaled.

The scaler brings the held gradients back to the current scale before the backward, so
the one unscale after it gives the true sum (docs/DROP_IN.md). megengine.amp unscales
the mix instead (1.25 for two micro-batches of gradient 1.0 at scale 4, where 2.0 is
right): tests/native/test_megengine_accumulation.py runs it beside ours.
"""

import numpy as np
import pytest

import unified_amp as amp

from .loops import Problem, bits


def unit_loss(kit, w, device, coeffs):
    """sum(w * coeffs): its gradient is exactly ``coeffs``."""
    return kit.total(kit.mul(w, kit.tensor(np.asarray(coeffs, np.float32), device)))


@pytest.mark.parametrize("update_scale", [False, True], ids=["update-once", "update-each"])
@pytest.mark.parametrize("n_micro", [2, 4])
def test_automatic_mode_accumulates_the_true_sum(kit, device, n_micro, update_scale):
    w = kit.param(np.zeros(3, np.float32), device)
    gm = amp.GradManager([w])
    # growth_interval=1: with update_scale=True the scale doubles after every
    # micro-batch, so the held gradients meet a different scale each time
    scaler = amp.GradScaler(init_scale=4.0, growth_interval=1)
    coeffs = [[1.0, 0.5, -3.0], [2.0, 0.25, 1.0], [-1.0, 8.0, 0.5], [0.125, 1.0, 2.0]]
    scales = []
    for i in range(n_micro):
        with gm:
            scaler.backward(gm, unit_loss(kit, w, device, coeffs[i]),
                            update_scale=update_scale)
        scales.append(scaler.get_scale())
    expected = np.sum(np.asarray(coeffs[:n_micro], np.float32), axis=0)
    assert kit.grad(w).tolist() == expected.tolist()  # exact: powers of two
    if update_scale:
        assert scales == [4.0 * 2 ** (i + 1) for i in range(n_micro)]
        assert scaler.stats()["steps"] == n_micro
    else:
        scaler.update()
        assert scaler.stats()["steps"] == 1 and scaler.get_scale() == 8.0


def basecore_loop(kit, device, accumulate, iters=12, every=4, overflow_at=()):
    """basecore's Solver.minimize: ``scaler.backward(gm, loss)`` with its defaults
    (unscale and update) every iteration, ``opt.step()`` and clearing the gradients
    every ``every``-th. ``accumulate``: how the micro-batches are summed --
    "automatic" as above, or "manual" (unscale_grad=False on all but the last)."""
    p = Problem(kit, device, n=16)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.1, momentum=0.9)
    scaler = amp.GradScaler(init_scale=2.0**10)
    for it in range(1, iters + 1):
        last = it % every == 0
        rows = slice(4 * (it % 4), 4 * (it % 4) + 4)
        with amp.autocast(dtype="float16", device=device):
            with gm:
                loss = p.loss(overflow=it in overflow_at, rows=rows)
                if accumulate == "automatic" or last:
                    scaler.backward(gm, loss)
                else:
                    scaler.backward(gm, loss, unscale_grad=False)
        if last:
            opt.step()
            gm.zero_grad()
    return bits(p.weights()), scaler.stats()


def test_basecore_style_loop_equals_unscaling_once_per_step(kit, device):
    """Unscaling and updating after every micro-batch gives, bit for bit, the weights of
    the loop that unscales once after the last micro-batch (the scale is a power of two
    and does not change here, so rescaling and unscaling are exact)."""
    automatic, stats = basecore_loop(kit, device, "automatic")
    manual, _ = basecore_loop(kit, device, "manual")
    assert automatic == manual
    assert stats["steps"] == 12 and stats["skipped_steps"] == 0


def test_an_overflowing_micro_batch_drops_what_was_accumulated_so_far(kit, device):
    """The documented edge: micro-batch 2 of 4 overflows. Its check drops the gradients
    held so far with it (as megengine.amp drops them) and backs the scale off; micro-
    batches 3 and 4 accumulate afresh, and the step applies their sum."""
    w = kit.param(np.zeros(2, np.float32), device)
    gm = amp.GradManager([w])
    scaler = amp.GradScaler(init_scale=8.0)
    coeffs = [[1.0, 2.0], [np.inf, 1.0], [0.5, 0.25], [4.0, -1.0]]
    for i, c in enumerate(coeffs):
        with gm:
            scaler.backward(gm, unit_loss(kit, w, device, c))
        if i == 1:
            assert kit.grad(w) is None
    assert kit.grad(w).tolist() == [4.5, -0.75]
    assert scaler.get_scale() == 4.0 and scaler.stats()["skipped_steps"] == 1


def test_held_non_finite_gradients_stay_non_finite_and_skip(kit, device):
    """torch.amp's unscale_ leaves an inf in .grad; a later automatic backward into it
    rescales the inf (still inf), and its check finds it: dropped, skipped, backed off."""
    w = kit.param(np.ones(2, np.float32), device)
    gm, opt = amp.GradManager([w]), kit.sgd([w], 0.1)
    scaler = amp.GradScaler(init_scale=8.0)
    with gm:
        gm.backward(scaler.scale(unit_loss(kit, w, device, [np.inf, 1.0])))
    scaler.unscale_(opt)
    with gm:
        scaler.backward(gm, unit_loss(kit, w, device, [1.0, 1.0]))
    assert kit.grad(w) is None
    assert scaler.get_scale() == 4.0 and scaler.stats()["last_step_skipped"]
    assert scaler.step(opt) is None
    assert kit.numpy(w).tolist() == [1.0, 1.0]


def test_scaled_backward_into_automatically_unscaled_gradients_is_still_refused(kit, device):
    """The manual form cannot be rescaled after the fact: gm.backward(scaler.scale(...))
    into gradients that scaler.backward already unscaled mixes them, and the next
    scaler.backward (or unscale) says so instead of unscaling the mix."""
    w = kit.param(np.ones(2, np.float32), device)
    gm = amp.GradManager([w])
    scaler = amp.GradScaler(init_scale=4.0)
    with gm:
        scaler.backward(gm, unit_loss(kit, w, device, [1.0, 1.0]), update_scale=False)
    with gm:
        gm.backward(scaler.scale(unit_loss(kit, w, device, [1.0, 1.0])))
    assert kit.grad(w).tolist() == [5.0, 5.0]
    with gm:
        with pytest.raises(RuntimeError, match="mix unscaled and scaled values"):
            scaler.backward(gm, unit_loss(kit, w, device, [1.0, 1.0]))
    assert kit.grad(w).tolist() == [5.0, 5.0]  # nothing ran
