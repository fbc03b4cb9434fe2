"""apex-style torch code, unchanged but for the import: ``scaled_loss.backward()``, the
GAN that reuses ``d_fake``'s graph with ``retain_graph=True``, a torch LR scheduler, a
fused optimizer stepping the masters, ``copy.deepcopy`` of an initialized model."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import unified_amp as amp


@pytest.fixture(autouse=True)
def _torch_backend():
    amp.set_backend("torch")
    yield


def generator(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def discriminator(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_single_generator_pattern(level):
    """initialize(..., num_losses=1) and scale_loss(..., loss_id=0), as apex code has it."""
    model = generator()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, num_losses=1,
                                      low_dtype="bfloat16")
    torch.manual_seed(2)
    x, target = torch.randn(32, 4), torch.randn(32, 2)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        with amp.scale_loss(loss, optimizer, loss_id=0) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def gan_iteration(model_d, model_g, opt_d, opt_g, real, z):
    """The seed's GAN step: D and G share d_fake's graph (retain_graph=True)."""
    opt_d.zero_grad()
    fake = model_g(z)
    d_fake = model_d(fake)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    loss_d = F.binary_cross_entropy_with_logits(model_d(real), ones) + \
        F.binary_cross_entropy_with_logits(d_fake, zeros)
    with amp.scale_loss(loss_d, opt_d, loss_id=0) as scaled_loss:
        scaled_loss.backward(retain_graph=True)
    opt_d.step()
    opt_g.zero_grad()
    loss_g = F.binary_cross_entropy_with_logits(d_fake, ones)
    with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled_loss:
        scaled_loss.backward()
    opt_g.step()


def test_gan_pattern_with_retain_graph_at_o1():
    d, g = discriminator(), generator()
    opt_d = torch.optim.Adam(d.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
    [model_d, model_g], [opt_d, opt_g] = amp.initialize([d, g], [opt_d, opt_g],
                                                        opt_level="O1", num_losses=2)
    torch.manual_seed(3)
    for i in range(4):
        real = torch.randn(16, 2)
        if i == 2:
            real[0, 0] = float("inf")  # an overflow planted in D's loss
        d_before = [p.detach().clone() for p in model_d.parameters()]
        g_before = [p.detach().clone() for p in model_g.parameters()]
        gan_iteration(model_d, model_g, opt_d, opt_g, real, torch.randn(16, 4))
        d_same = all(torch.equal(a, b) for a, b in zip(d_before, model_d.parameters()))
        assert d_same == (i == 2)
        assert not all(torch.equal(a, b) for a, b in zip(g_before, model_g.parameters()))
    assert amp.loss_scaler(0).stats()["skipped_steps"] == 1
    assert amp.loss_scaler(1).stats()["skipped_steps"] == 0
    assert amp.loss_scaler(0).get_scale() == 2.0**15
    assert amp.loss_scaler(1).get_scale() == 2.0**16


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_gan_pattern_reusing_the_graph_after_d_steps_raises_where_apex_does(level):
    """At O1, autocast saved low-precision copies of D's weights for the backward, so G's
    backward through d_fake works after D's in-place step. At O0 (and O2) the graph
    holds D's weights themselves, which the step changed: torch refuses, as under apex."""
    d, g = discriminator(), generator()
    opt_d = torch.optim.Adam(d.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
    [model_d, model_g], [opt_d, opt_g] = amp.initialize([d, g], [opt_d, opt_g],
                                                        opt_level=level, num_losses=2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        gan_iteration(model_d, model_g, opt_d, opt_g, torch.randn(16, 2),
                      torch.randn(16, 4))


def test_lr_scheduler_wraps_the_amp_step():
    model = generator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                      low_dtype="bfloat16")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x = torch.randn(8, 4)
    with amp.scale_loss(model(x).square().mean(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()  # through the scheduler's wrapper and amp's
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.05
    assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))


def test_fused_adam_steps_the_masters():
    model = generator()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                      low_dtype="bfloat16")
    first = model[0].weight.detach().clone()
    with amp.scale_loss(model(torch.randn(8, 4)).square().mean(), optimizer) as s:
        s.backward()
    optimizer.step()
    master = list(amp.master_params(optimizer))[0]
    assert torch.equal(model[0].weight, master.detach().to(torch.bfloat16))
    assert not torch.equal(model[0].weight, first)


def test_deepcopy_of_an_initialized_model_runs_its_own_weights():
    model = generator()
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1),
                              opt_level="O2", low_dtype="bfloat16")
    twin = copy.deepcopy(model)  # e.g. an EMA copy
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    model.eval()
    twin.eval()
    x = torch.randn(3, 4)
    assert torch.count_nonzero(model(x)) > 0
    assert torch.count_nonzero(twin(x)) == 0
    assert twin(x).dtype == torch.float32


def test_a_block_without_backward_after_an_overflow_is_a_clean_empty_step():
    """torch tells the scaler when a backward runs through its scaled loss; a block that
    runs none must not look like a second unscale of the overflowed (dropped) grads."""
    model = generator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    x = torch.randn(8, 4)
    x[0, 0] = float("inf")
    with amp.scale_loss(model(x).square().mean(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    with amp.scale_loss(model(torch.randn(8, 4)).square().mean(), optimizer):
        pass
    stats = amp.loss_scaler().stats()
    assert (stats["steps"], stats["skipped_steps"], stats["last_step_skipped"]) == (2, 1, False)


def _stale_gan(level="O1"):
    d, g = discriminator(), generator()
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    [model_d, model_g], [opt_d, opt_g] = amp.initialize([d, g], [opt_d, opt_g],
                                                        opt_level=level, num_losses=2)
    torch.manual_seed(4)
    noise, real = torch.randn(16, 4), torch.randn(16, 2)
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    # docs/APEX.md's GAN example before the fix: G's output not detached for D's loss,
    # G's gradients never zeroed.
    d_fake = model_d(model_g(noise))
    loss_d = F.binary_cross_entropy_with_logits(d_fake, zeros) + \
        F.binary_cross_entropy_with_logits(model_d(real), ones)
    with amp.scale_loss(loss_d, opt_d, loss_id=0) as scaled_loss:
        scaled_loss.backward(retain_graph=True)
    opt_d.step()
    return model_g, opt_g, F.binary_cross_entropy_with_logits(d_fake, ones)


def test_gradients_a_block_scaled_for_another_optimizer_are_refused_before_any_use():
    """The backward of scale_loss(loss_D, opt_D, loss_id=0) also fills G's gradients,
    scaled by scale 0; nothing unscales them. G's scale_loss would set them aside as
    true-scale and add them (G stepping on gradients 2.9e5 times too large): it raises,
    naming the optimizer, the parameters and the fix."""
    model_g, opt_g, loss_g = _stale_gan()
    g_before = [p.detach().clone() for p in model_g.parameters()]
    msg = r"SGD \(optimizer 1 of amp.initialize\) \(model 1: 0.weight, .*loss_id=0.*detach"
    with pytest.raises(RuntimeError, match=msg):
        with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled_loss:
            scaled_loss.backward()
    with pytest.raises(RuntimeError, match="zero this optimizer's gradients"):
        opt_g.step()  # stepping on them directly is refused too
    assert all(torch.equal(a, b) for a, b in zip(g_before, model_g.parameters()))


def test_zeroing_the_stale_gradients_lets_the_step_go_on():
    for set_to_none in (True, False):
        model_g, opt_g, loss_g = _stale_gan()
        opt_g.zero_grad(set_to_none=set_to_none)
        with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled_loss:
            scaled_loss.backward()
        got = torch.cat([p.grad.flatten() for p in model_g.parameters()])
        opt_g.step()
        # only G's own loss: the gradient of a float32 backward of G's loss alone (the
        # same models and data, D as it was before its step), within bfloat16's error
        d, g = discriminator(), generator()
        torch.manual_seed(4)
        noise = torch.randn(16, 4)
        F.binary_cross_entropy_with_logits(d(g(noise)), torch.ones(16, 1)).backward()
        want = torch.cat([p.grad.flatten() for p in g.parameters()])
        assert abs(got.norm() / want.norm() - 1) < 0.05, (got.norm(), want.norm())


def test_o1_casts_a_cpu_model_where_torch_also_sees_a_gpu(monkeypatch):
    """Where torch sees a GPU, a block with no device covers CUDA alone (docs/API.md,
    "Devices"); O1's forward autocasts on the model's own device, so a CPU model there
    still computes its linears in the low dtype. Only the adapter is told of a GPU, as
    test_torch_compile's GPU-machine test does."""
    from unified_amp.backends.torch_backend import autocast as torch_autocast

    monkeypatch.setattr(torch_autocast, "devices", lambda device, enabled: (
        [device] if device else ["cuda"] if enabled else ["cpu", "cuda"]))
    model = generator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", low_dtype="bfloat16")
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model(torch.randn(8, 4))
    assert seen == [torch.bfloat16]
