"""Automatic-mode accumulation on torch (``scaler.backward(gm, loss)`` per micro-batch,
each unscaling), against torch.amp's way of accumulating: ``scaler.scale(loss)
.backward()`` per micro-batch and one ``step``/``update``. torch.amp has no automatic
mode; its manual accumulation is the sum that ours must reproduce, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp

from .test_torch_loops import data, mlp, state_bytes


def loss_of(model, step, micro, n_micro):
    x, y = data(step, micro)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(model(x), y) / n_micro


def torch_amp_accumulation(n_micro, steps=3):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    grads = []
    for step in range(steps):
        for m in range(n_micro):
            scaler.scale(loss_of(model, step, m, n_micro)).backward()
        scaler.unscale_(opt)
        grads.append([p.grad.clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return state_bytes([model], [opt]), grads


def automatic_accumulation(n_micro, update_scale, steps=3):
    """The automatic mode: every micro-batch unscales; with update_scale=True every one
    also updates (basecore's Solver); the optimizer's own step after the last."""
    model = mlp()
    gm = amp.GradManager(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = amp.GradScaler("cpu", init_scale=2.0**8)
    grads = []
    for step in range(steps):
        for m in range(n_micro):
            with gm:
                scaler.backward(gm, loss_of(model, step, m, n_micro),
                                update_scale=update_scale)
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if not update_scale:
            scaler.update()
        gm.zero_grad()
    return state_bytes([model], [opt]), grads


@pytest.mark.parametrize("update_scale", [False, True], ids=["update-once", "update-each"])
@pytest.mark.parametrize("n_micro", [2, 4])
def test_automatic_accumulation_equals_torch_amp_manual_accumulation(n_micro, update_scale):
    native, native_grads = torch_amp_accumulation(n_micro)
    ours, our_grads = automatic_accumulation(n_micro, update_scale)
    assert ours == native
    for a, b in zip(native_grads, our_grads):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_basecore_loop_equals_torch_amp_accumulating_four_micro_batches():
    """backward every iteration, opt.step() every 4th: 12 iterations, 3 steps."""
    native, _ = torch_amp_accumulation(4)
    model = mlp()
    gm = amp.GradManager(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = amp.GradScaler("cpu", init_scale=2.0**8)
    for it in range(12):
        with gm:
            scaler.backward(gm, loss_of(model, it // 4, it % 4, 4))
        if it % 4 == 3:
            opt.step()
            gm.zero_grad()
    assert state_bytes([model], [opt]) == native
    assert scaler.stats()["steps"] == 12
