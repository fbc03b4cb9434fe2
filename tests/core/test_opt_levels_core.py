"""apex's API (amp.initialize, amp.scale_loss) on the fake backend with the opt-level capability: the opt-level
presets and their validation, one loss scale per loss_id, skipping, gradient stashing
between losses, delay_unscale, master weights and the state dicts."""

import gc
import math

import pytest

import unified_amp as amp
from unified_amp import opt_levels

from .fake_backend import FakeModule, FakeOptimizer, FakeTensor


def make(capable_fake, values=((0.5, -1.0), (0.25, 2.0)), bn=None):
    """A model of one or two parameter vectors (the second maybe a batch norm layer),
    its SGD optimizer and a GradManager over it."""
    params = [FakeTensor(v) for v in values]
    children = []
    if bn is not None:
        children = [FakeModule([FakeTensor(bn)], batch_norm=True, backend=capable_fake)]
    model = FakeModule(params, children, backend=capable_fake)
    opt = FakeOptimizer(list(model.parameters()))
    return model, opt


def step(model, opt, x=(1.0, 2.0), loss_id=0, scale=1.0):
    """One apex-style step: forward, loss, scale_loss + backward, optimizer step."""
    gm = amp.GradManager(list(model.parameters()))
    with gm:
        loss = model(FakeTensor(x))
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            gm.backward(scaled)
    return opt.step()


# -- the presets -------------------------------------------------------------------------
EXPECTED = {  # cast_model_type, autocast, keep_batchnorm_fp32, master_weights, loss_scale
    "O0": ("float32", False, None, False, 1.0),
    "O1": (None, True, None, False, "dynamic"),
    "O2": ("float16", True, True, True, "dynamic"),
    "O3": ("float16", False, False, False, 1.0),
}


@pytest.mark.parametrize("level", sorted(EXPECTED))
def test_presets(capable_fake, level):
    model, opt = make(capable_fake)
    amp.initialize(model, opt, opt_level=level)
    p = amp.opt_properties()
    assert (p.cast_model_type, p.autocast, p.keep_batchnorm_fp32, p.master_weights,
            p.loss_scale) == EXPECTED[level]
    assert p.low_dtype == "float16" and p.max_loss_scale == 2.0**24


@pytest.mark.parametrize("level,weights,masters,bn", [
    ("O0", "float32", False, "float32"),
    ("O1", "float32", False, "float32"),
    ("O2", "float16", True, "float32"),
    ("O3", "float16", False, "float16"),
])
def test_what_initialize_does_to_the_model_and_optimizer(capable_fake, level, weights, masters, bn):
    model, opt = make(capable_fake, bn=(1.0, 1.0))
    w, bn_w = list(model.parameters())[0], list(model.parameters())[-1]
    assert amp.initialize(model, opt, opt_level=level) == (model, opt)
    assert (w.dtype, bn_w.dtype) == (weights, bn)
    stepped = list(amp.master_params(opt))
    assert (stepped[0] is not w) == masters  # a float32 master in w's place
    assert all(m.dtype == "float32" for m in stepped) or level == "O3"
    out = model(FakeTensor([1.0, 2.0]))
    assert out.dtype == "float32"  # every level hands back float32
    assert model.seen[-1] == {"O0": ("float32", None), "O1": ("float32", "float16"),
                              "O2": ("float16", "float16"),
                              "O3": ("float16", None)}[level]


def test_returns_the_shapes_it_was_given(capable_fake):
    (m1, o1), (m2, o2) = make(capable_fake), make(capable_fake)
    assert amp.initialize(m1, o1) == (m1, o1)
    (m1, o1), (m2, o2) = make(capable_fake), make(capable_fake)
    assert amp.initialize([m1, m2], [o1, o2]) == ([m1, m2], [o1, o2])
    (m1, o1), (m2, o2) = make(capable_fake), make(capable_fake)
    assert amp.initialize((m1, m2), o1) == ((m1, m2), o1)
    m1, _ = make(capable_fake)
    assert amp.initialize(m1, opt_level="O2") is m1  # inference: no optimizer, no masters
    assert list(m1.parameters())[0].dtype == "float16"


# -- validation -------------------------------------------------------------------------
BAD = [
    (dict(opt_level="O4"), ValueError, "opt_level must be one of O0, O1, O2, O3"),
    (dict(opt_level="01"), ValueError, "the letter O, not zero"),
    (dict(num_losses=0), ValueError, "num_losses must be >= 1"),
    (dict(num_losses=1.0), TypeError, "num_losses must be an int"),
    (dict(opt_level="O1", cast_model_type="float16"), ValueError, "O1 keeps the weights"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), ValueError, "O1 runs batch norm"),
    (dict(opt_level="O0", keep_batchnorm_fp32=False), ValueError, "applies only when"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), TypeError, "keep_batchnorm_fp32 must"),
    (dict(opt_level="O1", master_weights=True), ValueError, "O1 casts per op"),
    (dict(opt_level="O0", master_weights=True), ValueError, "already float32"),
    (dict(loss_scale="sometimes"), ValueError, "'dynamic' or a positive finite number"),
    (dict(loss_scale=-1.0), ValueError, "'dynamic' or a positive finite number"),
    (dict(loss_scale=math.inf), ValueError, "'dynamic' or a positive finite number"),
    (dict(max_loss_scale=0), ValueError, "max_loss_scale must be a positive"),
    (dict(min_loss_scale=4.0, max_loss_scale=2.0), ValueError, "is above max_loss_scale"),
    (dict(low_dtype="float64"), ValueError, "low_dtype must be one of 'float16', 'half'"),
    (dict(opt_level="O2", cast_model_type="float16", low_dtype="bfloat16"), ValueError,
     "pass one of them"),
    (dict(cast_model_type="int8"), ValueError, "cast_model_type must be"),
    (dict(opt_level="O3", loss_scale="dynamic"), ValueError, "would be float16"),
    (dict(opt_level="O2", master_weights=False), ValueError, "would be float16"),
    (dict(enabled="yes"), TypeError, "enabled must be a bool"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD,
                         ids=[str(sorted(k.items())) for k, _, _ in BAD])
def test_impossible_combinations_are_refused_with_the_fix(capable_fake, kwargs, error, message):
    model, opt = make(capable_fake)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        amp.initialize(model, opt, **kwargs)
    assert list(model.parameters())[0].dtype == "float32"  # nothing was changed


def test_apex_spellings_are_accepted(capable_fake):
    model, opt = make(capable_fake)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="False",
                   loss_scale="128.0", verbosity=0)
    p = amp.opt_properties()
    assert p.keep_batchnorm_fp32 is False and p.loss_scale == 128.0
    model, opt = make(capable_fake)
    amp.initialize(model, opt, opt_level="O3", loss_scale="dynamic", master_weights=True)
    assert amp.opt_properties().master_weights


def test_bad_models_and_optimizers(capable_fake):
    model, opt = make(capable_fake)
    with pytest.raises(TypeError, match="a fake module or a list of them; got str"):
        amp.initialize("model", opt)
    with pytest.raises(TypeError, match="an optimizer or a list of them; got int"):
        amp.initialize(model, [opt, 3])
    half = FakeTensor([1.0], "float16")
    with pytest.raises(ValueError, match="expects float32 models; got a float16"):
        amp.initialize(FakeModule([half], backend=capable_fake), opt)
    amp.initialize(model, opt)
    with pytest.raises(RuntimeError, match="went through amp.initialize"):
        amp.initialize(model, FakeOptimizer(list(model.parameters())))
    model2, _ = make(capable_fake)
    with pytest.raises(RuntimeError, match="optimizer .* went through amp.initialize"):
        amp.initialize(model2, opt)


def test_a_precision_the_backend_cannot_compute_fails_at_initialize(capable_fake):
    model, opt = make(capable_fake)
    with pytest.raises(amp.UnsupportedPrecisionError):
        amp.initialize(model, opt, opt_level="O1", low_dtype="bfloat16")
    capable_fake.refuse = set()
    amp.initialize(model, opt, opt_level="O2", low_dtype="bfloat16")
    assert list(model.parameters())[0].dtype == "bfloat16"


def test_backend_limits_batch_norm_and_low_precision_steps(capable_fake):
    """MegEngine's case: batch norm cannot hold float16 weights, its optimizers cannot
    step float16 parameters. O3 then keeps batch norm float32 and steps masters; an
    explicit request for either is refused."""
    capable_fake.low_bn = capable_fake.low_steps = False
    model, opt = make(capable_fake, bn=(1.0, 1.0))
    amp.initialize(model, opt, opt_level="O3")
    p = amp.opt_properties()
    assert p.keep_batchnorm_fp32 is True and p.master_weights is True
    assert list(model.parameters())[-1].dtype == "float32"
    assert all(m.dtype == "float32" for m in amp.master_params(opt))
    for kwargs in (dict(keep_batchnorm_fp32=False), dict(master_weights=False)):
        model, opt = make(capable_fake)
        with pytest.raises(amp.UnsupportedPrecisionError, match="Leave .* at None"):
            amp.initialize(model, opt, opt_level="O3", **kwargs)
    model, _ = make(capable_fake)
    amp.initialize(model, opt_level="O3")  # inference needs no masters
    assert amp.opt_properties().master_weights is False


# -- scale_loss --------------------------------------------------------------------------
def test_scale_loss_before_initialize_and_with_foreign_optimizers(capable_fake):
    # Earlier tests' models and optimizers are garbage in reference cycles (through
    # their patched methods); once collected, no initialize() is alive.
    gc.collect()
    model, opt = make(capable_fake)
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        with amp.scale_loss(FakeTensor([1.0]), opt):
            pass
    amp.initialize(model, opt)
    with pytest.raises(RuntimeError, match="did not prepare"):
        with amp.scale_loss(FakeTensor([1.0]), FakeOptimizer([])):
            pass
    with pytest.raises(ValueError, match=r"loss_id=1 is out of range.*num_losses=1"):
        with amp.scale_loss(FakeTensor([1.0]), opt, loss_id=1):
            pass
    model2, opt2 = make(capable_fake)
    amp.initialize(model2, opt2)
    with pytest.raises(RuntimeError, match="prepared by 2 different amp.initialize"):
        with amp.scale_loss(FakeTensor([1.0]), [opt, opt2]):
            pass


def test_separately_initialized_models_keep_their_own_loss_scales(capable_fake):
    """Two initialize() calls (two opt levels, say) train side by side; amp.state_dict()
    and amp.loss_scaler() speak for the latest."""
    a, opt_a = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(a, opt_a, opt_level="O1")
    scaler_a = amp.loss_scaler()
    b, opt_b = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(b, opt_b, opt_level="O2")
    step(a, opt_a, x=(math.inf, 1.0))
    step(b, opt_b, x=(0.25, 0.5))
    assert scaler_a.get_scale() == 2.0**15
    assert amp.loss_scaler().get_scale() == 2.0**16 and amp.loss_scaler() is not scaler_a
    assert (opt_a.steps, opt_b.steps) == (0, 1)


def test_the_scaled_loss_and_true_scale_gradients(capable_fake):
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt, opt_level="O1")
    gm = amp.GradManager(list(model.parameters()))
    with gm:
        loss = model(FakeTensor([1.0, 2.0]))
        with amp.scale_loss(loss, opt) as scaled:
            assert scaled.values == [loss.values[0] * 2.0**16]
            gm.backward(scaled)
        assert list(model.parameters())[0].grad.values == [1.0, 2.0]  # unscaled at exit
    assert opt.step() == "stepped"


def test_an_overflow_in_one_loss_backs_off_and_skips_only_that_loss(capable_fake):
    """The GAN case: D's overflow halves D's scale and skips D's step; G's scale and
    step carry on."""
    d, opt_d = make(capable_fake, values=[(0.5, -1.0)])
    g, opt_g = make(capable_fake, values=[(1.5, 0.5)])
    amp.initialize([d, g], [opt_d, opt_g], opt_level="O1", num_losses=2)
    for it in range(3):
        overflow = it == 1
        d_before, g_before = list(d.parameters())[0].values, list(g.parameters())[0].values
        step(d, opt_d, x=(math.inf if overflow else 1.0, 1.0), loss_id=0)
        step(g, opt_g, x=(1.0, 1.0), loss_id=1)
        assert (list(d.parameters())[0].values == d_before) == overflow
        assert list(g.parameters())[0].values != g_before
    assert amp.loss_scaler(0).get_scale() == 2.0**15
    assert amp.loss_scaler(1).get_scale() == 2.0**16
    assert amp.loss_scaler(0).stats()["skipped_steps"] == 1
    assert amp.loss_scaler(1).stats()["skipped_steps"] == 0
    assert (opt_d.steps, opt_g.steps) == (2, 3)  # the skipped step never reached SGD


def test_one_host_sync_per_scale_loss_however_many_optimizers(capable_fake):
    (a, opt_a), (b, opt_b) = make(capable_fake), make(capable_fake)
    amp.initialize([a, b], [opt_a, opt_b])
    gm = amp.GradManager(list(a.parameters()) + list(b.parameters()))
    with gm:
        loss = FakeTensor([0.0], deps=a(FakeTensor([1.0, 1.0])).deps
                          + b(FakeTensor([1.0, 1.0])).deps)
        with amp.scale_loss(loss, [opt_a, opt_b]) as scaled:
            gm.backward(scaled)
    assert capable_fake.syncs == 1


def test_two_losses_into_one_optimizer_add_at_true_scale(capable_fake):
    """apex's 'two losses, one optimizer' pattern: each loss is unscaled by its own scale,
    so the gradients add up right even though the scales differ."""
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt, num_losses=2, loss_scale="dynamic")
    amp.loss_scaler(1).scale_factor = 8.0
    gm = amp.GradManager(list(model.parameters()))
    for loss_id, x in ((0, (1.0, 2.0)), (1, (10.0, 20.0))):
        with gm:
            loss = model(FakeTensor(x))
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                gm.backward(scaled)
    assert list(model.parameters())[0].grad.values == [11.0, 22.0]


def test_delay_unscale_accumulates_and_unscales_once(capable_fake):
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt, num_losses=2)
    gm = amp.GradManager(list(model.parameters()))
    w = list(model.parameters())[0]
    for i, x in enumerate(((1.0, 2.0), (3.0, 4.0), (5.0, 6.0))):
        last = i == 2
        with gm:
            with amp.scale_loss(model(FakeTensor(x)), opt, delay_unscale=not last) as s:
                gm.backward(s)
        if not last:
            assert w.grad.values[0] > 1000  # still scaled
            with pytest.raises(RuntimeError, match="still scaled by loss scale 0"):
                opt.step()
            with pytest.raises(RuntimeError, match="still scaled by loss scale 0"):
                with amp.scale_loss(model(FakeTensor(x)), opt, loss_id=1):
                    pass
    assert w.grad.values == [9.0, 12.0]
    assert amp.loss_scaler(0).stats()["steps"] == 1  # one unscale, one update


def test_an_exception_in_the_block_puts_the_gradients_back(capable_fake):
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt)
    w = list(model.parameters())[0]
    w.grad = FakeTensor([1.0, 1.0])
    with pytest.raises(KeyError):
        with amp.scale_loss(model(FakeTensor([1.0, 2.0])), opt):
            raise KeyError("user code")
    assert w.grad.values == [1.0, 1.0]


def test_min_max_and_fixed_loss_scales(capable_fake):
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt, min_loss_scale=2.0**15, max_loss_scale=2.0**15)
    assert amp.loss_scaler().get_scale() == 2.0**15  # apex starts at min(2**16, max)
    step(model, opt, x=(math.inf, 1.0))
    assert amp.loss_scaler().get_scale() == 2.0**15  # the floor holds
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt, loss_scale=128.0)
    for x in ((math.inf, 1.0), (1.0, 1.0)):
        step(model, opt, x=x)
        assert amp.loss_scaler().get_scale() == 128.0  # fixed: skipped, never changed
    assert amp.loss_scaler().stats()["skipped_steps"] == 1


def test_growth_is_capped_by_max_loss_scale(capable_fake):
    model, opt = make(capable_fake, values=[(0.5, -1.0)])
    amp.initialize(model, opt, max_loss_scale=2.0**16)
    amp.loss_scaler().set_growth_interval(1)
    step(model, opt)
    assert amp.loss_scaler().get_scale() == 2.0**16
    assert amp.loss_scaler().stats()["growth_tracker"] == 0


# -- master weights ----------------------------------------------------------------------
def test_o2_steps_the_masters_and_copies_them_back(capable_fake):
    model, opt = make(capable_fake, values=[(0.1, -0.3)])
    w = list(model.parameters())[0]
    amp.initialize(model, opt, opt_level="O2")
    (master,) = amp.master_params(opt)
    assert master.values == [0.1, -0.3]  # the exact float32 weights, not the float16 ones
    assert w.values == [0.0999755859375, -0.300048828125]
    step(model, opt, x=(0.25, 0.5))  # scaled gradients 2**14, 2**15: no overflow
    assert master.values == [0.1 - 0.025, -0.3 - 0.05]
    assert w.values == [0.07501220703125, -0.35009765625]  # the masters, rounded
    assert master.grad is None and w.grad is None  # master grads live until the step


def test_o2_overflow_in_float16_gradients_skips_with_everything_bit_identical(capable_fake):
    model, opt = make(capable_fake, values=[(0.1, -0.3)])
    w = list(model.parameters())[0]
    amp.initialize(model, opt, opt_level="O2")
    (master,) = amp.master_params(opt)
    before = (list(w.values), list(master.values))
    # 2**16 * 2.0 overflows float16's range (65504) in the model's own gradient
    assert step(model, opt, x=(1.0, 2.0)) is None
    assert (w.values, master.values) == before
    assert w.grad is None and master.grad is None
    assert amp.loss_scaler().get_scale() == 2.0**15 and opt.steps == 0
    step(model, opt, x=(1.0, 1.0))
    assert master.values != before[1] and opt.steps == 1


def test_o2_checkpoint_carries_the_masters(capable_fake):
    model, opt = make(capable_fake, values=[(0.1, -0.3)])
    amp.initialize(model, opt, opt_level="O2")
    step(model, opt, x=(0.3, 0.7))
    saved_opt, saved_amp = opt.state_dict(), amp.state_dict()
    (master,) = amp.master_params(opt)
    assert saved_opt[opt_levels._patch.MASTER_KEY][0].values == master.values

    model2, opt2 = make(capable_fake, values=[(5.0, 5.0)])
    amp.initialize(model2, opt2, opt_level="O2")
    opt2.load_state_dict(saved_opt)
    amp.load_state_dict(saved_amp)
    (master2,) = amp.master_params(opt2)
    assert master2.values == master.values
    assert list(model2.parameters())[0].values == list(model.parameters())[0].values
    assert opt2.state == {master2: 1}
    with pytest.raises(ValueError, match="holds 2 master weights, this optimizer 1"):
        opt2.load_state_dict(dict(saved_opt, **{
            opt_levels._patch.MASTER_KEY: [master, master]}))


def test_o2_checkpoint_without_masters_starts_them_from_the_model(capable_fake):
    model, opt = make(capable_fake, values=[(0.1, -0.3)])
    amp.initialize(model, opt, opt_level="O2")
    list(model.parameters())[0].values = [0.5, 0.25]  # as model.load_state_dict would
    opt.load_state_dict({"state": {}, "lr": 0.1})
    assert list(amp.master_params(opt))[0].values == [0.5, 0.25]


# -- state dicts and the switch ----------------------------------------------------------
def test_state_dict_holds_every_loss_scale_and_round_trips(capable_fake):
    model, opt = make(capable_fake)
    amp.initialize(model, opt, num_losses=2)
    amp.loss_scaler(1).scale_factor = 4.0
    saved = amp.state_dict()
    counters = {"steps": 0, "skipped_steps": 0, "last_step_skipped": False}
    assert saved == {
        "loss_scaler0": {"scale": 2.0**16, "scale_factor": 2.0**16, "growth_factor": 2.0,
                         "backoff_factor": 0.5, "growth_interval": 2000,
                         "_growth_tracker": 0, **counters},
        "loss_scaler1": {"scale": 4.0, "scale_factor": 4.0, "growth_factor": 2.0,
                         "backoff_factor": 0.5, "growth_interval": 2000,
                         "_growth_tracker": 0, **counters}}
    model, opt = make(capable_fake)
    amp.initialize(model, opt, num_losses=2)
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved
    with pytest.raises(ValueError, match=r"num_losses=2, which expects"):
        amp.load_state_dict({"loss_scaler0": saved["loss_scaler0"]})
    bad = dict(saved, loss_scaler1=dict(saved["loss_scaler1"], backoff_factor=2.0))
    with pytest.raises(ValueError, match="entry 'loss_scaler1'"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == saved  # nothing was loaded


def test_load_state_dict_reads_apex_checkpoints(capable_fake):
    model, opt = make(capable_fake)
    amp.initialize(model, opt)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
    assert amp.state_dict()["loss_scaler0"]["scale"] == 1024.0
    assert amp.loss_scaler().stats()["growth_tracker"] == 7


def test_disabled_and_o0_are_pass_throughs(capable_fake):
    model, opt = make(capable_fake)
    forward = model.forward
    assert amp.initialize(model, opt, enabled=False) == (model, opt)
    assert model.forward == forward and opt.step.__func__ is FakeOptimizer.step
    loss = FakeTensor([3.0])
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert amp.opt_properties() is None
    model, opt = make(capable_fake)
    amp.initialize(model, opt, opt_level="O0")
    assert opt.step.__func__ is FakeOptimizer.step  # O0 wraps nothing
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert amp.state_dict() == {"loss_scaler0": {}}
