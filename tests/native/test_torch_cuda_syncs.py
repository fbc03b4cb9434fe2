"""Host syncs on CUDA, counted by torch's own sync debugger: one per optimizer step with
ordinary optimizers, none with fused ones (torch.amp's own behaviour), and none added by
the telemetry. These need a GPU; on a CPU-only machine they skip with that reason."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import unified_amp as amp

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch sees none); run on the GPU machine")


def make(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10)).cuda()
    if fused == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    elif fused == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    elif fused == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    return model, opt, x, y


def step(model, opt, x, y, scaler, gm, mode):
    with amp.autocast(dtype="float16"):
        with gm:
            loss = F.cross_entropy(model(x), y)
            if mode == "automatic":
                scaler.backward(gm, loss, update_scale=False)
            else:
                gm.backward(scaler.scale(loss))
    scaler.step(opt)
    scaler.update()
    scaler.stats()
    gm.zero_grad()


def count_syncs(fn, n):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(n):
                fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("mode", ["manual", "automatic"])
def test_one_sync_per_step_with_an_ordinary_optimizer(mode):
    model, opt, x, y = make(None)
    scaler, gm = amp.GradScaler(), amp.GradManager(model.parameters())
    for _ in range(2):  # warm-up: lazy allocations and autocast caches
        step(model, opt, x, y, scaler, gm, mode)
    assert count_syncs(lambda: step(model, opt, x, y, scaler, gm, mode), 5) == 5


@pytest.mark.parametrize("fused", ["adam", "adamw", "sgd"])
def test_no_sync_at_all_with_fused_optimizers(fused):
    model, opt, x, y = make(fused)
    scaler, gm = amp.GradScaler(), amp.GradManager(model.parameters())
    for _ in range(2):
        step(model, opt, x, y, scaler, gm, "manual")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any sync raises
    try:
        for _ in range(5):
            step(model, opt, x, y, scaler, gm, "manual")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    stats = scaler.stats()
    assert stats["steps"] == 7 and stats["as_of_step"] <= 7
    assert scaler.get_scale() == 2.0**16  # a sync here is fine: it is asked for


def test_native_torch_amp_has_the_same_sync_counts():
    """The reference point: torch.amp's own scaler syncs once per step here too."""
    model, opt, x, y = make(None)
    scaler = torch.amp.GradScaler("cuda")

    def native_step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    native_step()
    assert count_syncs(native_step, 5) == 5
