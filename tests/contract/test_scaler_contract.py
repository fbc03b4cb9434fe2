"""GradScaler on the real backends: trajectories, skipping, accumulation, clipping,
several optimizers, checkpoints and the disabled pass-through."""

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unified_amp as amp

from ..reference import trajectory
from .loops import STEPS, Problem, bits, megengine_style_step, state_bits, torch_style_step

SCRIPTS = {
    "overflow-first": [True, False, False, False, False, False],
    "alternating": [True, False, True, False, False, False, False],
    "burst-then-growth": [False, True, True, False, False, False, False, False],
}


@pytest.mark.parametrize("style", sorted(STEPS))
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripted_overflows_follow_the_reference_model(kit, device, script, style):
    p = Problem(kit, device)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.05)
    scaler = amp.GradScaler(init_scale=2.0**12, growth_interval=3)
    got = []
    for overflow in SCRIPTS[script]:
        STEPS[style](scaler, gm, opt, p, overflow)
        got.append((scaler.get_scale(), scaler.stats()["growth_tracker"]))
    assert got == trajectory(2.0**12, 2.0, 0.5, 3, SCRIPTS[script])
    stats = scaler.stats()
    assert (stats["steps"], stats["skipped_steps"]) == (len(got), sum(SCRIPTS[script]))


@settings(max_examples=25)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=12),
       init_scale=st.sampled_from([1.0, 3.0, 2.0**7, 1000.0, 2.0**16]),
       growth_factor=st.floats(1.01, 4.0), backoff_factor=st.floats(0.05, 0.95),
       growth_interval=st.integers(0, 4))
def test_property_random_sequences_match_the_reference(kit, overflows, init_scale,
                                                       growth_factor, backoff_factor,
                                                       growth_interval):
    w = kit.param(np.array([0.5, -1.0], np.float32), "cpu")
    gm = amp.GradManager([w])
    scaler = amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    got = []
    for overflow in overflows:
        c = kit.tensor(np.array([np.inf if overflow else 1.0, 2.0], np.float32), "cpu")
        with gm:
            scaler.backward(gm, kit.total(kit.mul(w, c)))
        if not overflow:  # true-scale gradients after the automatic unscale
            np.testing.assert_allclose(kit.grad(w), [1.0, 2.0], rtol=1e-6)
        gm.zero_grad()
        got.append((scaler.get_scale(), scaler.stats()["growth_tracker"]))
    assert got == trajectory(init_scale, growth_factor, backoff_factor, growth_interval,
                             overflows)


@pytest.mark.parametrize("style", sorted(STEPS))
@pytest.mark.parametrize("optimizer", ["sgd-momentum-wd", "adam"])
def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(kit, device, style,
                                                                      optimizer):
    p = Problem(kit, device)
    gm = amp.GradManager(p.params)
    opt = kit.sgd(p.params, 0.05, momentum=0.9, weight_decay=1e-3) \
        if optimizer == "sgd-momentum-wd" else kit.adam(p.params, 1e-2)
    scaler = amp.GradScaler()
    for _ in range(2):  # optimizer state exists before the overflow
        STEPS[style](scaler, gm, opt, p)
    weights, state = bits(p.weights()), state_bits(kit, opt)
    assert state, "the optimizer should hold state by now"
    STEPS[style](scaler, gm, opt, p, overflow=True)
    assert bits(p.weights()) == weights
    assert state_bits(kit, opt) == state
    assert all(kit.grad(q) is None for q in p.params)  # dropped, not left as inf
    assert scaler.stats()["last_step_skipped"] and scaler.get_scale() == 2.0**15
    STEPS[style](scaler, gm, opt, p)  # and training resumes
    assert bits(p.weights()) != weights


def test_accumulating_micro_batches_matches_one_big_batch(kit, device):
    """Manual mode: N scaled backward passes, one unscale, one step."""
    n_micro, lr = 4, 0.1
    results = []
    for split in (False, True):
        p = Problem(kit, device, n=16)
        gm, opt = amp.GradManager(p.params), kit.sgd(p.params, lr)
        scaler = amp.GradScaler()
        with amp.autocast(dtype="float16", device=device):
            if split:
                for i in range(n_micro):
                    with gm:
                        rows = slice(4 * i, 4 * i + 4)
                        # each micro-batch's mean loss, divided by N: the mean over 16
                        loss = p.loss(rows=rows) * (1.0 / n_micro)
                        gm.backward(scaler.scale(loss))
            else:
                with gm:
                    gm.backward(scaler.scale(p.loss()))
        scaler.unscale(gm)
        grads = [kit.grad(q) for q in p.params]
        scaler.step(opt)
        scaler.update()
        results.append((grads, p.weights()))
    (g_big, w_big), (g_acc, w_acc) = results
    for a, b in zip(g_big, g_acc):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)
    for a, b in zip(w_big, w_acc):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-4)


def test_clipping_after_unscale_sees_true_scale_gradients(kit, device):
    ref = Problem(kit, device)
    gm = amp.GradManager(ref.params)
    with gm:  # float32 reference gradients, no scaling
        gm.backward(ref.loss())
    true_norm = float(np.sqrt(sum((kit.grad(q) ** 2).sum() for q in ref.params)))

    p = Problem(kit, device)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.1)
    scaler = amp.GradScaler()
    with amp.autocast(dtype="float16", device=device):
        with gm:
            gm.backward(scaler.scale(p.loss()))
    scaler.unscale(gm)
    norm = amp.clip_grad_norm(gm, max_norm=true_norm / 2)
    assert abs(norm - true_norm) / true_norm < 2e-2  # not 65536 times larger
    clipped = float(np.sqrt(sum((kit.grad(q) ** 2).sum() for q in p.params)))
    assert abs(clipped - true_norm / 2) / true_norm < 1e-3
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("form", ["automatic", "manual"])
def test_clip_grad_norm_shows_the_overflow_that_dropped_the_gradients(kit, device, form):
    """scaler.backward(gm, loss) and scaler.unscale(gm) drop overflowed gradients (so
    that any optimizer step skips): clip_grad_norm then says inf, as torch's
    clip_grad_norm_ says of the gradients it keeps, not the 0.0 of no gradients."""
    p = Problem(kit, device)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.1)
    scaler = amp.GradScaler(init_scale=2.0**10)

    def backward(overflow):
        with amp.autocast(dtype="float16", device=device):
            with gm:
                if form == "automatic":
                    scaler.backward(gm, p.loss(overflow))
                else:
                    gm.backward(scaler.scale(p.loss(overflow)))
        if form == "manual":
            scaler.unscale(gm)

    backward(overflow=True)
    assert all(kit.grad(q) is None for q in p.params)  # dropped
    for target in (gm, p.params, opt):
        assert amp.clip_grad_norm(target, max_norm=1.0) == math.inf
    if form == "manual":
        scaler.update()
    gm.zero_grad()  # gradients cleared on purpose: nothing to report any more
    assert amp.clip_grad_norm(gm, max_norm=1.0) == 0.0
    backward(overflow=True)
    if form == "manual":
        scaler.update()
    backward(overflow=False)  # the next step's gradients, clean: its own norm
    assert 0.0 < amp.clip_grad_norm(gm, max_norm=1.0) < 50.0


def test_clip_grad_norm_of_non_finite_gradients_leaves_them_as_they_are(kit, device):
    """A non-finite norm is returned as it is, and the gradients are left alone (the
    step that follows is skipped): torch's own clip would turn them all into NaN,
    MegEngine's some of them, so the two backends would hold different gradients."""
    w = kit.param(np.ones(3, np.float32), device)
    for grad, expected in (([np.inf, 1.0, -2.0], math.inf), ([np.nan, np.inf, 1.0], "nan")):
        kit.set_grad(w, np.array(grad, np.float32))
        norm = amp.clip_grad_norm([w], max_norm=1.0)
        assert norm == expected if expected == math.inf else math.isnan(norm)
        assert bits([kit.grad(w)]) == bits([np.array(grad, np.float32)])


def test_gan_step_two_optimizers_one_scaler(kit, device):
    d, g = Problem(kit, device, seed=1), Problem(kit, device, seed=2)
    gm_d, gm_g = amp.GradManager(d.params), amp.GradManager(g.params)
    opt_d, opt_g = kit.adam(d.params, 1e-2), kit.adam(g.params, 1e-2)
    scaler = amp.GradScaler(init_scale=2.0**10)
    for overflow_d in (False, True, False):
        d_before, g_before = bits(d.weights()), bits(g.weights())
        with amp.autocast(dtype="float16", device=device):
            with gm_d:
                gm_d.backward(scaler.scale(d.loss(overflow=overflow_d)))
        scaler.step(opt_d)
        with amp.autocast(dtype="float16", device=device):
            with gm_g:
                gm_g.backward(scaler.scale(g.loss()))
        scaler.step(opt_g)
        scaler.update()
        gm_d.zero_grad()
        gm_g.zero_grad()
        assert (bits(d.weights()) == d_before) == overflow_d
        assert bits(g.weights()) != g_before  # G's clean step is not held back
    assert scaler.get_scale() == 2.0**9
    assert scaler.stats()["steps"] == 3 and scaler.stats()["skipped_steps"] == 1


@pytest.mark.parametrize("style", sorted(STEPS))
def test_state_dict_round_trip_mid_training_continues_bit_identically(kit, device, style):
    overflows = [False, True, False, False, True, False, False, False]
    runs = []
    for restart in (False, True):
        p = Problem(kit, device)
        gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.05, momentum=0.9)
        scaler = amp.GradScaler(init_scale=2.0**8, growth_interval=2)
        history = []
        for i, overflow in enumerate(overflows):
            if restart and i == 4:  # checkpoint through plain Python (pickle) and resume
                scaler = amp.GradScaler()
                scaler.load_state_dict(pickle.loads(pickle.dumps(history[-1][1])))
            STEPS[style](scaler, gm, opt, p, overflow)
            history.append((bits(p.weights()), scaler.state_dict()))
        runs.append(history)
    assert runs[0] == runs[1]


def test_disabled_scaler_gives_exactly_the_fp32_loop(kit, device):
    def train(use_scaler):
        p = Problem(kit, device)
        gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.1, momentum=0.9)
        scaler = amp.GradScaler(enabled=False)
        for _ in range(3):
            with amp.autocast(enabled=False):
                with gm:
                    loss = p.loss()
                    if use_scaler:
                        scaler.backward(gm, loss)
                    else:
                        gm.backward(loss)
            if use_scaler:
                scaler.unscale(gm)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            gm.zero_grad()
        return bits(p.weights())

    assert train(True) == train(False)


def test_misuse_errors_on_real_tensors(kit, device):
    p = Problem(kit, device)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.1)
    scaler = amp.GradScaler()
    with gm:
        gm.backward(scaler.scale(p.loss()))
    scaler.unscale(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale(opt)
    with pytest.raises(RuntimeError, match="already been called on these gradients"):
        scaler.unscale(gm)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()


def test_scaled_loss_and_fp16_gradients(kit, device):
    w = kit.param(np.array([1.5], np.float32), device)
    scaler = amp.GradScaler(init_scale=8.0)
    scaled = scaler.scale([kit.mul(w, kit.tensor(np.array([2.0], np.float32), device))])
    assert isinstance(scaled, list) and kit.numpy(scaled[0]).tolist() == [24.0]
    # a float16 model (model.half()) has float16 gradients, which cannot be unscaled
    # without losing what the scaling protected
    h = kit.param(np.array([1.5], np.float32), device, "float16")
    gm = amp.GradManager([h])
    with gm:
        gm.backward(scaler.scale(kit.total(kit.mul(h, kit.tensor([2.0], device, "float16")))))
    assert kit.dtype_name(h.grad) == "float16"
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale(gm)


def test_state_dict_is_plain_python_and_survives_json(kit, device):
    """Plain numbers only, the same keys on both backends, so that a checkpoint written
    on one backend loads on the other, and into either framework's own scaler
    (torch.amp reads "scale", megengine.amp "scale_factor"; both ignore the rest)."""
    import json

    p = Problem(kit, device)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.05)
    scaler = amp.GradScaler(init_scale=2.0**9, growth_interval=2)
    for overflow in (False, True, False):
        torch_style_step(scaler, gm, opt, p, overflow)
    state = scaler.state_dict()
    assert json.loads(json.dumps(state)) == state
    fresh = amp.GradScaler()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    expected = {"scale": 2.0**8, "scale_factor": 2.0**8, "growth_factor": 2.0,
                "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 1,
                "steps": 3, "skipped_steps": 1, "last_step_skipped": False}
    assert fresh.state_dict() == state == expected
    assert list(state) == list(expected)  # torch.amp's keys first, in its order


def test_the_counters_travel_in_the_state_dict(kit, device):
    """stats() goes on from the checkpoint: overflow reports and logs keep numbering
    the steps of the whole run, not from the resume."""
    p = Problem(kit, device)
    gm, opt = amp.GradManager(p.params), kit.sgd(p.params, 0.05)
    scaler = amp.GradScaler(init_scale=2.0**9, growth_interval=2)
    for overflow in (False, True, False, True):
        megengine_style_step(scaler, gm, opt, p, overflow)
    keys = ("steps", "skipped_steps", "last_step_skipped", "scale", "growth_tracker")
    before = {k: scaler.stats()[k] for k in keys}
    assert before["steps"] == 4 and before["skipped_steps"] == 2
    resumed = amp.GradScaler()
    resumed.load_state_dict(scaler.state_dict())
    assert {k: resumed.stats()[k] for k in keys} == before
    assert resumed.stats()["as_of_step"] == 4
    megengine_style_step(resumed, gm, opt, p, False)
    assert (resumed.stats()["steps"], resumed.stats()["skipped_steps"]) == (5, 2)
    # A framework's own dict has no counters: loading it leaves them as they are.
    resumed.load_state_dict({k: v for k, v in scaler.state_dict().items()
                             if k not in ("steps", "skipped_steps", "last_step_skipped")})
    assert (resumed.stats()["steps"], resumed.stats()["skipped_steps"]) == (5, 2)


BAD_STATE_DICTS = {
    "empty": {},
    "missing a key": {"scale": 8.0, "growth_factor": 2.0},
    "no mapping": [("scale", 8.0)],
    "a bad value": {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                    "growth_interval": 3, "_growth_tracker": -1},
    "bad counters": {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                     "growth_interval": 3, "_growth_tracker": 0, "steps": 1,
                     "skipped_steps": 2, "last_step_skipped": True},
}


@pytest.mark.parametrize("bad", sorted(BAD_STATE_DICTS))
def test_a_bad_state_dict_raises_one_error_class_on_both_backends(kit, device, bad):
    """amp.StateDictError, on both backends: also each framework's own scaler's type
    (torch.amp: RuntimeError for an empty dict, KeyError for a missing key, TypeError
    for no mapping; megengine.amp: KeyError, TypeError), and ValueError as before."""
    scaler = amp.GradScaler(init_scale=4.0)
    before = scaler.state_dict()
    with pytest.raises(amp.StateDictError) as info:
        scaler.load_state_dict(BAD_STATE_DICTS[bad])
    assert all(isinstance(info.value, t) for t in (RuntimeError, KeyError, TypeError,
                                                  ValueError))
    assert "state dict" in str(info.value) and not str(info.value).startswith("'")
    assert scaler.state_dict() == before


def test_a_long_run_of_overflows_keeps_skipping_and_never_fails(kit, device):
    """170 non-finite steps in a row take the scale below float32's smallest normal
    number; its reciprocal overflows to inf, which must not raise (torch.amp's does
    not) and must keep every step skipped."""
    w = kit.param(np.array([1.0, 2.0], np.float32), device)
    gm, opt = amp.GradManager([w]), kit.sgd([w], 0.1, momentum=0.9)
    scaler = amp.GradScaler()
    nan = kit.tensor(np.array([np.nan, 1.0], np.float32), device)
    scales = []
    for _ in range(170):
        with gm:
            gm.backward(scaler.scale(kit.total(kit.mul(w, nan))))
        scaler.step(opt)
        scaler.update()
        gm.zero_grad()
        scales.append(scaler.get_scale())
    assert kit.numpy(w).tolist() == [1.0, 2.0]
    assert scaler.stats()["skipped_steps"] == 170
    assert all(b <= a for a, b in zip(scales, scales[1:]))
    # 2**16 halved 170 times is below float32's range: it ends in the subnormals or,
    # where the process flushes denormals to zero (MegEngine's import does), at 0.0
    assert scales[-1] < 2.0**-126 and 0.5 * scales[100] == scales[101]
