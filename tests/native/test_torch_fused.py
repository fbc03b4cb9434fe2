"""torch's fused optimizers (Adam/AdamW/SGD with fused=True) skip an overflowed step on
the device, reading grad_scale/found_inf tensors; unified_amp then keeps its scale on
the device too, so the step needs no host sync. These run on CPU (torch's fused kernels
exist there too); tests/native/test_torch_cuda_syncs.py proves the no-sync part on CUDA."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import unified_amp
from unified_amp import get_backend

from ..reference import trajectory

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    # fused SGD with momentum leaves its momentum buffer uninitialised when its very first
    # step is skipped (a torch bug, torch.amp hits it too), so this one has no momentum
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True),
}


def loop(GradScaler, make_opt, overflow_at=(2, 3, 7), unscale_at=(5, 6), ckpt_at=4,
         steps=12, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = make_opt(list(model.parameters()))
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    history = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step in overflow_at:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step in unscale_at:  # explicit unscale_ + clipping, then the fused step
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(scaler.get_scale())
        if step == ckpt_at:
            state = copy.deepcopy(scaler.state_dict())
            scaler = GradScaler("cpu")
            scaler.load_state_dict(state)
    weights = [p.detach().numpy().tobytes() for p in model.parameters()]
    states = [np.asarray(v).tobytes() for s in opt.state.values() for _, v in sorted(s.items())]
    return weights, states, history


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_optimizers_match_torch_amp_bit_for_bit(name):
    native, ours = loop(NATIVE, OPTIMIZERS[name]), loop(OURS, OPTIMIZERS[name])
    assert native[2] == ours[2]
    assert native[0] == ours[0]
    assert native[1] == ours[1]
    assert min(native[2]) < max(native[2])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_steps_never_read_a_flag_or_the_scale_back(name, monkeypatch):
    """The CPU stand-in for 'no device-to-host sync': during the loop the scaler never
    reads a found-inf flag or the device scale on the host."""
    backend = get_backend()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = OPTIMIZERS[name](list(model.parameters()))
    scaler = OURS(init_scale=2.0**8, growth_interval=2)
    reads = []
    monkeypatch.setattr(type(backend), "flag_is_set", lambda self, flag: reads.append(flag))
    overflows = [False, True, False, False, True, False, False]
    for overflow in overflows:
        x = torch.randn(3, 4)
        if overflow:
            x[0, 0] = float("inf")
        with unified_amp.autocast(dtype="bfloat16"):
            gm = unified_amp.GradManager(model.parameters())
            with gm:
                gm.backward(scaler.scale(model(x).float().pow(2).mean()))
        scaler.step(opt)
        scaler.update()
        stats = scaler.stats()  # telemetry must not sync either
        gm.zero_grad()
    assert reads == []
    # On CPU the snapshot copies complete at once, so the telemetry is current.
    assert stats["as_of_step"] == stats["steps"] == len(overflows)
    assert stats["skipped_steps"] == sum(overflows)
    assert (scaler.get_scale(), scaler.stats()["growth_tracker"]) == \
        trajectory(2.0**8, 2.0, 0.5, 2, overflows)[-1]


def test_mixing_a_fused_and_an_ordinary_optimizer():
    """A GAN-like step: a fused Adam and a plain SGD share one scaler; only the plain
    one needs its flag on the host (one read), and results match torch.amp."""

    def run(GradScaler):
        torch.manual_seed(1)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        opt_a = torch.optim.Adam(a.parameters(), lr=1e-2, fused=True)
        opt_b = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
        scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        scales = []
        for step in range(8):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            if step in (1, 4):
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = b(a(x)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            opt_a.zero_grad()
            opt_b.zero_grad()
            scales.append(scaler.get_scale())
        return [p.detach().numpy().tobytes() for p in [*a.parameters(), *b.parameters()]], scales

    assert run(NATIVE) == run(OURS)


def test_device_mode_state_dict_and_new_scale():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = OURS(init_scale=64.0, growth_interval=100)
    for _ in range(3):
        scaler.scale(model(torch.randn(2, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.state_dict()["_growth_tracker"] == 3
    scaler.update(new_scale=8.0)  # allowed: new_scale needs no unscale
    assert scaler.get_scale() == 8.0
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 99})
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler.state_dict()["_growth_tracker"]) == (16.0, 0)


def test_telemetry_snapshots_do_not_pile_up_without_stats_calls():
    """Each update() takes an asynchronous snapshot; a run that never calls stats() must
    keep only the copies still in flight, not one per step."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = OURS(init_scale=64.0)
    for _ in range(50):
        scaler.scale(model(torch.randn(2, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert len(scaler.adapter_view.device_scale._in_flight) <= 1  # on CPU every copy has landed at once
    assert scaler.stats()["as_of_step"] == 50
