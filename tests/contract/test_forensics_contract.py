"""Overflow forensics on the real backends: planted overflows give the same report, word
for word, on every backend; a clean step does no extra device work; the warning fires
once per run of skipped steps; tracing leaves no hook behind.

The model is three float16 ``Linear(4, ...)`` layers with constant weights chosen so that
every value is exact in float16, so the expected reports are literals. Kept tiny for
MegEngine's CPU build.
"""

import math
import warnings

import numpy as np
import pytest

import unified_amp as amp

from ..spies import record_calls
from .loops import bits


def layers(w0, w1, w2):
    """Linear(4, 4) -> Linear(4, 4) -> Linear(4, 1), every weight ``w_i``, biases 0."""
    return [(np.full((4, 4), w0, np.float32), np.zeros(4, np.float32)),
            (np.full((4, 4), w1, np.float32), np.zeros(4, np.float32)),
            (np.full((1, 4), w2, np.float32), np.zeros(1, np.float32))]


def nan_in_sample_2():
    x = np.ones((4, 4), np.float32)
    x[2, 1] = np.nan
    return x


# name: (weights, input, target). With scale 1024 and MSE against the target:
CASES = {
    # The forward pass is finite (y = 4096, target 4096 - 1/64, loss 2**-12); the scaled
    # gradient grows 4 * 128 times through layer 1 on the way back, and past 65504 in
    # layer 0's input gradient: only layer 0's parameters get inf gradients.
    "backward": (layers(1 / 16, 128, 8), np.ones((1, 4)), np.full((1, 1), 4096 - 1 / 64)),
    # Layer 1 computes 4 * 4 * 8192 = 131072 in float16: inf, and inf from there on.
    "float16": (layers(1, 8192, 1), np.ones((1, 4)), np.ones((1, 1))),
    # Sample 2 of the batch holds a NaN: NaN from layer 0 on, in every gradient.
    "nan-sample": (layers(0.25, 0.5, 0.5), nan_in_sample_2(), np.full((4, 1), 0.5)),
    # The same without the NaN, and close to the target: finite and small everywhere.
    "clean": (layers(0.25, 0.5, 0.5), np.ones((4, 4)), np.full((4, 1), 3.9375)),
}


def grads(kind, *names_shapes):
    return [{"name": n, "shape": list(s), "inf": math.prod(s) if kind == "inf" else 0,
             "nan": math.prod(s) if kind == "nan" else 0} for n, s in names_shapes]


ALL = [("0.bias", (4,)), ("0.weight", (4, 4)), ("1.bias", (4,)), ("1.weight", (4, 4)),
       ("2.bias", (1,)), ("2.weight", (1, 4))]
EXPECTED = {  # (case, traced): report.as_dict() without its line
    ("backward", True): dict(
        loss=2.0**-12, gradients=grads("inf", *ALL[:2]), first_nonfinite=None,
        bad_samples=[], cause="backward"),
    ("backward", False): dict(
        loss=2.0**-12, gradients=grads("inf", *ALL[:2]), first_nonfinite=None,
        bad_samples=[], cause="backward"),
    ("float16", True): dict(
        loss=math.inf, gradients=grads("inf", *ALL), bad_samples=[],
        first_nonfinite={"module": "1", "type": "Linear", "dtype": "float16",
                         "pin": "model[1]"},
        cause="forward-float16"),
    ("float16", False): dict(
        loss=math.inf, gradients=grads("inf", *ALL), first_nonfinite=None,
        bad_samples=[], cause="forward"),
    ("nan-sample", True): dict(
        loss=math.nan, gradients=grads("nan", *ALL), bad_samples=[2],
        first_nonfinite={"module": "0", "type": "Linear", "dtype": "float16",
                         "pin": "model[0]"},
        cause="input"),
}
LINES = {
    ("backward", True):
        "unified_amp: step 1 skipped (scale 1024, loss 0.0002441): inf/NaN gradients in 2"
        " of 6 parameters: 0.bias (4 inf of 4), 0.weight (16 inf of 16); every traced"
        " forward output was finite, so the scaled gradients overflowed in the backward"
        " pass; the scale backs off",
    ("float16", True):
        "unified_amp: step 1 skipped (scale 1024, loss inf): inf/NaN gradients in 6 of 6"
        " parameters: 0.bias (4 inf of 4), 0.weight (16 inf of 16), 1.bias (4 inf of 4),"
        " 1.weight (16 inf of 16), 2.bias (1 inf of 1) and 1 more; first non-finite"
        " forward output: 1 (Linear, float16), a float16 overflow (|x| > 65504): run it"
        " in float32 with amp.keep_float32(model[1]) or use bfloat16",
    ("nan-sample", True):
        "unified_amp: step 1 skipped (scale 1024, loss nan): inf/NaN gradients in 6 of 6"
        " parameters: 0.bias (4 NaN of 4), 0.weight (16 NaN of 16), 1.bias (4 NaN of 4),"
        " 1.weight (16 NaN of 16), 2.bias (1 NaN of 1) and 1 more; the model's input"
        " holds inf/NaN in sample(s) 2: bad data, not precision",
    ("float16", False):
        "unified_amp: step 1 skipped (scale 1024, loss inf): inf/NaN gradients in 6 of 6"
        " parameters: 0.bias (4 inf of 4), 0.weight (16 inf of 16), 1.bias (4 inf of 4),"
        " 1.weight (16 inf of 16), 2.bias (1 inf of 1) and 1 more; the loss itself is"
        " inf/NaN, so the forward pass made it; amp.trace_forward(model) finds the layer",
}


def one_step(kit, device, scaler, model, case, style):
    """One float16 training step of ``model`` on ``case``'s data, in one call form."""
    params = list(model.parameters())
    gm, opt = amp.GradManager(params), kit.sgd(params, 0.1)
    _, x, target = CASES[case]
    with gm:
        with amp.autocast(dtype="float16", device=device):
            loss = kit.mse(model(kit.tensor(x, device)), kit.tensor(target, device))
        if style == "torch-style":
            gm.backward(scaler.scale(loss))
        else:
            scaler.backward(gm, loss)
    if style == "torch-style":
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    gm.zero_grad()
    return loss


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules())


@pytest.mark.parametrize("style", ["torch-style", "megengine-style"])
@pytest.mark.parametrize("case, traced", sorted(EXPECTED))
def test_planted_overflows_give_the_same_report_on_every_backend(kit, device, case,
                                                                 traced, style):
    model = kit.linear_model(CASES[case][0], device)
    before = bits([kit.numpy(p) for p in model.parameters()])
    scaler = amp.GradScaler(init_scale=1024.0)
    if traced:
        with amp.trace_forward(model):
            one_step(kit, device, scaler, model, case, style)
    else:
        scaler.watch(model)
        one_step(kit, device, scaler, model, case, style)
    assert hook_count(model) == 0
    assert bits([kit.numpy(p) for p in model.parameters()]) == before  # skipped

    report = scaler.last_overflow().as_dict()
    line, loss = report.pop("line"), report.pop("loss")
    # one loss, the step's (tests/contract/test_new_user_mistakes_contract.py has several)
    assert (report.pop("micro_batch"), report.pop("micro_batches")) == (1, 1)
    want = dict(EXPECTED[case, traced])
    want_loss = want.pop("loss")
    assert report == dict(step=1, scale=1024.0, checked=6, traced=traced,
                          forward_in_trace=False, overflows_since_update=1, **want)
    assert loss == want_loss or (math.isnan(loss) and math.isnan(want_loss))
    if (case, traced) in LINES:
        assert line == LINES[case, traced]
    assert scaler.stats()["overflows"][-1]["line"] == line


def patch_reads(monkeypatch, kit, log):
    cls, names = kit.host_reads()
    for name in names:
        original = getattr(cls, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            log.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)


CLEAN = CASES["clean"][0]
FORENSIC = {"read_overflow", "finite_flag"}


@pytest.mark.parametrize("style", ["torch-style", "megengine-style"])
def test_a_clean_step_does_no_extra_device_work(kit, device, backend, monkeypatch, style):
    """Every adapter call and host read of a watched scaler's clean steps, in order,
    is the same as an unwatched scaler's: forensics adds nothing until an overflow."""
    logs = []
    for watched in (False, True):
        model = kit.linear_model(CLEAN, device)
        scaler = amp.GradScaler(init_scale=1024.0)
        if watched:
            scaler.watch(model)
        log = []
        record_calls(monkeypatch, backend, log)
        patch_reads(monkeypatch, kit, log)
        for _ in range(3):
            one_step(kit, device, scaler, model, "clean", style)
        monkeypatch.undo()
        assert scaler.stats()["skipped_steps"] == 0
        logs.append(log)
    assert logs[0] == logs[1]
    assert not FORENSIC & set(logs[1])
    assert logs[1].count("flag_is_set") == 3


def test_tracing_reads_nothing_back_on_a_clean_step(kit, device, backend, monkeypatch):
    model = kit.linear_model(CLEAN, device)
    scaler = amp.GradScaler(init_scale=1024.0)
    log = []
    with amp.trace_forward(model):
        record_calls(monkeypatch, backend, log)
        for _ in range(2):
            one_step(kit, device, scaler, model, "clean", "megengine-style")
        monkeypatch.undo()
    assert log.count("finite_flag") == 2 * 5  # the input and four module outputs
    assert "read_overflow" not in log
    assert scaler.stats()["skipped_steps"] == 0


def test_a_run_of_skips_warns_once_per_run(kit, device):
    w = kit.param(np.array([0.5, -1.0], np.float32), device)
    gm, opt = amp.GradManager([w]), kit.sgd([w], 0.1)
    scaler = amp.GradScaler().watch(warn_after=3)
    nan = kit.tensor(np.array([np.nan, 1.0], np.float32), device)
    ok = kit.tensor(np.array([1.0, 2.0], np.float32), device)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for overflow in [True] * 5 + [False] + [True] * 5:
            with gm:
                scaler.backward(gm, kit.total(kit.mul(w, nan if overflow else ok)))
            opt.step()
            gm.zero_grad()
    caught = [str(r.message) for r in record if r.category is amp.OverflowWarning]
    assert len(caught) == 2
    assert caught[0].startswith("unified_amp: 3 steps in a row (steps 1-3) skipped for"
                                " inf/NaN gradients; loss scale now 8192: training is not"
                                " progressing. Last: unified_amp: step 3 skipped (scale"
                                " 16384, loss nan): inf/NaN gradients in 1 of 1"
                                " parameters: param[0] (1 NaN of 2);")
    assert "(steps 7-9)" in caught[1]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_adapter_primitives_see_every_kind_of_nonfinite(kit, device, backend, dtype,
                                                            monkeypatch):
    rows = np.array([[1.0, 2.0], [np.nan, 1.0], [-np.inf, 0.0], [np.inf, -1.0],
                     [60000.0, 60000.0]], np.float32)  # the last sums past float16's range
    t = kit.tensor(rows, device, dtype)
    flags = [backend.finite_flag(t), backend.finite_flag(t, per_row=True)]
    flags += [backend.finite_flag(kit.tensor(rows[i], device, dtype)) for i in range(5)]
    flags.append(backend.finite_flag(kit.tensor(np.zeros((0, 3)), device, dtype),
                                     per_row=True))
    # more infs than 4096 (MegEngine sends a count as two float32 parts split there)
    many = kit.tensor(np.array([np.inf] * 5000 + [np.nan] * 3, np.float32), device, dtype)
    grads = [t, kit.tensor(rows[:1], device, dtype), many]
    losses = [kit.tensor(np.array([2.5], np.float32), device, dtype),
              kit.tensor(np.array([np.inf], np.float32), device, dtype)]
    log = []
    patch_reads(monkeypatch, kit, log)
    counts, loss_values, finite = backend.read_overflow(grads, losses, flags)
    monkeypatch.undo()
    assert len(log) == 1  # one host read for all of it
    assert counts == [(2, 1), (0, 0), (5000, 3)] and loss_values == [2.5, math.inf]
    assert finite == [[False], [True, False, False, False, True],
                      [True], [False], [False], [False], [True], []]
    assert backend.read_overflow([], [], flags[:2]) == (
        [], [], [[False], [True, False, False, False, True]])
    assert backend.read_overflow([], [], []) == ([], [], [])
