"""A value that is not the active backend's tensor gets ``amp.TensorTypeError`` at once,
naming the value, its framework and the fix (issue 29: a NumPy array once came back from
``scale()`` as a ``map`` that failed later inside the framework; a MegEngine tensor given
to the torch backend never said it was MegEngine's, nor how to select MegEngine).

The core reads a value's framework from its type's module names (it imports no
framework), so a stand-in class whose ``__module__`` is the framework's tells it apart
the way the real class does; tests/contract/test_foreign_values_contract.py checks
those names against the real tensor classes of the active framework.
"""

import numpy as np
import pytest

import unified_amp as amp

from .fake_backend import FakeTensor, linear_loss


def stand_in(module, name="Tensor"):
    """An object whose class says it lives in ``module``, as real framework classes do;
    iterable, as both frameworks' tensors are (torch.amp's scale() maps over those)."""
    return type(name, (), {"__module__": module, "__repr__": lambda self: f"{name}(1.0)",
                           "__iter__": lambda self: iter([1.0])})()


FOREIGN = [("megengine.tensor", "MegEngine", "megengine"), ("torch", "PyTorch", "torch")]


@pytest.mark.parametrize("module, shown, name", FOREIGN, ids=["megengine", "torch"])
def test_another_frameworks_tensor_names_its_framework_and_the_setting(fake, module, shown,
                                                                       name):
    scaler = amp.GradScaler()
    with pytest.raises(amp.TensorTypeError) as info:
        scaler.scale(stand_in(module))
    message = str(info.value)
    assert f"It is a {shown} Tensor" in message
    assert f"UNIFIED_AMP_BACKEND={name}" in message
    assert f"amp.set_backend({name!r})" in message
    assert "active backend is 'fake' (chosen by amp.set_backend())" in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_a_subclass_of_a_framework_class_counts_as_that_frameworks(fake):
    base = type("Module", (), {"__module__": "torch.nn.modules.module"})
    model = type("MyNet", (base,), {"__module__": "__main__"})()
    with pytest.raises(TypeError, match="It is a PyTorch MyNet"):
        amp.keep_float32(model)
    with pytest.raises(TypeError, match="UNIFIED_AMP_BACKEND=torch"):
        amp.trace_forward(model)
    with pytest.raises(TypeError, match="amp.set_backend\\('torch'\\)"):
        amp.GradScaler().watch(model)


def test_another_frameworks_parameters_name_their_framework(fake):
    params = [stand_in("megengine.tensor", "Parameter") for _ in range(2)]
    with pytest.raises(TypeError, match="It is a MegEngine Parameter.*"
                                        "UNIFIED_AMP_BACKEND=megengine"):
        amp.GradManager(iter(params))
    with pytest.raises(TypeError, match="It is a MegEngine Parameter"):
        amp.clip_grad_norm(params, 1.0)


def test_scaler_backward_refuses_a_foreign_output_before_any_backward(fake):
    w = FakeTensor([1.0])
    gm = amp.GradManager([w])
    scaler = amp.GradScaler(init_scale=4.0)
    with gm:
        loss = linear_loss([w], [[1.0]])
        with pytest.raises(amp.TensorTypeError, match="y is Tensor.*It is a MegEngine"):
            scaler.backward(gm, stand_in("megengine.tensor"))
        with pytest.raises(amp.TensorTypeError, match=r"y\[1\] is ndarray.*NumPy array"):
            scaler.backward(gm, [loss, np.ones(1, "float32")])
        scaler.backward(gm, loss)  # nothing was spent on the refused calls
    assert w.grad.values == [1.0] and scaler.stats()["steps"] == 1


@pytest.mark.parametrize("value, what", [
    (np.ones(1, "float32"), "NumPy array of shape (1,)"),
    (np.ones((2, 3)), "NumPy array of shape (2, 3)"),
    (np.float32(1.0), "NumPy scalar"),
], ids=["array", "2d-array", "scalar"])
def test_a_numpy_value_is_refused_at_once_not_mapped(fake, value, what):
    scaler = amp.GradScaler()
    with pytest.raises(amp.TensorTypeError) as info:
        scaler.scale(value)
    message = str(info.value)
    assert what in message and type(value).__name__ in message
    assert "pass the fake tensor your model or loss function returned" in message
    with pytest.raises(amp.TensorTypeError, match=r"outputs\[1\] is"):
        scaler.scale((FakeTensor([1.0]), value))


def test_other_non_tensors_keep_the_plain_fix(fake):
    with pytest.raises(amp.TensorTypeError, match="outputs is float 1.5. Scale only the loss"):
        amp.GradScaler().scale(1.5)


def test_iterables_of_tensors_still_map_lazily_as_torch_amp_does(fake):
    scaler = amp.GradScaler(init_scale=4.0)
    out = scaler.scale(t for t in [FakeTensor([1.0]), FakeTensor([2.0])])
    assert isinstance(out, map)
    assert [t.values for t in out] == [[4.0], [8.0]]
    listed = scaler.scale([FakeTensor([1.0]), (FakeTensor([0.5]),)])
    assert isinstance(listed, list) and isinstance(listed[1], tuple)
    assert listed[0].values == [4.0] and listed[1][0].values == [2.0]


def test_the_error_is_public_and_documented():
    assert amp.TensorTypeError.__name__ in amp.__all__
    assert issubclass(amp.TensorTypeError, amp.UnifiedAmpError)
