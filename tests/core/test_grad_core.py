"""GradManager and clip_grad_norm on the fake backend."""

import math

import pytest

import unified_amp as amp

from .fake_backend import FakeOptimizer, FakeTensor, linear_loss


def test_backward_outside_recording_is_an_error(fake):
    p = FakeTensor([1.0])
    gm = amp.GradManager([p])
    with pytest.raises(RuntimeError, match="inside `with gm:`"):
        gm.backward(linear_loss([p], [[1.0]]))


def test_one_backward_per_recording(fake):
    p = FakeTensor([1.0])
    gm = amp.GradManager([p])
    with gm:
        gm.backward(linear_loss([p], [[1.0]]))
        with pytest.raises(RuntimeError, match="already called in this `with gm:` block"):
            gm.backward(linear_loss([p], [[1.0]]))
    # Leaving the block forgets it: outside, the error is about the missing block ...
    with pytest.raises(RuntimeError, match="no recorded computation"):
        gm.backward(linear_loss([p], [[1.0]]))
    # ... and a new block records again.
    with gm:
        gm.backward(linear_loss([p], [[1.0]]))
    assert p.grad.values == [2.0]


def test_record_and_release_by_hand_follow_the_same_rule(fake):
    p = FakeTensor([1.0])
    gm = amp.GradManager([p])
    gm.record()
    gm.backward(linear_loss([p], [[1.0]]))
    with pytest.raises(RuntimeError, match="already called"):
        gm.backward(linear_loss([p], [[1.0]]))
    gm.record()  # a new recording, without release() in between, as in MegEngine
    gm.backward(linear_loss([p], [[1.0]]))
    gm.release()
    with pytest.raises(RuntimeError, match="no recorded computation"):
        gm.backward(linear_loss([p], [[1.0]]))
    assert p.grad.values == [2.0]


def test_gradients_accumulate_until_zero_grad_and_only_attached(fake):
    p, q = FakeTensor([1.0]), FakeTensor([1.0])
    gm = amp.GradManager().attach(p)
    for _ in range(3):
        with gm:
            gm.backward(linear_loss([p, q], [[2.0], [5.0]]))
    assert p.grad.values == [6.0] and q.grad is None
    gm.zero_grad()
    assert p.grad is None
    assert gm.attached_tensors() == [p]


def test_attach_ignores_duplicates_and_rejects_non_tensors(fake):
    p = FakeTensor([1.0])
    gm = amp.GradManager([p, p]).attach([p])
    assert gm.attached_tensors() == [p]
    with pytest.raises(TypeError, match="iterable of fake parameters"):
        gm.attach([p, "weight"])


def test_recording_twice_is_an_error(fake):
    gm = amp.GradManager([FakeTensor([1.0])])
    with gm:
        with pytest.raises(RuntimeError, match="already recording"):
            gm.record()


def test_dy_count_must_match(fake):
    p = FakeTensor([1.0])
    gm = amp.GradManager([p])
    with gm:
        with pytest.raises(ValueError, match="1 output"):
            gm.backward(linear_loss([p], [[1.0]]), [FakeTensor([1.0])] * 2)


def test_clip_grad_norm_accepts_all_three_targets(fake):
    for make_target in (lambda ps: amp.GradManager(ps), lambda ps: FakeOptimizer(ps),
                        lambda ps: iter(ps)):
        p = FakeTensor([0.0, 0.0])
        p.grad = FakeTensor([3.0, 4.0])
        norm = amp.clip_grad_norm(make_target([p]), 1.0)
        assert norm == 5.0
        assert math.isclose(math.hypot(*p.grad.values), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "1", True])
def test_clip_grad_norm_validates_max_norm(fake, bad):
    with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
        amp.clip_grad_norm([FakeTensor([1.0])], bad)


def test_callbacks_are_validated_and_reach_the_tape(fake):
    p, q = FakeTensor([1.0]), FakeTensor([1.0])
    with pytest.raises(TypeError, match="callables .* got int 3"):
        amp.GradManager([p], callbacks=[3])
    with pytest.raises(ValueError, match=r"needs params to attach them to"):
        amp.GradManager(callbacks=lambda t, g: g)
    seen = []

    def double(t, g):
        seen.append(t)
        return FakeTensor([2 * v for v in g.values])

    gm = amp.GradManager([p], callbacks=double).attach([p, q])  # p keeps its callback
    with gm:
        gm.backward(linear_loss([p, q], [[1.0], [1.0]]))
    assert p.grad.values == [2.0] and q.grad.values == [1.0] and seen == [p]
