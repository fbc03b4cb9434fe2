"""GradScaler's state machine on the fake backend: rules, errors, checkpoints, syncs."""

import math
import pickle
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

import unified_amp as amp
from unified_amp import _registry

from ..reference import trajectory
from .fake_backend import FakeBackend, FakeOptimizer, FakeTensor, linear_loss


def make_model(n=3):
    params = [FakeTensor([1.0, 2.0]), FakeTensor([0.5])][: max(1, min(n, 2))]
    return params, FakeOptimizer(params)


def train_step(scaler, params, opt, overflow, mode="torch"):
    """One iteration; `overflow` puts an inf into the loss's derivative."""
    coeffs = [[math.inf if overflow else 1.0] + [0.5] * (len(p.values) - 1) for p in params]
    gm = amp.GradManager(params)
    if mode == "torch":  # scale -> backward -> step -> update
        with gm:
            gm.backward(scaler.scale(linear_loss(params, coeffs)))
        scaler.step(opt)
        scaler.update()
    else:  # megengine automatic mode, optimizer's own step
        with gm:
            scaler.backward(gm, linear_loss(params, coeffs))
        opt.step()
    gm.zero_grad()


# -- the scale rule ----------------------------------------------------------------------
SCRIPTS = {
    "clean": [False] * 7,
    "overflow-first": [True, False, False, False, False],
    "alternating": [True, False] * 4,
    "burst": [False, False, True, True, True, False, False, False, False],
}


@pytest.mark.parametrize("mode", ["torch", "megengine"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripted_sequences_follow_the_reference_model(fake, script, mode):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=2.0**10, growth_interval=3)
    got = []
    for overflow in SCRIPTS[script]:
        train_step(scaler, params, opt, overflow, mode)
        got.append((scaler.get_scale(), scaler.stats()["growth_tracker"]))
    assert got == trajectory(2.0**10, 2.0, 0.5, 3, SCRIPTS[script])


@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=30),
    init_scale=st.floats(1e-3, 1e6),
    growth_factor=st.floats(1.0001, 8.0),
    backoff_factor=st.floats(0.01, 0.99),
    growth_interval=st.integers(0, 5),
)
def test_property_any_sequence_matches_reference(overflows, init_scale, growth_factor,
                                                 backoff_factor, growth_interval):
    from .fake_backend import FakeBackend

    backend = FakeBackend()
    amp.register_backend("fake", lambda: backend)
    amp.set_backend("fake")
    try:
        params, opt = make_model()
        scaler = amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        got = []
        for overflow in overflows:
            train_step(scaler, params, opt, overflow)
            got.append((scaler.get_scale(), scaler.stats()["growth_tracker"]))
        assert got == trajectory(init_scale, growth_factor, backoff_factor,
                                 growth_interval, overflows)
        stats = scaler.stats()
        assert stats["steps"] == len(overflows)
        assert stats["skipped_steps"] == sum(overflows)
        assert stats["last_step_skipped"] == overflows[-1]
        assert opt.steps == len(overflows) - sum(overflows)
        assert backend.syncs == len(overflows)  # exactly one device-to-host read per step
    finally:
        from unified_amp import _registry
        _registry._reset_for_tests()


def test_growth_stops_before_float32_overflow(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=2.0**126, growth_interval=1)
    for _ in range(3):
        train_step(scaler, params, opt, False)
    assert scaler.get_scale() == 2.0**127  # 2**128 is not a float32


def test_growth_interval_zero_never_grows_but_backs_off(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=8.0, growth_interval=0)
    for overflow in [False] * 5 + [True]:
        train_step(scaler, params, opt, overflow)
    assert scaler.get_scale() == 4.0


# -- skipping --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["torch", "megengine"])
def test_overflow_skips_step_and_leaves_params_untouched(fake, mode):
    params, opt = make_model()
    before = [list(p.values) for p in params]
    scaler = amp.GradScaler()
    train_step(scaler, params, opt, overflow=True, mode=mode)
    assert [p.values for p in params] == before
    assert opt.steps == (0 if mode == "torch" else 1)  # the optimizer's own step ran...
    assert all(p.grad is None for p in params)  # ...but had no gradients to apply
    assert scaler.get_scale() == 2.0**15 and scaler.stats()["last_step_skipped"]


def test_step_returns_optimizer_result_or_none_when_skipped(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    for overflow, expected in [(False, "stepped"), (True, None)]:
        gm = amp.GradManager(params)
        coeffs = [[math.inf if overflow else 1.0] * len(p.values) for p in params]
        with gm:
            gm.backward(scaler.scale(linear_loss(params, coeffs)))
        assert scaler.step(opt) == expected
        scaler.update()
        gm.zero_grad()


def test_two_optimizers_skip_independently_and_update_once(fake):
    d, g = FakeTensor([1.0]), FakeTensor([1.0])
    opt_d, opt_g = FakeOptimizer([d]), FakeOptimizer([g])
    scaler = amp.GradScaler(init_scale=4.0)
    gm_d, gm_g = amp.GradManager([d]), amp.GradManager([g])
    with gm_d:
        gm_d.backward(scaler.scale(linear_loss([d], [[math.inf]])))
    scaler.step(opt_d)
    with gm_g:
        gm_g.backward(scaler.scale(linear_loss([g], [[1.0]])))
    scaler.step(opt_g)
    scaler.update()
    assert (opt_d.steps, opt_g.steps) == (0, 1)
    assert d.values == [1.0] and g.values == [0.9]
    assert scaler.get_scale() == 2.0 and scaler.stats()["steps"] == 1


def test_unscale_through_gm_then_step_does_not_unscale_again(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = amp.GradManager(params)
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[1.0, 1.0], [1.0]])))
    scaler.unscale(gm)
    assert [p.grad.values for p in params] == [[1.0, 1.0], [1.0]]
    scaler.step(opt)
    scaler.update()
    assert params[0].values == [0.9, 1.9]
    assert fake.syncs == 1


def test_accumulation_unscales_once(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=8.0)
    gm = amp.GradManager(params)
    for _ in range(4):
        with gm:
            gm.backward(scaler.scale(linear_loss(params, [[1.0, 1.0], [1.0]])))
    scaler.unscale(opt)
    assert params[1].grad.values == [4.0]
    scaler.step(opt)
    scaler.update()
    assert fake.syncs == 1


# -- misuse ----------------------------------------------------------------------------
def _scaled_backward(scaler, params):
    gm = amp.GradManager(params)
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[1.0] * len(p.values) for p in params])))
    return gm


def test_unscaling_an_optimizer_twice_is_an_error(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    _scaled_backward(scaler, params)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this"
                                           r" optimizer since the last update\(\)"):
        scaler.unscale_(opt)


def test_unscaling_the_same_gradients_twice_is_an_error(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    gm = _scaled_backward(scaler, params)
    grads_before = [list(p.grad.values) for p in params]
    scaler.unscale(gm)
    for target in (gm, params, [params[1]], opt):
        with pytest.raises(RuntimeError, match="already been called on these gradients"):
            scaler.unscale(target)
    # the failed calls changed nothing
    assert [p.grad.values for p in params] == [[v / 2**16 for v in g] for g in grads_before]
    scaler.update()
    _scaled_backward(scaler, params)
    scaler.unscale(gm)  # fine again after update()


def test_unscale_after_step_is_an_error(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    _scaled_backward(scaler, params)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)


def test_stepping_twice_is_an_error(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    _scaled_backward(scaler, params)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(opt)
    assert opt.steps == 1


def test_update_with_nothing_unscaled_is_an_error_unless_new_scale(fake):
    scaler = amp.GradScaler()
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update") \
            as error:
        scaler.update()
    # torch.amp asserts here: ours is an AssertionError too, on every backend
    assert isinstance(error.value, AssertionError)
    assert isinstance(error.value, amp.ScalerStateError)
    scaler.update(new_scale=1024.0)
    assert scaler.get_scale() == 1024.0 and scaler.stats()["steps"] == 0


def test_closure_is_rejected(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_bad_targets_are_type_errors(fake):
    scaler = amp.GradScaler()
    with pytest.raises(TypeError, match="GradManager, an optimizer, a module, or an iterable"):
        scaler.unscale(42)
    with pytest.raises(TypeError, match="expects an optimizer"):
        scaler.step([FakeTensor([1.0])])
    with pytest.raises(ValueError, match=r"tensor or a list/tuple of them; outputs is float 3.0"):
        scaler.scale(3.0)
    with pytest.raises(ValueError, match=r"outputs\[1\] is float 2.0"):
        scaler.scale([FakeTensor([1.0]), 2.0])
    with pytest.raises(TypeError, match="expects a GradManager .* got FakeOptimizer .*optimizer"):
        scaler.backward(FakeOptimizer([]), FakeTensor([1.0]))


def test_float16_gradients_are_refused(fake):
    p = FakeTensor([1.0], dtype="float16")
    scaler = amp.GradScaler()
    gm = amp.GradManager([p])
    with gm:
        gm.backward(scaler.scale(linear_loss([p], [[1.0]])))
    assert p.grad.dtype == "float16"
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale([p])


class _Float32OnlyBackend(FakeBackend):
    """An adapter whose fused check takes float32 gradients only (as MegEngine's): it
    refuses anything else itself, before any kernel runs."""

    def __init__(self):
        super().__init__()
        self.kernel_calls = 0

    def unscale_and_check(self, grads, inv_scale, allow_float16=False):
        for g in grads:
            if g.dtype != "float32":
                raise ValueError(f"the fused check takes float32 only; got {g.dtype}")
        self.kernel_calls += 1
        return super().unscale_and_check(grads, inv_scale, allow_float16)


@pytest.mark.parametrize("dtype,message", [
    ("float16", "Attempting to unscale FP16 gradients"),  # the core's words, as before
    ("bfloat16", "the fused check takes float32 only; got bfloat16"),  # the adapter's
])
def test_an_adapter_that_refuses_non_float32_keeps_the_core_message_for_float16(
        dtype, message):
    backend = _Float32OnlyBackend()
    amp.register_backend("fake", lambda: backend)
    amp.set_backend("fake")
    try:
        ok, low = FakeTensor([1.0]), FakeTensor([1.0], dtype=dtype)
        scaler = amp.GradScaler(init_scale=4.0)
        gm = amp.GradManager([ok, low])
        with gm:
            gm.backward(scaler.scale(linear_loss([ok, low], [[1.0], [1.0]])))
        with pytest.raises(ValueError, match=message):
            scaler.unscale(gm)
        assert backend.kernel_calls == 0 and ok.grad.values == [4.0]  # nothing unscaled
    finally:
        _registry._reset_for_tests()


# -- validation ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,fragment", [
    ({"growth_factor": 1.0}, "growth_factor must be > 1.0"),
    ({"growth_factor": 0.5}, "growth_factor must be > 1.0"),
    ({"backoff_factor": 1.0}, "backoff_factor must be in (0, 1)"),
    ({"backoff_factor": 0.0}, "backoff_factor must be in (0, 1)"),
    ({"backoff_factor": -0.5}, "backoff_factor must be in (0, 1)"),
    ({"init_scale": 0.0}, "init_scale must be a positive finite number"),
    ({"init_scale": -1.0}, "init_scale must be a positive finite number"),
    ({"init_scale": math.inf}, "init_scale must be a positive finite number"),
    ({"init_scale": math.nan}, "init_scale must be a positive finite number"),
    ({"growth_interval": -1}, "growth_interval must be >= 0"),
])
def test_invalid_hyperparameters_are_value_errors_naming_the_value(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        amp.GradScaler(**kwargs)
    assert fragment in str(info.value)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


@pytest.mark.parametrize("kwargs", [{"growth_interval": 2.5}, {"init_scale": "big"},
                                    {"enabled": 1}, {"growth_factor": True}])
def test_wrongly_typed_hyperparameters_are_type_errors(kwargs):
    with pytest.raises(TypeError):
        amp.GradScaler(**kwargs)


def test_call_forms_of_both_natives():
    torch_style = amp.GradScaler("cpu", 2.0**10, 3.0, 0.25, 7)
    assert (torch_style.get_scale(), torch_style.get_growth_factor(),
            torch_style.get_backoff_factor(), torch_style.get_growth_interval()) == (
        2.0**10, 3.0, 0.25, 7)
    assert amp.GradScaler(device="cpu", init_scale=8.0).get_scale() == 8.0
    assert amp.GradScaler(2.0**4).scale_factor == 16.0  # megengine.amp's positional form
    assert amp.GradScaler().get_scale() == 2.0**16  # one default on both backends


def test_cuda_scaler_without_cuda_disables_with_warning(fake):
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = amp.GradScaler("cuda")
    assert not scaler.is_enabled()


def test_setters_validate():
    scaler = amp.GradScaler()
    with pytest.raises(ValueError):
        scaler.set_growth_factor(0.9)
    with pytest.raises(ValueError):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(ValueError):
        scaler.set_growth_interval(-3)
    with pytest.raises(ValueError):
        scaler.scale_factor = -1.0
    scaler.scale_factor = 3.0
    assert scaler.get_scale() == 3.0


# -- state dict --------------------------------------------------------------------------
def test_state_dict_has_torch_keys_and_plain_numbers(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=64.0, growth_interval=2)
    for overflow in (False, True, False):
        train_step(scaler, params, opt, overflow)
    sd = scaler.state_dict()
    assert sd == {"scale": 32.0, "scale_factor": 32.0, "growth_factor": 2.0,
                  "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 1,
                  "steps": 3, "skipped_steps": 1, "last_step_skipped": False}
    assert [type(v) for v in sd.values()] == [float, float, float, float, int, int, int,
                                              int, bool]


def test_round_trip_continues_identically(fake):
    params, opt = make_model()
    a = amp.GradScaler(init_scale=64.0, growth_interval=2)
    seq = [False, True, False, False, False, True, False, False]
    for overflow in seq[:3]:
        train_step(a, params, opt, overflow)
    b = amp.GradScaler()
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    for overflow in seq[3:]:
        train_step(a, params, opt, overflow)
        train_step(b, params, opt, overflow)
        assert a.state_dict() == b.state_dict()


def test_load_accepts_megengine_dict(fake):
    scaler = amp.GradScaler()
    scaler.load_state_dict({"scale_factor": 16.0, "growth_factor": 2.0,
                            "backoff_factor": 0.5, "growth_interval": 100,
                            "_growth_tracker": 7})
    assert scaler.scale_factor == 16.0 and scaler.stats()["growth_tracker"] == 7


GOOD = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10,
        "_growth_tracker": 3}


@pytest.mark.parametrize("change,fragment", [
    ({"scale": None}, "no 'scale'"),
    ({"growth_factor": None}, "missing ['growth_factor']"),
    ({"_growth_tracker": None}, "missing ['_growth_tracker']"),
    ({"scale": math.inf}, "scale must be a positive finite number"),
    ({"scale": "8"}, "scale must be a number"),
    ({"growth_interval": 1.5}, "growth_interval must be an int"),
    ({"_growth_tracker": -1}, "_growth_tracker must be an int >= 0"),
    ({"backoff_factor": 2.0}, "backoff_factor must be in (0, 1)"),
    ({"scale_factor": 4.0}, "disagree"),
    ({"steps": 3}, "some of the counters"),
    ({"steps": 3, "skipped_steps": 4, "last_step_skipped": True}, "skipped_steps <= steps"),
    ({"steps": True, "skipped_steps": 0, "last_step_skipped": False}, "must be ints"),
    ({"steps": 3, "skipped_steps": 0, "last_step_skipped": True}, "True only if"),
    ({"steps": 3, "skipped_steps": 1, "last_step_skipped": 1}, "must be a bool"),
])
def test_malformed_state_dict_is_rejected_and_changes_nothing(change, fragment):
    scaler = amp.GradScaler(init_scale=2.0, growth_interval=5)
    before = scaler.state_dict()
    bad = {**GOOD, **change}
    bad = {k: v for k, v in bad.items() if v is not None}
    with pytest.raises(amp.StateDictError) as info:
        scaler.load_state_dict(bad)
    assert fragment in str(info.value)
    assert scaler.state_dict() == before


def test_empty_or_non_mapping_state_dict():
    scaler = amp.GradScaler()
    with pytest.raises(ValueError, match="empty"):
        scaler.load_state_dict({})
    with pytest.raises(TypeError, match="expects a state dict"):
        scaler.load_state_dict([("scale", 1.0)])


def test_pickling_mid_iteration_is_refused(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    _scaled_backward(scaler, params)
    scaler.unscale(opt)
    with pytest.raises(RuntimeError, match="only be pickled"):
        pickle.dumps(scaler)
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()


# -- disabled ----------------------------------------------------------------------------
def test_disabled_scaler_is_a_pass_through(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(enabled=False)
    loss = linear_loss(params, [[1.0, 1.0], [1.0]])
    assert scaler.scale(loss) is loss
    gm = amp.GradManager(params)
    with gm:
        scaler.backward(gm, loss)
    assert params[1].grad.values == [1.0]  # unscaled gradients
    assert scaler.unscale(gm) is scaler
    assert scaler.step(opt) == "stepped"
    scaler.update()
    scaler.update()  # no error: nothing is tracked
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({"anything": 1})  # a no-op, as in torch.amp
    assert scaler.stats()["enabled"] is False and fake.syncs == 0


def test_new_scale_counts_a_step_only_after_an_unscale(fake):
    params, opt = make_model()
    scaler = amp.GradScaler()
    _scaled_backward(scaler, params)
    scaler.step(opt)
    scaler.update(new_scale=4.0)
    assert scaler.get_scale() == 4.0 and scaler.stats()["steps"] == 1
    with pytest.raises(ValueError):
        scaler.update(new_scale=0.0)


def test_megengine_backward_arguments(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = amp.GradManager(params)
    for _ in range(2):  # accumulate without unscaling
        with gm:
            scaler.backward(gm, linear_loss(params, [[1.0, 1.0], [1.0]]), unscale_grad=False)
    assert params[1].grad.values == [8.0]
    scaler.unscale(gm.attached_tensors()).update()
    assert params[1].grad.values == [2.0]
    gm.zero_grad()
    with gm:  # dy is multiplied by the scale; unscaled, but no update when update_scale=False
        scaler.backward(gm, linear_loss(params, [[0.0, 0.0], [1.0]]),
                        dy=FakeTensor([3.0]), update_scale=False)
    assert params[1].grad.values == [3.0]
    assert scaler.stats()["steps"] == 1  # only the first unscale's update() so far
    with pytest.raises(RuntimeError, match="already been called on these gradients"):
        scaler.unscale(gm)
    scaler.update()
    assert scaler.stats()["steps"] == 2
    with pytest.raises(ValueError, match="one dy per y"):
        scaler.backward(gm, [linear_loss(params, [[1.0, 1.0], [1.0]])],
                        dy=[FakeTensor([1.0])] * 2)


def test_stats_before_any_step():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert amp.GradScaler(init_scale=8.0).stats() == {
            "scale": 8.0, "growth_tracker": 0, "steps": 0, "skipped_steps": 0,
            "last_step_skipped": False, "enabled": True, "as_of_step": 0,
            "checks_since_update": 0, "overflows_since_update": 0, "overflows": []}


# -- gradient generations ----------------------------------------------------------------
def test_automatic_mode_then_step_twice_is_an_error_but_the_next_iteration_is_not(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = amp.GradManager(params)
    with gm:
        scaler.backward(gm, linear_loss(params, [[1.0, 1.0], [1.0]]))
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called on these gradients"):
        scaler.step(opt)
    assert opt.steps == 1 and fake.syncs == 1  # the verdict was read once, in backward()
    gm.zero_grad()
    # manual mode right after: a new generation, a new iteration
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[1.0, 1.0], [1.0]])))
    scaler.unscale(gm)
    scaler.step(opt)
    scaler.update()
    assert opt.steps == 2 and scaler.stats()["steps"] == 2


def test_unscale_again_after_new_gradients_without_update_is_allowed(fake):
    """megengine.amp's pattern: backward(update_scale=False) every iteration."""
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = amp.GradManager(params)
    for _ in range(3):
        with gm:
            scaler.backward(gm, linear_loss(params, [[1.0, 1.0], [1.0]]), update_scale=False)
        assert params[1].grad.values == [1.0]
        opt.step()
        gm.zero_grad()
    scaler.update()
    assert scaler.stats()["steps"] == 1


def test_overflow_verdict_outlives_update_until_the_next_backward(fake):
    """backward() drops the overflowed gradients and updates; step() afterwards skips;
    the next backward starts a new generation whose clean verdict steps."""
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = amp.GradManager(params)
    with gm:
        scaler.backward(gm, linear_loss(params, [[math.inf, 1.0], [1.0]]))
    assert all(p.grad is None for p in params)
    assert scaler.step(opt) is None and opt.steps == 0
    with gm:
        scaler.backward(gm, linear_loss(params, [[1.0, 1.0], [1.0]]))
    assert scaler.step(opt) == "stepped"


def test_torch_forms_keep_non_finite_gradients_megengine_forms_drop_them(fake):
    for call, kept in (("unscale_", True), ("unscale", False)):
        params, opt = make_model()
        scaler = amp.GradScaler(init_scale=4.0)
        gm = _scaled_backward_with(scaler, params, math.inf)
        getattr(scaler, call)(opt if call == "unscale_" else gm)
        assert all((p.grad is not None) == kept for p in params)
        assert scaler.step(opt) is None and opt.steps == 0
        scaler.update()
        assert scaler.get_scale() == 2.0


def _scaled_backward_with(scaler, params, first):
    gm = amp.GradManager(params)
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[first] + [1.0] * (len(p.values) - 1)
                                                      for p in params])))
    return gm


def test_a_replaced_gradient_is_a_new_generation(fake):
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = _scaled_backward_with(scaler, params, 1.0)
    scaler.unscale(gm)
    with pytest.raises(RuntimeError, match="already been called on these gradients"):
        scaler.unscale(gm)
    for p in params:  # the user puts freshly scaled gradients in place
        p.grad = FakeTensor([v * 4.0 for v in p.grad.values])
    scaler.unscale(gm)
    assert params[1].grad.values == [1.0]


def test_accumulating_into_unscaled_gradients_is_an_error(fake):
    """Unscaling after every micro-batch: the second backward adds scaled gradients to
    unscaled ones (the fake backend, like MegEngine, accumulates into the same object).
    No unscale can be right, so it raises and changes nothing."""
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = _scaled_backward_with(scaler, params, 1.0)
    scaler.unscale(gm)
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[1.0, 1.0], [1.0]])))
    assert params[1].grad.values == [1.0 + 4.0]
    for call in (lambda: scaler.unscale(gm), lambda: scaler.step(opt)):
        with pytest.raises(RuntimeError, match="mix unscaled and scaled values"):
            call()
    assert params[1].grad.values == [5.0] and opt.steps == 0


def test_after_update_a_gradient_zeroed_in_place_is_a_new_generation(fake):
    """megengine.amp's manual loop with opt.zero_grad() (in place) and
    gm.backward(loss, dy=scale_factor): the scaler sees no backward, but the user's
    update() ends the iteration, so the next unscale is allowed."""
    params, opt = make_model()
    scaler = amp.GradScaler(init_scale=4.0)
    gm = amp.GradManager(params)
    for _ in range(3):
        with gm:
            gm.backward(linear_loss(params, [[1.0, 1.0], [1.0]]),
                        FakeTensor([scaler.scale_factor]))
        scaler.unscale(gm)
        assert params[1].grad.values == [1.0]
        opt.step()
        scaler.update()
        for p in params:
            p.grad.values = [0.0] * len(p.values)  # zeroed in place, same object
    assert scaler.stats()["steps"] == 3