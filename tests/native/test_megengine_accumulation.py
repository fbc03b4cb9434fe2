"""Automatic-mode accumulation on MegEngine, beside megengine.amp: several
``scaler.backward(gm, loss)`` calls into the same gradients before the optimizer steps
-- basecore's ``Solver.minimize(..., step_grad=iter % 4 == 0)`` loop.

megengine.amp unscales the mix of held (unscaled) and new (scaled) gradients; ours brings
the held ones back to the scale first and gives the true sum (docs/DROP_IN.md)."""

import megengine as mge
import megengine.amp
import megengine.functional as F
import megengine.optimizer as optim
import numpy as np
import pytest
from megengine.autodiff import GradManager

import unified_amp

from .test_megengine_dropin import batch, model_and_data

NATIVE, OURS = megengine.amp.GradScaler, unified_amp.GradScaler


def unit_gradients(GradScaler, n_micro):
    """n micro-batches whose gradient is 1.0 each, scale 4, one update at the end."""
    w = mge.Parameter(np.zeros(2, "float32"))
    gm = GradManager().attach([w])
    scaler = GradScaler(init_scale=4.0)
    for _ in range(n_micro):
        with gm:
            scaler.backward(gm, (w * 1.0).sum(), update_scale=False)
    scaler.update()
    return w.grad.numpy().tolist()


@pytest.mark.parametrize("n_micro,native_value", [(2, 1.25), (4, 1.328125)])
def test_automatic_accumulation_gives_the_sum_where_megengine_amp_mixes(n_micro,
                                                                        native_value):
    # megengine.amp: after k micro-batches g_k = (g_{k-1} + 4) / 4
    assert unit_gradients(NATIVE, n_micro) == [native_value] * 2
    assert unit_gradients(OURS, n_micro) == [float(n_micro)] * 2


def solver_loop(GradScaler, accumulate, iters=12, overflow_at=()):
    """basecore's Solver.minimize, inlined: autocast, ``scaler.backward(gm, loss)`` with
    its defaults every iteration, ``opt.step().clear_grad()`` when ``step_grad``.
    ``accumulate="manual"`` is the correct megengine.amp form: unscale_grad=False on all
    but the last micro-batch of each step."""
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(init_scale=2.0**4)
    for it in range(1, iters + 1):
        step_grad = it % 4 == 0
        x, y = batch(batches, it, it in overflow_at)
        with gm:
            with megengine.amp.autocast():
                loss = F.nn.cross_entropy(model(x), y) * 0.25
                if accumulate == "automatic" or step_grad:
                    scaler.backward(gm, loss)
                else:
                    scaler.backward(gm, loss, unscale_grad=False)
        if step_grad:
            opt.step().clear_grad()
    return [p.numpy().tobytes() for p in model.parameters()]


def test_basecore_solver_loop():
    reference = solver_loop(NATIVE, "manual")  # megengine.amp, accumulating correctly
    assert solver_loop(OURS, "automatic") == reference
    assert solver_loop(OURS, "manual") == reference
    assert solver_loop(NATIVE, "automatic") != reference  # megengine.amp's mix
