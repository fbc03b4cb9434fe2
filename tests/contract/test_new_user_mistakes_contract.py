"""The mistakes a new user made training from the docs alone (issue 44), on every backend:
each one is caught, or made impossible, the same way on both."""

import math

import numpy as np
import pytest

import unified_amp as amp


# -- 4. dtype spellings: the same ones accepted, the same ones refused -------------------
ACCEPTED = [("float16", "float16"), ("half", "float16"), ("fp16", "float16"),
            ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
            (np.float16, "float16"), (np.dtype("float16"), "float16")]
# Exact names only, as torch's and MegEngine's own dtype names are: no case folding, no
# blanks, and no dtype that autocast cannot compute in.
REFUSED = ["FP16", "Float16", "float16 ", " bfloat16", "BF16", "float32", "fp32",
           np.float32, np.dtype("float64"), 16, float]


@pytest.mark.parametrize("spelling,name", ACCEPTED, ids=repr)
def test_autocast_accepts_the_same_dtype_spellings_on_every_backend(kit, spelling, name):
    assert amp.autocast(dtype=spelling).dtype == name


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_autocast_accepts_the_frameworks_own_dtype_objects(kit, name):
    assert amp.autocast(dtype=kit.dtype_object(name)).dtype == name


@pytest.mark.parametrize("spelling", REFUSED, ids=repr)
def test_autocast_refuses_the_same_dtype_spellings_on_every_backend(kit, spelling):
    with pytest.raises(ValueError) as caught:
        amp.autocast(dtype=spelling)
    message = str(caught.value)
    assert repr(spelling) in message  # the bad value
    for accepted in ("'float16'", "'bfloat16'", "'half'", "'fp16'", "'bf16'"):
        assert accepted in message  # and what is accepted instead


# -- 1. clip_grad_norm on gradients still scaled -----------------------------------------
SCALE = 2.0**16


def _scaled_step(kit, device, backward="manual"):
    """w's gradient, x = (3, 3), still scaled by SCALE: its true norm is 3 * sqrt(2)."""
    w = kit.param(np.array([0.5, -1.0], np.float32), device)
    x = kit.tensor(np.array([3.0, 3.0], np.float32), device)
    gm, opt = amp.GradManager([w]), kit.sgd([w], 0.1)
    scaler = amp.GradScaler(init_scale=SCALE)
    with gm:
        loss = kit.total(kit.mul(w, x))
        if backward == "manual":
            gm.backward(scaler.scale(loss))
        elif backward == "dy":
            gm.backward(loss, dy=kit.tensor(np.float32(scaler.scale_factor), device))
        else:  # accumulation: the automatic form, left scaled
            scaler.backward(gm, loss, unscale_grad=False)
    return w, gm, opt, scaler


@pytest.mark.parametrize("backward", ["manual", "dy", "nounscale"])
@pytest.mark.parametrize("target", ["gm", "params", "opt"])
def test_clipping_scaled_gradients_raises_naming_unscale(kit, device, backward, target):
    w, gm, opt, scaler = _scaled_step(kit, device, backward)
    before = kit.grad(w).copy()
    with pytest.raises(amp.ScalerStateError) as caught:
        amp.clip_grad_norm({"gm": gm, "params": [w], "opt": opt}[target], 1.0)
    assert isinstance(caught.value, RuntimeError)  # as the other misuse errors
    message = str(caught.value)
    assert "scaler.unscale(gm)" in message and "scaled=True" in message
    assert f"{SCALE:g}" in message
    assert np.array_equal(kit.grad(w), before)  # nothing was clipped
    scaler.unscale(gm)  # the fix the message names: then the clip sees true gradients
    assert amp.clip_grad_norm(gm, 1.0) == pytest.approx(3 * 2**0.5, rel=1e-6)
    assert np.linalg.norm(kit.grad(w)) == pytest.approx(1.0, rel=1e-5)


def test_clipping_scaled_gradients_on_purpose(kit, device):
    w, gm, _, scaler = _scaled_step(kit, device)
    # the scaled norm, clipped by a max_norm scaled too: the same clip, as the natives do it
    norm = amp.clip_grad_norm(gm, 1.0 * SCALE, scaled=True)
    assert norm == pytest.approx(3 * 2**0.5 * SCALE, rel=1e-6)
    scaler.unscale(gm)
    assert np.linalg.norm(kit.grad(w)) == pytest.approx(1.0, rel=1e-5)


def test_clipping_after_unscale_or_the_automatic_form_does_not_raise(kit, device):
    w, gm, opt, scaler = _scaled_step(kit, device)
    scaler.unscale_(opt)  # torch.amp's form
    assert amp.clip_grad_norm(opt, 100.0) == pytest.approx(3 * 2**0.5, rel=1e-6)
    scaler.step(opt)
    scaler.update()
    gm.zero_grad()
    # the automatic form unscales by itself; and after update() nothing is scaled
    x = kit.tensor(np.array([3.0, 3.0], np.float32), device)
    with gm:
        scaler.backward(gm, kit.total(kit.mul(w, x)))
    assert amp.clip_grad_norm(gm, 100.0) == pytest.approx(3 * 2**0.5, rel=1e-6)
    gm.zero_grad()
    with gm:
        gm.backward(kit.total(kit.mul(w, x)))  # an fp32 backward, nothing scaled
    assert amp.clip_grad_norm(gm, 100.0) == pytest.approx(3 * 2**0.5, rel=1e-6)


# -- 2. a forgotten update() after an overflow ------------------------------------------
def _loop_without_update(kit, device, steps, plant_at, form, update=False):
    """megengine.amp's forms with a plain opt.step(), update() forgotten (or not); an
    inf planted in the input of step ``plant_at``. Returns the OverflowWarnings."""
    import warnings

    w = kit.param(np.array([0.5, -1.0], np.float32), device)
    gm, opt = amp.GradManager([w]), kit.sgd([w], 0.1)
    scaler = amp.GradScaler(init_scale=2.0**4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(steps):
            x = np.array([np.inf if i == plant_at else 3.0, 3.0], np.float32)
            with gm:
                loss = kit.total(kit.mul(w, kit.tensor(x, device)))
                if form == "manual":
                    gm.backward(scaler.scale(loss))
                else:
                    scaler.backward(gm, loss, update_scale=False)
            if form == "manual":
                scaler.unscale(gm)  # fresh gradients may be unscaled between updates
            opt.step()
            gm.zero_grad()
            if update:
                scaler.update()
    caught = [str(r.message) for r in record if r.category is amp.OverflowWarning]
    return scaler, caught


@pytest.mark.parametrize("form", ["manual", "auto-noupdate"])
def test_an_overflow_no_update_follows_warns_once(kit, device, form):
    scaler, caught = _loop_without_update(kit, device, 5, 1, form)
    assert len(caught) == 1, caught
    assert caught[0].startswith(
        "unified_amp: a gradient check found inf/NaN gradients (step 1) and the next"
        " check of the same gradients came with no scaler.update() between them: the loss"
        " scale stays 16, since only update() backs it off")
    assert "scaler.update()" in caught[0]
    stats = scaler.stats()  # megengine.amp's update_scale=False semantics hold
    assert (stats["checks_since_update"], stats["overflows_since_update"]) == (5, 1)
    assert stats["scale"] == 16.0


@pytest.mark.parametrize("form", ["manual", "auto-noupdate"])
def test_no_warning_without_an_overflow_or_with_update(kit, device, form):
    assert _loop_without_update(kit, device, 4, None, form)[1] == []
    scaler, caught = _loop_without_update(kit, device, 4, 1, form, update=True)
    assert caught == [] and scaler.get_scale() == 8.0


# -- 3. the overflow report under accumulation -------------------------------------------
def _accumulated_overflow(kit, device, inputs):
    """One iteration of len(inputs) micro-batches, loss = sum(w * x) each, unscaled once
    (megengine.amp's manual form): the report of its overflow."""
    w = kit.param(np.array([0.5, -1.0, 2.0], np.float32), device)
    gm = amp.GradManager([w])
    scaler = amp.GradScaler(init_scale=2.0**4)
    for x in inputs:
        with gm:
            gm.backward(scaler.scale(kit.total(kit.mul(w, kit.tensor(
                np.array(x, np.float32), device)))))
    scaler.unscale(gm)
    return scaler.last_overflow()


def test_the_report_names_the_micro_batch_whose_loss_is_not_finite(kit, device):
    report = _accumulated_overflow(kit, device, [[1.0, 1.0, 1.0], [np.inf, np.nan, 3.0],
                                                 [1.0, 1.0, 1.0]])
    assert report is not None and math.isnan(report.loss)
    assert (report.micro_batch, report.micro_batches) == (2, 3)
    # the gradient x * scale summed over the micro-batches: inf, NaN and 88, as they are
    assert [(g.inf, g.nan) for g in report.gradients] == [(1, 1)]
    assert report.cause == "forward"
    assert "(scale 16, loss nan in micro-batch 2 of 3)" in report.line()
    assert "the loss itself is inf/NaN" in report.line()


def test_the_report_names_the_largest_loss_where_every_loss_is_finite(kit, device):
    # 3e37 * 16 overflows float32 in the scaled gradient, its loss 1.5e37 does not
    report = _accumulated_overflow(kit, device, [[3e37, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert report.loss == pytest.approx(1.5e37, rel=1e-6)
    assert (report.micro_batch, report.micro_batches) == (1, 2)
    assert [(g.inf, g.nan) for g in report.gradients] == [(1, 0)]
    assert report.cause == "backward"
    assert "loss 1.5e+37 in micro-batch 1 of 2, the largest" in report.line()


def test_one_micro_batch_reports_as_before(kit, device):
    report = _accumulated_overflow(kit, device, [[3e37, 0.0, 0.0]])
    assert (report.micro_batch, report.micro_batches) == (1, 1)
    assert "(scale 16, loss 1.5e+37):" in report.line()


# -- 5. README's portable step: the same numerics on both backends, as printed ----------
def _readme_blocks(heading):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split(heading)[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readmes_portable_step_autocasts_to_float16_on_every_backend(kit, monkeypatch):
    """The step "written once" computes in the same dtype on both frameworks as printed:
    amp.autocast()'s default differs on CPU (bfloat16 with torch, float16 with
    MegEngine), so a user who copies the block must get the same numerics."""
    backend = amp.get_backend()
    entered = []
    enter = backend.enter_autocast

    def recording(*args, **kwargs):
        token = enter(*args, **kwargs)
        entered.append(backend.autocast_low_dtype("cpu"))
        return token

    monkeypatch.setattr(backend, "enter_autocast", recording)
    block = _readme_blocks("## The same step on both frameworks")[0]
    exec(compile(block, "README.md", "exec"), {})
    assert len(entered) == 20 and set(entered) == {"float16"}
