"""Overflow forensics costs no kernel on a clean step: every aten op that torch
dispatches during clean steps is the same with a watched scaler as without one; tracing
adds its flag kernels and no host read."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import unified_amp as amp


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    return model, torch.randn(8, 8), torch.randint(0, 4, (8,))


def clean_steps(scaler, model, x, y, n=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_a_watched_scaler_dispatches_the_same_ops_on_clean_steps():
    logs = []
    # The first run warms caches (the adapter's scale tensor): the other two compare.
    for watched in (False, False, True):
        model, x, y = model_and_data()
        scaler = amp.GradScaler("cpu", init_scale=2.0**8)
        if watched:
            scaler.watch(model)
        with OpLog() as log:
            clean_steps(scaler, model, x, y)
        assert scaler.stats()["skipped_steps"] == 0
        logs.append(log.ops)
    assert logs[1] == logs[2]
    assert logs[2].count("aten._local_scalar_dense.default") == 3  # one read per step


def test_tracing_adds_flag_kernels_and_no_host_read():
    model, x, y = model_and_data()
    clean_steps(amp.GradScaler("cpu", init_scale=2.0**8), model, x, y, n=1)  # warm-up
    model, x, y = model_and_data()
    with OpLog() as plain:
        clean_steps(amp.GradScaler("cpu", init_scale=2.0**8), model, x, y)
    model, x, y = model_and_data()
    with amp.trace_forward(model), OpLog() as traced:
        clean_steps(amp.GradScaler("cpu", init_scale=2.0**8), model, x, y)
    extra = list(traced.ops)
    for op in plain.ops:
        extra.remove(op)
    # per step: one reduction each for the input (per sample, on a flattened view) and
    # the four module outputs (the model and its three layers)
    assert extra.count("aten.aminmax.default") == 3 * 5
    views = {"aten.detach.default", "aten.view.default"}  # metadata only, no kernel
    assert set(extra) - {"aten.aminmax.default"} <= views
