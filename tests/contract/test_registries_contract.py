"""apex's function registries on the real backends: the dtype of a registered function
under autocast before and after ``register_float_function``,
``register_half_function`` and ``register_promote_function``; nothing changes outside
autocast; registrations reach the framework's own modules and ``amp.initialize``'s
forward; registering after ``initialize``, a bad namespace or a bad name are clear
errors."""

import gc

import numpy as np
import pytest

import unified_amp as amp
from unified_amp import cast_registry

from .loops import bits

X = np.linspace(-2, 2, 8).reshape(2, 4)
W = np.linspace(-1, 1, 12).reshape(3, 4)
B = np.zeros(3)


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """Each test starts as a fresh process: no registration, no initialize; the
    functions it registers are put back afterwards."""
    # Earlier tests' initialize() calls end with their models and optimizers, which
    # wait in reference cycles (their patched methods): collect them.
    gc.collect()
    yield
    cast_registry._unregister_all()


def linear(kit, device, x_dtype="float32"):
    return kit.linear(kit.tensor(X, device, x_dtype), kit.tensor(W, device),
                      kit.tensor(B, device))


def under_autocast(device, fn):
    with amp.autocast(dtype="float16", device=device):
        return fn()


@pytest.mark.parametrize("by_name", [False, True])
def test_register_float_function_runs_it_in_float32(kit, device, by_name):
    namespace, dotted = kit.registry_namespace("linear")
    before = under_autocast(device, lambda: linear(kit, device))
    amp.register_float_function(dotted if by_name else namespace, "linear")
    after = under_autocast(device, lambda: linear(kit, device))
    assert (kit.dtype_name(before), kit.dtype_name(after)) == ("float16", "float32")
    outside = linear(kit, device)
    np.testing.assert_allclose(kit.numpy(after), kit.numpy(outside), rtol=1e-6)
    # float16 inputs are cast up too
    x16, w16 = kit.tensor(X, device, "float16"), kit.tensor(W, device, "float16")
    assert kit.dtype_name(under_autocast(device, lambda: kit.linear(x16, w16, None))) == "float32"


def test_register_half_function_runs_it_in_autocasts_dtype(kit, device):
    namespace, _ = kit.registry_namespace("sigmoid")
    x = kit.tensor(X, device)
    before = under_autocast(device, lambda: kit.sigmoid(x))
    amp.register_half_function(namespace, "sigmoid")
    after = under_autocast(device, lambda: kit.sigmoid(x))
    assert (kit.dtype_name(before), kit.dtype_name(after)) == ("float32", "float16")
    want = kit.numpy(kit.sigmoid(kit.tensor(X, device, "float16")))
    assert bits([kit.numpy(after)]) == bits([want])


def test_register_promote_function_runs_it_in_the_widest_input_dtype(kit, device):
    namespace, _ = kit.registry_namespace("linear")
    before = under_autocast(device, lambda: linear(kit, device, "float16"))
    amp.register_promote_function(namespace, "linear")
    after = under_autocast(device, lambda: linear(kit, device, "float16"))
    assert (kit.dtype_name(before), kit.dtype_name(after)) == ("float16", "float32")
    # all float16: the widest is float16, and it stays there
    x16, w16 = kit.tensor(X, device, "float16"), kit.tensor(W, device, "float16")
    assert kit.dtype_name(under_autocast(device, lambda: kit.linear(x16, w16, None))) == "float16"


def test_outside_autocast_a_registered_function_is_unchanged(kit, device):
    plain = [linear(kit, device), kit.sigmoid(kit.tensor(X, device))]
    amp.register_float_function(kit.registry_namespace("linear")[0], "linear")
    amp.register_half_function(kit.registry_namespace("sigmoid")[0], "sigmoid")
    again = [linear(kit, device), kit.sigmoid(kit.tensor(X, device))]
    assert [kit.dtype_name(t) for t in again] == ["float32", "float32"]
    assert bits([kit.numpy(t) for t in again]) == bits([kit.numpy(t) for t in plain])


def test_a_registration_reaches_initialize_and_the_frameworks_modules(kit, device):
    """apex's use: register, then initialize at O1. The model's Linear layers (which
    bind the function by name on MegEngine) now run in float32."""
    amp.register_float_function(kit.registry_namespace("linear")[0], "linear")
    model = kit.apex_model(device)
    model, opt = amp.initialize(model, kit.sgd(list(model.parameters()), 0.1),
                                opt_level="O1", low_dtype="float16")
    model(kit.tensor(np.ones((2, 4)), device))
    assert model.seen["activations"] == "float32"


def test_registering_twice_keeps_one_wrapper_and_the_last_kind(kit, device):
    namespace, _ = kit.registry_namespace("linear")
    x16, w16 = kit.tensor(X, device, "float16"), kit.tensor(W, device, "float16")
    amp.register_float_function(namespace, "linear")
    wrapper = namespace.linear
    amp.register_float_function(namespace, "linear")
    assert kit.dtype_name(under_autocast(device, lambda: kit.linear(x16, w16, None))) == "float32"
    amp.register_promote_function(namespace, "linear")
    assert namespace.linear is wrapper
    # promote now: every input float16, so float16
    assert kit.dtype_name(under_autocast(device, lambda: kit.linear(x16, w16, None))) == "float16"
    cast_registry._unregister_all()
    assert namespace.linear is not wrapper


def test_registering_after_initialize_raises_as_apex_requires(kit, device):
    model = kit.apex_model(device)
    amp.initialize(model, kit.sgd(list(model.parameters()), 0.1), opt_level="O1")
    namespace, _ = kit.registry_namespace("sigmoid")
    original = namespace.sigmoid
    for register in (amp.register_float_function, amp.register_half_function,
                     amp.register_promote_function):
        with pytest.raises(RuntimeError, match=r"after amp\.initialize\(\).*before"):
            register(namespace, "sigmoid")
    assert namespace.sigmoid is original


def test_a_bad_namespace_or_name_is_a_clear_error(kit, device):
    namespace, dotted = kit.registry_namespace("linear")
    with pytest.raises(TypeError, match="namespace must be a module or a class.*got a int"):
        amp.register_float_function(42, "linear")
    with pytest.raises(ValueError, match=r"cannot import the namespace 'no_such\.module'"):
        amp.register_half_function("no_such.module", "linear")
    with pytest.raises(ValueError, match=rf"no function named 'linaer' in {dotted}\."
                                         r" Did you mean 'linear'"):
        amp.register_promote_function(namespace, "linaer")
    with pytest.raises(TypeError, match="the name must be a function's name as a str"):
        amp.register_float_function(namespace, namespace.linear)
    modules, cls = kit.module_class_in_namespace()
    with pytest.raises(TypeError, match=r"is a class, not a function; .*amp\.keep_float32"):
        amp.register_float_function(modules, cls)
    with pytest.raises(TypeError, match=r"__name__ is a str, not a function"):
        amp.register_float_function(namespace, "__name__")
    assert not cast_registry._entries
