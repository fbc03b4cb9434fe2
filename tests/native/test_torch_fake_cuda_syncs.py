"""Host syncs per CUDA step, counted on fake CUDA tensors (tests/fake_cuda.py) in every
CI run: each ``item()`` of a CUDA tensor and each blocking copy to the host that the
step dispatches is one sync on a GPU. torch.amp's own scaler is counted side by side.
On a GPU, tests/native/test_torch_cuda_syncs.py counts the same with torch's sync
debugger.

The bounds (docs/DESIGN.md, Host syncs): one per step with an ordinary optimizer,
none with a fused one, none from ``stats()``; a step that overflows adds one read for
its report, two syncs in all.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp

from ..fake_cuda import fake_cuda, fc  # noqa: F401 (fc is a fixture)

pytestmark = pytest.mark.fake_cuda

OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "fused-adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "fused-adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "fused-sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True),
    # reads one flag until its first step is taken (torch's empty_like momentum buffers:
    # docs/DROP_IN.md); syncs_per_step counts the steps after that first one
    "fused-sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}
STEPS = 4


def setup(fc, optimizer):
    model = fc.module(lambda: torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    x = fc.tensor((32, 64))
    y = torch.zeros(32, dtype=torch.long, device="cuda")
    return model, OPTIMIZERS[optimizer](model.parameters()), x, y


def fake_backward(model):
    """What ``loss.backward()`` leaves behind (fake_cuda bypass 5: no autograd)."""
    for p in model.parameters():
        p.grad = torch.empty_like(p)


def unified_step(model, opt, x, y, scaler, style):
    with amp.autocast(dtype="float16"):
        loss = F.cross_entropy(model(x), y)
    if style == "megengine-style":  # gm.backward(loss, dy=scale_factor); unscale(grads)
        scaler.scale_factor
        fake_backward(model)
        scaler.unscale(list(model.parameters()))
        opt.step()
    else:  # scale(loss).backward(); [unscale_(opt)]; step(opt)
        scaler.scale(loss)
        fake_backward(model)
        if style == "unscale_-then-step":
            scaler.unscale_(opt)
        scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def native_step(model, opt, x, y, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss)
    fake_backward(model)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def syncs_per_step(fc, step):
    step()  # the first step sets things up (the device-resident scale, lazy tensors)
    fc.syncs.reset()
    for _ in range(STEPS):
        step()
    return fc.syncs.n / STEPS


@pytest.mark.parametrize("style", ["torch-style", "unscale_-then-step", "megengine-style"])
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
def test_fake_cuda_one_sync_per_step_with_an_ordinary_optimizer(optimizer, style):
    with fake_cuda() as fc:
        model, opt, x, y = setup(fc, optimizer)
        scaler = amp.GradScaler()
        ours = syncs_per_step(fc, lambda: unified_step(model, opt, x, y, scaler, style))
        assert fc.syncs.events[-1] == "item() of a torch.float32 CUDA tensor"  # the flag
    with fake_cuda() as fc:
        model, opt, x, y = setup(fc, optimizer)
        scaler = torch.amp.GradScaler("cuda")
        native = syncs_per_step(fc, lambda: native_step(model, opt, x, y, scaler))
    assert (ours, native) == (1, 1)


@pytest.mark.parametrize("optimizer", ["fused-adam", "fused-adamw", "fused-sgd",
                                       "fused-sgd-momentum"])
def test_fake_cuda_no_sync_with_fused_optimizers(optimizer):
    with fake_cuda() as fc:
        model, opt, x, y = setup(fc, optimizer)
        scaler = amp.GradScaler()

        def step():
            unified_step(model, opt, x, y, scaler, "torch-style")
            scaler.stats()

        ours = syncs_per_step(fc, step)
        fc.syncs.reset()
        scaler.get_scale()  # asking for the device's value is a sync, as in torch.amp
        asked = fc.syncs.n
    with fake_cuda() as fc:
        model, opt, x, y = setup(fc, optimizer)
        scaler = torch.amp.GradScaler("cuda")
        native = syncs_per_step(fc, lambda: native_step(model, opt, x, y, scaler))
    assert (ours, native, asked) == (0, 0, 1)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "fused-adam"])
def test_fake_cuda_stats_never_syncs(fc, optimizer):
    model, opt, x, y = setup(fc, optimizer)
    scaler = amp.GradScaler()
    for _ in range(2):
        unified_step(model, opt, x, y, scaler, "torch-style")
    fc.syncs.reset()
    for _ in range(3):
        stats = scaler.stats()
    assert fc.syncs.n == 0
    assert stats["steps"] == 2


def overflow(t):
    return 1  # every read says "inf": the flag is set and every count is non-zero


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("watched", [False, True], ids=["unwatched", "watched"])
def test_fake_cuda_an_overflow_step_adds_one_read_for_its_report(watched, traced):
    with fake_cuda(value=overflow) as fc:
        model, opt, x, y = setup(fc, "sgd-momentum")
        scaler = amp.GradScaler()
        if watched:
            scaler.watch(model)
        with amp.trace_forward(model) if traced else contextlib.nullcontext():
            per_step = syncs_per_step(
                fc, lambda: unified_step(model, opt, x, y, scaler, "torch-style"))
        report = scaler.last_overflow()
    assert per_step == 2, fc.syncs.events  # the verdict, then the report's one read
    assert scaler.stats()["skipped_steps"] == 1 + STEPS
    assert report.checked == 4 and len(report.gradients) == 4 and report.traced == traced
    names = [g.name for g in report.gradients]
    assert names == (["0.bias", "0.weight", "2.bias", "2.weight"] if watched or traced
                     else ["param[0]", "param[1]", "param[2]", "param[3]"])
