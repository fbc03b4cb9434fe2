"""amp.GradManager and amp.clip_grad_norm behave the same on both backends."""

import numpy as np
import pytest

import unified_amp as amp

from .loops import Problem


def test_gradients_accumulate_until_zero_grad(kit, device):
    p = Problem(kit, device)
    gm = amp.GradManager(p.params)
    with gm:
        gm.backward(p.loss())
    once = [kit.grad(q) for q in p.params]
    for _ in range(2):
        with gm:
            gm.backward(p.loss())
    for g1, g3 in zip(once, [kit.grad(q) for q in p.params]):
        np.testing.assert_allclose(g3, 3 * g1, rtol=1e-5, atol=1e-7)
    gm.zero_grad()
    assert all(kit.grad(q) is None for q in p.params)


def test_only_attached_tensors_get_gradients(kit, device):
    p = Problem(kit, device)
    gm = amp.GradManager(p.params[:2])
    assert gm.attached_tensors() == p.params[:2]
    with gm:
        gm.backward(p.loss())
    assert all(kit.grad(q) is not None for q in p.params[:2])
    assert all(kit.grad(q) is None for q in p.params[2:])


def test_backward_needs_a_recording_and_ends_it(kit, device):
    p = Problem(kit, device)
    gm = amp.GradManager(p.params)
    with pytest.raises(RuntimeError, match="inside `with gm:`"):
        gm.backward(p.loss())
    with gm:
        loss = p.loss()
        gm.backward(loss)
        with pytest.raises(RuntimeError, match="already called in this `with gm:` block"):
            gm.backward(p.loss())


def test_dy_weights_the_outputs(kit, device):
    w = kit.param(np.array([1.0, 2.0, 3.0], np.float32), device)
    gm = amp.GradManager([w])
    c = kit.tensor(np.array([2.0, -1.0, 0.5], np.float32), device)
    with gm:
        gm.backward(kit.mul(w, c), kit.tensor(np.array([1.0, 10.0, 100.0]), device))
    np.testing.assert_allclose(kit.grad(w), [2.0, -10.0, 50.0])
    with gm:  # dy defaults to ones, also for a non-scalar output (MegEngine's rule)
        gm.backward(kit.mul(w, c))
    np.testing.assert_allclose(kit.grad(w), [4.0, -11.0, 50.5])


def test_clip_grad_norm_returns_the_norm_and_clips(kit, device):
    w = kit.param(np.zeros(2, np.float32), device)
    for target in (lambda: [w], lambda: amp.GradManager([w]), lambda: kit.sgd([w], 0.1)):
        kit.set_grad(w, [3.0, 4.0])
        norm = amp.clip_grad_norm(target(), 1.0)
        assert isinstance(norm, float) and abs(norm - 5.0) < 1e-5
        np.testing.assert_allclose(kit.grad(w), [0.6, 0.8], rtol=1e-5)
    kit.set_grad(w, [0.3, 0.4])  # already under the limit: unchanged
    assert abs(amp.clip_grad_norm([w], 1.0) - 0.5) < 1e-6
    np.testing.assert_allclose(kit.grad(w), [0.3, 0.4], rtol=1e-6)


def test_a_dy_of_another_dtype_is_cast_to_its_outputs_dtype(kit, device):
    """``gm.backward(y, dy)`` with a float16 ``y`` (a contract block's matmul, or a mean
    that follows its float16 input) and a float32 ``dy``: torch's autograd casts ``dy``
    to ``y``'s dtype; MegEngine's backward asserted in an elementwise kernel (the
    cross-backend fuzz found it). Both now give the same gradients."""
    w = kit.param(np.array([[1.0], [2.0], [3.0]], np.float32), device)
    x = kit.tensor(np.array([[2.0, -1.0, 0.5]], np.float32), device)
    gm = amp.GradManager([w])
    with gm:
        with amp.autocast(dtype="float16", device=device):
            y = kit.matmul(x, w)
        assert kit.dtype_name(y) == "float16"
        gm.backward(y, kit.tensor(np.array([[4.0]], np.float32), device))
    np.testing.assert_array_equal(kit.grad(w), [[8.0], [-4.0], [2.0]])
