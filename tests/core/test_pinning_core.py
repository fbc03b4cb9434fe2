"""keep_float32 and apex's function registries on the fake backend: what the core does
around a pinned forward and a registered function, independent of any framework."""

import copy
import gc
import pickle
import sys
import types

import pytest

import unified_amp as amp
from unified_amp import cast_registry

from .fake_backend import FakeModule, FakeOptimizer, FakeTensor


@pytest.fixture(autouse=True)
def _forget_state():
    # Earlier tests' initialize() calls end with their models and optimizers, which
    # wait in reference cycles (their patched methods): collect them.
    gc.collect()
    yield
    cast_registry._unregister_all()


def module(fake, values=(0.5, -1.0), children=()):
    return FakeModule([FakeTensor(values)], children, backend=fake)


# -- keep_float32 ---------------------------------------------------------------------
def test_a_pinned_forward_runs_float32_with_autocast_off(fake):
    m = module(fake)
    assert amp.keep_float32(m) is m
    with amp.autocast(dtype="float16"):
        out = m(FakeTensor([1.0, 2.0], "float16"))
        assert amp.is_autocast_enabled()  # restored after the pinned forward
    assert m.seen == [("float32", None)]  # input cast up; autocast off inside
    assert out.dtype == "float32"
    assert fake.autocast_state == [(False, None)]


def test_without_autocast_low_inputs_come_back_in_their_dtype(fake):
    """A model cast to float16 and run without autocast (O3): the pinned module
    computes in float32 and hands its successor the float16 it expects."""
    m = module(fake)
    amp.keep_float32(m)
    out = m(FakeTensor([1.0, 2.0], "float16"))
    assert m.seen == [("float32", None)] and out.dtype == "float16"
    assert m(FakeTensor([1.0, 2.0])).dtype == "float32"  # float32 in, float32 out


def test_idempotent_undone_and_atomic(fake):
    a, b = module(fake), module(fake)
    amp.keep_float32(a, b)
    wrapper = a.forward
    amp.keep_float32(a)
    assert a.forward is wrapper and amp.pinning.is_kept_float32(a)
    amp.keep_float32(a, b, enabled=False)
    assert "forward" not in vars(a) and not amp.pinning.is_kept_float32(b)
    with amp.autocast(dtype="float16"):
        a(FakeTensor([1.0]))
    assert a.seen == [("float32", "float16")]
    with pytest.raises(TypeError, match=r"argument 1 is a FakeTensor: FakeTensor\(\[1\.0\]"):
        amp.keep_float32(a, FakeTensor([1.0]))
    assert not amp.pinning.is_kept_float32(a)  # nothing was pinned


def test_an_instance_forward_is_wrapped_and_given_back(fake):
    m = module(fake)
    calls = []
    m.forward = lambda x: calls.append(x.dtype) or x
    custom = m.forward
    amp.keep_float32(m)
    m(FakeTensor([1.0], "float16"))
    assert calls == ["float32"]
    amp.keep_float32(m, enabled=False)
    assert m.forward is custom


def test_the_pin_travels_with_pickle_and_deepcopy(fake):
    m = module(fake)
    amp.keep_float32(m)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert clone.forward.module is clone
        with amp.autocast(dtype="float16"):
            clone(FakeTensor([1.0], "float16"))
        assert clone.seen[-1] == ("float32", None)


def test_o2_leaves_a_pinned_child_float32_without_masters(capable_fake):
    child = module(capable_fake, (2.0, 3.0))
    model = module(capable_fake, children=[child])
    amp.keep_float32(child)
    opt = FakeOptimizer(list(model.parameters()))
    amp.initialize(model, opt, opt_level="O2")
    own, kept = model._params[0], child._params[0]
    assert (own.dtype, kept.dtype) == ("float16", "float32")
    stepped = opt.param_groups[0]["params"]
    assert stepped[1] is kept and stepped[0] is not own  # a master for the cast one only


def test_pinning_after_o2_restores_the_exact_weights_from_the_masters(capable_fake):
    child = module(capable_fake, (1 + 2.0**-12, 3.0))  # not a float16 value
    model = module(capable_fake, children=[child])
    opt = FakeOptimizer(list(model.parameters()))
    amp.initialize(model, opt, opt_level="O2")
    kept = child._params[0]
    assert kept.dtype == "float16" and kept.values[0] == 1.0
    amp.keep_float32(child)
    assert kept.dtype == "float32" and kept.values == [1 + 2.0**-12, 3.0]
    amp.keep_float32(child, enabled=False)
    assert kept.dtype == "float16"


# -- the registries ---------------------------------------------------------------------
@pytest.fixture
def ns(monkeypatch):
    """A fake framework package: ``fakefw.ops.f`` also bound as ``fakefw.layers.f`` and
    the private ``fakefw._impl.f`` (for a test that selects a fake backend first)."""
    calls = []  # (the dtypes f got, whether autocast was on inside f)

    def f(*tensors, scale=1.0):
        calls.append(([t.dtype for t in tensors], amp.get_backend().autocast_state[-1][0]))
        return FakeTensor([scale * sum(t.values[0] for t in tensors)], tensors[0].dtype)

    mods = {}
    for name in ("fakefw", "fakefw.ops", "fakefw.layers", "fakefw._impl"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    for name in ("fakefw.ops", "fakefw.layers", "fakefw._impl"):
        mods[name].f = f
    yield mods, calls, f


@pytest.mark.parametrize("kind, inputs, want", [
    ("float", ["float16", "float32"], ["float32", "float32"]),
    ("half", ["float16", "float32"], ["float16", "float16"]),
    ("promote", ["float16", "float32"], ["float32", "float32"]),
    ("promote", ["float16", "bfloat16"], ["float32", "float32"]),
    ("promote", ["float16", "float16"], ["float16", "float16"]),
])
def test_each_kind_casts_under_autocast_and_runs_with_it_off(fake, ns, kind, inputs, want):
    mods, calls, f = ns
    getattr(amp, f"register_{kind}_function")(mods["fakefw.ops"], "f")
    args = [FakeTensor([1.0], d) for d in inputs]
    with amp.autocast(dtype="float16"):
        mods["fakefw.ops"].f(*args, scale=2.0)
    mods["fakefw.ops"].f(*args)  # outside autocast: untouched
    assert calls == [(want, False), (inputs, False)]


def test_the_same_framework_bindings_are_patched_and_private_ones_left(fake, ns):
    mods, calls, f = ns
    amp.register_float_function("fakefw.ops", "f")
    assert mods["fakefw.layers"].f is mods["fakefw.ops"].f is not f
    assert mods["fakefw._impl"].f is f
    cast_registry._unregister_all()
    assert mods["fakefw.ops"].f is f and mods["fakefw.layers"].f is f


def test_registering_after_initialize_raises(capable_fake, ns):
    mods, _, f = ns
    model = module(capable_fake)
    amp.initialize(model, FakeOptimizer(list(model.parameters())), opt_level="O1")
    with pytest.raises(RuntimeError, match=r"'fakefw\.ops', 'f'\) was called after"
                                           r" amp\.initialize\(\)"):
        amp.register_half_function(mods["fakefw.ops"], "f")
    assert mods["fakefw.ops"].f is f
