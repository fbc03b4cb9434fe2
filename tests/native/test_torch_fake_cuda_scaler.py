"""The GradScaler's CUDA code paths on fake CUDA tensors (tests/fake_cuda.py): which
class it is, where its scale and flags live, the device-resident scale that fused
optimizers use, and the pinned-memory telemetry. No numbers: the loops'
values are checked on CPU (tests/native/test_torch_loops.py, test_torch_fused.py) and,
on a GPU, by the contract's ``cuda`` cases."""

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp

from ..fake_cuda import fc  # noqa: F401 (a fixture)

pytestmark = pytest.mark.fake_cuda

FUSED = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True),
}


def mlp(fc):
    return fc.module(lambda: torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))


def forward(fc, model):
    x = fc.tensor((32, 64))
    y = torch.zeros(32, dtype=torch.long, device="cuda")
    with amp.autocast(dtype="float16"):
        return F.cross_entropy(model(x), y)


def fake_backward(model):
    """What ``loss.backward()`` leaves behind (fake_cuda bypass 5: no autograd)."""
    for p in model.parameters():
        p.grad = torch.empty_like(p)


def test_fake_cuda_scaler_classes(fc):
    """Where torch sees a GPU, ``GradScaler()`` is torch.cuda.amp's class too, as
    ``GradScaler("cuda")`` is; ``GradScaler("cpu")`` is not."""
    for scaler in (amp.GradScaler(), amp.GradScaler("cuda"), amp.GradScaler("cuda:0")):
        assert isinstance(scaler, torch.cuda.amp.GradScaler)
        assert isinstance(scaler, torch.amp.GradScaler)
    assert not isinstance(amp.GradScaler("cpu"), torch.cuda.amp.GradScaler)


def test_fake_cuda_scale_and_flags_live_on_the_device(fc):
    model = mlp(fc)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = amp.GradScaler("cuda")
    assert scaler._scale.device.type == "cuda" and scaler._scale.dtype == torch.float32
    assert scaler._growth_tracker.device.type == "cuda"
    assert scaler._growth_tracker.dtype == torch.int32
    loss = forward(fc, model)
    scaled = scaler.scale(loss)
    assert (scaled.device.type, scaled.dtype) == ("cuda", torch.float32)
    fake_backward(model)
    scaler.unscale_(opt)
    flags = scaler._found_inf_per_device(opt)
    assert [d.type for d in flags] == ["cuda"]
    assert all(f.device.type == "cuda" and f.dtype == torch.float32 for f in flags.values())
    scaler.step(opt)
    scaler.update()
    assert scaler.stats()["steps"] == 1


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fake_cuda_fused_optimizers_get_the_device_resident_scale(fc, name):
    """A fused optimizer makes the scaler keep its scale on the device and hand the
    optimizer ``grad_scale``/``found_inf`` tensors there, as torch.amp does."""
    model = mlp(fc)
    opt = FUSED[name](model.parameters())
    scaler = amp.GradScaler()
    seen = []
    step = opt.step

    def spy(*args, **kwargs):
        seen.append((opt.grad_scale, opt.found_inf))
        return step(*args, **kwargs)

    opt.step = spy
    for _ in range(2):
        scaler.scale(forward(fc, model))
        fake_backward(model)
        scaler.step(opt)
        scaler.update()
    assert len(seen) == 2
    for grad_scale, found_inf in seen:
        assert (grad_scale.device.type, grad_scale.dtype) == ("cuda", torch.float32)
        assert (found_inf.device.type, found_inf.dtype) == ("cuda", torch.float32)
    assert seen[0][0] is seen[1][0] is scaler._scale  # one device tensor, kept
    assert scaler._growth_tracker.device.type == "cuda"
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_fake_cuda_telemetry_lands_through_pinned_memory_and_never_waits(fc):
    """With fused optimizers ``stats()`` reads snapshots copied asynchronously into
    pinned memory: it returns the newest one whose CUDA event has completed, and
    never waits for the others."""
    model = mlp(fc)
    opt = FUSED["adam"](model.parameters())
    scaler = amp.GradScaler()
    fc.events_done = False  # the GPU is still busy with everything recorded from now on
    for _ in range(3):
        scaler.scale(forward(fc, model))
        fake_backward(model)
        scaler.step(opt)
        scaler.update()
    assert fc.syncs.pinned == 3  # one pinned snapshot buffer per step
    stats = scaler.stats()
    assert (stats["steps"], stats["as_of_step"]) == (3, 0)  # nothing landed yet
    fc.events_done = True
    stats = scaler.stats()
    assert (stats["steps"], stats["as_of_step"]) == (3, 3)
    assert fc.syncs.n == 0  # none of this synchronized with the device
