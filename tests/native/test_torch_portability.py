"""Code that trains on torch but not on MegEngine is told so: torch's own
``loss.backward()`` inside ``with gm:`` of an ``amp.GradManager`` (MegEngine's tensors
have no ``backward()``) warns ``amp.PortabilityWarning``, naming ``gm.backward(loss)``.
A plain torch loop, which uses no GradManager, is left alone, and so is every form that
runs on both backends."""

import warnings

import pytest
import torch

import unified_amp as amp


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.randn(4, 3)


@pytest.mark.parametrize("grads_before", ["none", "zeros"])
@pytest.mark.parametrize("form", ["loss.backward()", "scaler.scale(loss).backward()"])
def test_frameworks_own_backward_inside_the_block_warns(form, grads_before):
    model, x = model_and_data()
    gm, scaler = amp.GradManager(model.parameters()), amp.GradScaler()
    if grads_before == "zeros":  # accumulated into in place: only the version moves
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    with pytest.warns(amp.PortabilityWarning, match=r"gm\.backward\(loss\)") as caught:
        with gm:
            loss = model(x).pow(2).mean()
            (scaler.scale(loss) if "scale" in form else loss).backward()
    assert len(caught) == 1
    assert caught[0].filename == __file__  # it points at the user's block
    assert "MegEngine" in str(caught[0].message)
    assert all(p.grad is not None for p in model.parameters())  # it still trains on torch


def test_the_portable_forms_do_not_warn():
    model, x = model_and_data()
    gm, scaler = amp.GradManager(model.parameters()), amp.GradScaler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # accumulating across blocks
            with gm:
                gm.backward(model(x).pow(2).mean())
        with gm:
            gm.backward(scaler.scale(model(x).pow(2).mean()))
        scaler.unscale(gm)
        scaler.update()
        with gm:
            scaler.backward(gm, model(x).pow(2).mean())
        with gm:  # a block with no backward at all (a forward to log)
            model(x)
        gm.zero_grad()


def test_a_plain_torch_loop_is_left_alone():
    """No GradManager: torch.amp's loop through our scaler, unchanged and silent, also
    with a GradManager of other parameters recording at the same time."""
    model, x = model_and_data()
    other = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu")
    gm = amp.GradManager(other.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        with gm:
            model(x).pow(2).mean().backward()


def test_new_gradient_objects_are_compared_by_identity():
    """zero_grad() then loss.backward() inside the block: gradients before and after
    are different tensors (compared by identity: == on tensors compares elements)."""
    model, x = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    gm = amp.GradManager(model.parameters())
    with pytest.warns(amp.PortabilityWarning):
        with gm:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
