"""Values that are not the active backend's tensors, on each backend (issue 29).

- ``scale()`` of a NumPy array raises ``amp.TensorTypeError`` at once, naming the array
  and the fix, where torch.amp (and unified_amp before) returned a ``map`` whose error
  came later from inside the framework.
- The core tells frameworks apart by the module names of a value's classes
  (tests/core/test_foreign_values_core.py, with stand-ins); here the active framework's
  real tensor, parameter and module classes are checked to carry the names it reads, so
  that this framework's objects, handed to the other backend, name this framework and
  the setting that selects it.
"""

import numpy as np
import pytest

import unified_amp as amp
from unified_amp import _foreign

CONVERT = {"torch": "torch.from_numpy(a)", "megengine": "megengine.tensor(a)"}
SHOWN = {"torch": "PyTorch", "megengine": "MegEngine"}


def test_scale_refuses_a_numpy_array_at_once(backend, kit, device):
    scaler = amp.GradScaler()
    with pytest.raises(amp.TensorTypeError) as info:
        scaler.scale(np.ones(1, "float32"))
    message = str(info.value)
    assert "outputs is ndarray array([1.], dtype=float32)" in message
    assert "It is a NumPy array of shape (1,)" in message
    assert f"pass the {SHOWN[backend.name]} tensor your model or loss function" in message
    assert CONVERT[backend.name] in message
    w = kit.param(np.array([1.5], np.float32), device)
    with pytest.raises(amp.TensorTypeError, match=r"outputs\[1\] is ndarray"):
        scaler.scale([w, np.ones(2)])
    assert scaler.stats()["steps"] == 0


def test_this_frameworks_objects_name_it_to_the_other_backend(backend, kit, device):
    other = "megengine" if backend.name == "torch" else "torch"
    objects = {"tensor": kit.tensor(np.array([1.0], np.float32), device),
               "parameter": kit.param(np.array([1.0], np.float32), device),
               "module": kit.linear_model([(np.ones((2, 2), np.float32),
                                            np.zeros(2, np.float32))], device)}
    for what, obj in objects.items():
        assert _foreign.framework_of(obj) == backend.name, what
        assert not _foreign.is_foreign(obj, backend.name), what
        message = _foreign.hint(obj, other)
        assert f"It is a {SHOWN[backend.name]} {type(obj).__name__}" in message, what
        assert f"UNIFIED_AMP_BACKEND={backend.name}" in message, what
        assert f"amp.set_backend({backend.name!r})" in message, what
