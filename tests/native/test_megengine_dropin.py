"""unified_amp.GradScaler in unchanged megengine.amp loops gives megengine.amp's weights
and scale history bit for bit, at the same init_scale. Only the class differs."""

import numpy as np
import pytest

import megengine as mge
import megengine.amp
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as optim
from megengine.autodiff import GradManager

import unified_amp

NATIVE, OURS = megengine.amp.GradScaler, unified_amp.GradScaler


def model_and_data():
    rng = np.random.RandomState(0)
    model = M.Sequential(M.Linear(8, 16), M.ReLU(), M.Linear(16, 4))
    for p in model.parameters():
        p._reset(mge.tensor(rng.randn(*p.shape).astype("float32") * 0.3))
    batches = [(rng.randn(8, 8).astype("float32"), rng.randint(0, 4, 8).astype("int32"))
               for _ in range(24)]
    return model, batches


def batch(batches, i, overflow):
    x, y = batches[i]
    x = x.copy()
    if overflow:
        x[0, 0] = np.inf
    return mge.tensor(x), mge.tensor(y)


def automatic_mode(GradScaler, overflow_at=(2, 5)):
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=2)
    history = []
    for i in range(10):
        x, y = batch(batches, i, i in overflow_at)
        with megengine.amp.autocast():
            with gm:
                loss = F.nn.cross_entropy(model(x), y)
                scaler.backward(gm, loss)
        opt.step().clear_grad()
        history.append(scaler.scale_factor)
    return [p.numpy().tobytes() for p in model.parameters()], history


def manual_mode(GradScaler, overflow_at=(1, 6)):
    """megengine.amp's documented split: gm.backward(loss, dy=scale) -> unscale -> update."""
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=2)
    history = []
    for i in range(10):
        x, y = batch(batches, i, i in overflow_at)
        with megengine.amp.autocast():
            with gm:
                loss = F.nn.cross_entropy(model(x), y)
                gm.backward(loss, dy=mge.tensor(scaler.scale_factor))
        scaler.unscale(gm.attached_tensors())
        scaler.update()
        opt.step().clear_grad()
        history.append(scaler.scale_factor)
    return [p.numpy().tobytes() for p in model.parameters()], history


def accumulation(GradScaler, overflow_at=(5,)):
    """Two micro-batches with unscale_grad=False, then one unscale and update."""
    model, batches = model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=2)
    history = []
    for i in range(0, 20, 2):
        for j in (i, i + 1):
            x, y = batch(batches, j, j in overflow_at)
            with megengine.amp.autocast():
                with gm:
                    loss = F.nn.cross_entropy(model(x), y) / 2
                    scaler.backward(gm, loss, unscale_grad=False)
        scaler.unscale(gm.attached_tensors())
        scaler.update()
        opt.step().clear_grad()
        history.append(scaler.scale_factor)
    return [p.numpy().tobytes() for p in model.parameters()], history



def assert_backoff_and_growth(history):
    """The loop did exercise both rules, so equal histories mean something."""
    steps = list(zip(history, history[1:]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps), history


@pytest.mark.parametrize("loop", [automatic_mode, manual_mode, accumulation],
                         ids=["automatic", "manual-dy", "accumulation"])
def test_same_weights_and_scale_history(loop):
    native, ours = loop(NATIVE), loop(OURS)
    assert native[1] == ours[1]
    assert native[0] == ours[0]
    assert_backoff_and_growth(native[1])


def test_ours_also_takes_unified_grad_managers_with_the_same_result():
    def run(make_gm):
        model, batches = model_and_data()
        gm = make_gm(model.parameters())
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = OURS(init_scale=2.0**4, growth_interval=2)
        for i in range(6):
            x, y = batch(batches, i, i == 2)
            with megengine.amp.autocast():
                with gm:
                    scaler.backward(gm, F.nn.cross_entropy(model(x), y))
            opt.step().clear_grad()
        return [p.numpy().tobytes() for p in model.parameters()], scaler.scale_factor

    assert run(lambda ps: GradManager().attach(ps)) == run(unified_amp.GradManager)


def test_swapping_only_the_scaler_leaves_megengine_functions_untouched():
    """The dtype-contract wrappers arrive with the first unified autocast block, never
    with the scaler, so a drop-in user's MegEngine calls run MegEngine's own code."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import megengine, megengine.functional as F, megengine.module as M
        import numpy as np, unified_amp as amp
        originals = (F.softmax, F.nn.batch_norm, F.max_pool2d, megengine.Tensor.sum)
        model = M.Linear(4, 2)
        gm = megengine.autodiff.GradManager().attach(model.parameters())
        scaler = amp.GradScaler(init_scale=16.0)
        with megengine.amp.autocast():
            with gm:
                loss = F.softmax(model(megengine.tensor(np.ones((3, 4), "float32")))).sum()
                scaler.backward(gm, loss)
        same = originals == (F.softmax, F.nn.batch_norm, F.max_pool2d, megengine.Tensor.sum)
        with amp.autocast(dtype="float16"):
            pass
        after = originals == (F.softmax, F.nn.batch_norm, F.max_pool2d, megengine.Tensor.sum)
        print(same, after)
    """)
    env = dict(os.environ, UNIFIED_AMP_BACKEND="megengine")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.stdout.split()[-2:] == ["True", "False"], proc.stderr[-2000:]


def test_contract_false_reproduces_megengine_autocast_bit_for_bit():
    def run(autocast_factory):
        model, batches = model_and_data()
        gm = GradManager().attach(model.parameters())
        opt = optim.SGD(model.parameters(), lr=0.05)
        scaler = NATIVE(init_scale=2.0**4)
        for i in range(6):
            x, y = batch(batches, i, False)
            with autocast_factory():
                with gm:
                    logits = model(x)
                    loss = -F.log(F.softmax(logits, axis=1)[:, 0]).mean() + logits.sum() * 0
                    scaler.backward(gm, loss)
            opt.step().clear_grad()
        return [p.numpy().tobytes() for p in model.parameters()]

    native = run(lambda: megengine.amp.autocast())
    contract = run(lambda: unified_amp.autocast(dtype="float16"))
    plain = run(lambda: unified_amp.autocast(dtype="float16", contract=False))
    assert plain == native
    assert contract != native  # softmax and sum run in float32 under the contract


def test_checkpoints_move_both_ways_between_the_scalers():
    """A drop-in can be taken out again: megengine.amp resumes from unified_amp's
    state_dict (it reads "scale_factor"), and unified_amp from megengine.amp's, each
    continuing with the other's scale, growth settings and tracker."""
    ours = OURS()
    ours.load_state_dict({"scale": 2.0**7, "growth_factor": 4.0, "backoff_factor": 0.25,
                          "growth_interval": 3, "_growth_tracker": 2})
    native = NATIVE()
    native.load_state_dict(ours.state_dict())
    assert (native.scale_factor, native.growth_factor, native.backoff_factor,
            native.growth_interval, native._growth_tracker) == (2.0**7, 4.0, 0.25, 3, 2)
    back = OURS()
    back.load_state_dict(native.state_dict())
    assert back.state_dict() == ours.state_dict()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_grad_norm_is_megengines_bit_for_bit_on_finite_gradients(norm_type, max_norm):
    def params():
        rng = np.random.RandomState(3)
        ps = [mge.Parameter(np.zeros(s, np.float32)) for s in ((4, 3), (3,), (5,))]
        for p in ps:
            p.grad = mge.tensor((rng.randn(*p.shape) * 3).astype(np.float32))
        return ps

    theirs, ours = params(), params()
    norm = optim.clip_grad_norm(theirs, max_norm, ord=norm_type)
    assert unified_amp.clip_grad_norm(ours, max_norm, norm_type) == float(norm.item())
    assert all(np.array_equal(a.grad.numpy(), b.grad.numpy()) for a, b in zip(theirs, ours))


def test_megengine_amp_resumes_from_a_checkpoint_of_a_run_with_ours():
    """After steps and skips: megengine.amp's own scaler loads ours, which holds its
    "scale_factor" beside torch.amp's "scale" (the same dict on both backends)."""
    model = M.Linear(3, 2)
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.1)
    ours = OURS(init_scale=2.0**10, growth_interval=2)
    for overflow in (False, True, False):
        x = mge.tensor(np.random.RandomState(0).randn(4, 3).astype("float32"))
        with gm:
            loss = (model(x) ** 2).mean() * (float("inf") if overflow else 1.0)
            ours.backward(gm, loss)
        opt.step().clear_grad()
    native = NATIVE()
    native.load_state_dict(ours.state_dict())
    assert native.state_dict() == {k: ours.state_dict()[k] for k in native.state_dict()}
    assert (native.scale_factor, native._growth_tracker) == (2.0**9, 1)


BAD_STATE_DICTS = {
    "empty": {},
    "missing a key": {"scale_factor": 8.0, "growth_factor": 2.0},
    "no mapping": [("scale_factor", 8.0)],
    "None": None,
}


@pytest.mark.parametrize("bad", sorted(BAD_STATE_DICTS))
def test_a_bad_state_dict_raises_megengine_amps_type(bad):
    """Where megengine.amp refuses a state dict, ours raises amp.StateDictError, which
    is also the type megengine.amp raises (KeyError, TypeError)."""
    with pytest.raises(Exception) as native:
        NATIVE().load_state_dict(BAD_STATE_DICTS[bad])
    with pytest.raises(unified_amp.StateDictError) as ours:
        OURS().load_state_dict(BAD_STATE_DICTS[bad])
    assert isinstance(ours.value, type(native.value)), (native.value, ours.value)


@pytest.mark.parametrize("overflow_on", [None, "cpu0", "cpu1"])
def test_gradients_on_two_devices_are_checked_and_unscaled_per_device(overflow_on):
    """MegEngine's fused kernel takes the gradients of one device per call; the adapter
    groups them only where get_device() finds more than one (the usual single device
    takes one pass). Two CPU comp nodes stand in for two GPUs."""
    params = [mge.Parameter(np.array([1.0, 2.0], "float32"), device=d)
              for d in ("cpu0", "cpu1", "cpu0")]
    gm = GradManager().attach(params)
    scaler = OURS(init_scale=4.0)
    with gm:
        loss = sum(((p * mge.tensor([3.0, 5.0], device=p.device)).sum()).to("cpu0")
                   for p in params)
        if overflow_on is not None:
            loss = loss + (params[0 if overflow_on == "cpu0" else 1] * np.inf).sum().to(
                "cpu0")
        scaler.backward(gm, loss)
    if overflow_on is None:
        assert [p.grad.numpy().tolist() for p in params] == [[3.0, 5.0]] * 3
        assert [str(p.grad.device).split(":")[0] for p in params] == ["cpu0", "cpu1", "cpu0"]
        assert scaler.get_scale() == 4.0
    else:  # one device's overflow skips every gradient, as megengine.amp's single check
        assert all(p.grad is None for p in params)
        assert scaler.get_scale() == 2.0
