"""One loop written once against unified_amp, mixing the modes a portable codebase mixes:
automatic mode followed by ``scaler.step(opt)`` (a torch user's habit), then manual-mode
accumulation with clipping. Both backends must give the reference model's scale
trajectory and skip exactly the planted overflows, leaving skipped weights bit-identical.

Also the misuse that would otherwise shrink gradients silently: each raises, on both
backends, and leaves the gradients as they were."""

import numpy as np
import pytest

import unified_amp as amp

from ..reference import trajectory
from .loops import Problem, bits

AUTOMATIC_OVERFLOWS = [False, False, True, False, False, False, True, False, False, False]
MANUAL_OVERFLOWS = [False, True, False, False]  # one bad micro-batch in the second step
MICRO = 4


def portable_loop(kit, device, problem):
    gm, opt = amp.GradManager(problem.params), kit.sgd(problem.params, 0.05, momentum=0.9)
    scaler = amp.GradScaler(init_scale=2.0**10, growth_interval=3)
    scales, skipped, unchanged = [], [], []
    for overflow in AUTOMATIC_OVERFLOWS:
        before = bits(problem.weights())
        with amp.autocast(dtype="float16", device=device):
            with gm:
                scaler.backward(gm, problem.loss(overflow))
        scaler.step(opt)  # must neither unscale again nor step an overflow
        gm.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(scaler.stats()["last_step_skipped"])
        unchanged.append(bits(problem.weights()) == before)
    norms = []
    for bad_step in MANUAL_OVERFLOWS:
        before = bits(problem.weights())
        for m in range(MICRO):
            rows = slice(4 * m, 4 * m + 4)
            with amp.autocast(dtype="float16", device=device):
                with gm:
                    gm.backward(scaler.scale(problem.loss(bad_step and m == 2, rows)))
        scaler.unscale(gm)
        norms.append(amp.clip_grad_norm(gm, max_norm=0.5) if not bad_step else None)
        scaler.step(opt)
        scaler.update()
        gm.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(scaler.stats()["last_step_skipped"])
        unchanged.append(bits(problem.weights()) == before)
    return scales, skipped, unchanged, norms


def test_portable_loop_scale_trajectory_and_skips(kit, device):
    problem = Problem(kit, device)
    scales, skipped, unchanged, norms = portable_loop(kit, device, problem)
    planted = AUTOMATIC_OVERFLOWS + MANUAL_OVERFLOWS
    assert skipped == planted
    assert unchanged == planted  # skipped steps leave every weight bit-identical
    assert scales == [s for s, _ in trajectory(2.0**10, 2.0, 0.5, 3, planted)]
    # clipping after unscale() saw true-scale gradients: a few units, not ~2**10 times more
    assert all(0.0 < n < 50.0 for n in norms if n is not None), norms


def test_portable_loop_manual_accumulation_equals_one_big_batch(kit, device):
    """The manual half of the loop, clean: 4 accumulated quarter-batch losses (each
    a mean over 4 rows, so divided by 4) give the full-batch gradient."""
    problem = Problem(kit, device)
    gm = amp.GradManager(problem.params)
    scaler = amp.GradScaler(init_scale=2.0**10)
    for m in range(MICRO):
        with amp.autocast(dtype="float16", device=device):
            with gm:
                gm.backward(scaler.scale(
                    kit.mul(problem.loss(rows=slice(4 * m, 4 * m + 4)),
                            kit.tensor(np.float32(1 / MICRO), device))))
    scaler.unscale(gm)
    accumulated = [kit.grad(p).copy() for p in problem.params]
    gm.zero_grad()
    with amp.autocast(dtype="float16", device=device):
        with gm:
            gm.backward(problem.loss())
    whole = [kit.grad(p).copy() for p in problem.params]
    for a, w in zip(accumulated, whole):
        np.testing.assert_allclose(a, w, rtol=2e-2, atol=2e-3)


# -- misuse --------------------------------------------------------------------------
def _plain_backward(problem, gm):
    with gm:
        gm.backward(problem.loss())


def test_step_after_an_unscaled_backward_raises_and_changes_nothing(kit, device):
    problem = Problem(kit, device)
    gm, opt = amp.GradManager(problem.params), kit.sgd(problem.params, 0.1)
    scaler = amp.GradScaler()
    _plain_backward(problem, gm)  # forgot scaler.scale(loss)
    grads, weights = [kit.grad(p).copy() for p in problem.params], bits(problem.weights())
    with pytest.raises(RuntimeError, match=r"did not use scaler.scale\(loss or outputs\)"):
        scaler.step(opt)
    assert bits(problem.weights()) == weights
    assert all(np.array_equal(g, kit.grad(p)) for g, p in zip(grads, problem.params))


@pytest.mark.parametrize("call", ["unscale", "unscale_"])
def test_unscale_with_nothing_scaled_raises(kit, device, call):
    problem = Problem(kit, device)
    gm, opt = amp.GradManager(problem.params), kit.sgd(problem.params, 0.1)
    scaler = amp.GradScaler()
    _plain_backward(problem, gm)
    grads = [kit.grad(p).copy() for p in problem.params]
    with pytest.raises(RuntimeError, match="nothing was scaled since the last update"):
        getattr(scaler, call)(opt if call == "unscale_" else gm)
    assert all(np.array_equal(g, kit.grad(p)) for g, p in zip(grads, problem.params))


def test_unscaling_after_an_update_needs_a_new_scaled_backward(kit, device):
    """The second iteration forgets scale(): the first iteration's scale() must not
    count for it."""
    problem = Problem(kit, device)
    gm, opt = amp.GradManager(problem.params), kit.sgd(problem.params, 0.1)
    scaler = amp.GradScaler()
    with gm:
        gm.backward(scaler.scale(problem.loss()))
    scaler.step(opt)
    scaler.update()
    gm.zero_grad()
    _plain_backward(problem, gm)
    with pytest.raises(RuntimeError, match="nothing was scaled since the last update"):
        scaler.step(opt)


def test_step_and_update_with_no_backward_at_all_raise(kit, device):
    problem = Problem(kit, device)
    opt = kit.sgd(problem.params, 0.1)
    scaler = amp.GradScaler()
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()
    assert scaler.stats()["steps"] == 0


def test_update_after_automatic_mode_explains_itself(kit, device):
    problem = Problem(kit, device)
    gm = amp.GradManager(problem.params)
    scaler = amp.GradScaler()
    with gm:
        scaler.backward(gm, problem.loss())
    with pytest.raises(RuntimeError, match="already unscaled .* called update"):
        scaler.update()
    assert scaler.stats()["steps"] == 1
