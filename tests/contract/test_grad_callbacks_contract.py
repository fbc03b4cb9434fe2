"""GradManager callbacks (MegEngine's ``callback(param, grad) -> grad``) behave the same
on both backends: on MegEngine they go to its own GradManager, on torch they run after
backward. The stand-in all-reduce below averages with a "peer" gradient, as
``megengine.distributed.make_allreduce_cb("mean")`` would across two ranks."""

import numpy as np
import pytest

import unified_amp as amp

from .loops import Problem, bits


def test_callbacks_see_each_backward_gradient_alone_in_attach_order(kit, device):
    w = kit.param(np.array([1.0, 2.0, 3.0], np.float32), device)
    c = np.array([2.0, -1.0, 0.5], np.float32)
    seen = []

    def record(param, grad):
        assert param is w
        seen.append(kit.numpy(grad))
        return grad

    def double(param, grad):
        return grad * 2.0

    gm = amp.GradManager([w], callbacks=[record]).attach([w], callbacks=double)
    for _ in range(2):
        with gm:
            gm.backward(kit.total(kit.mul(w, kit.tensor(c, device))))
    # record runs first and sees each backward's own gradient, never the running sum;
    # what double returns is what accumulates.
    assert [s.tolist() for s in seen] == [c.tolist(), c.tolist()]
    np.testing.assert_allclose(kit.grad(w), 4 * c)


def test_callbacks_run_only_for_parameters_the_backward_reached(kit, device):
    used = kit.param(np.ones(3, np.float32), device)
    unused = kit.param(np.ones(2, np.float32), device)
    calls = []
    gm = amp.GradManager([used, unused], callbacks=lambda p, g: calls.append(p) or g)
    with gm:
        gm.backward(kit.total(kit.mul(used, kit.tensor(np.ones(3), device))))
    assert len(calls) == 1 and calls[0] is used
    assert kit.grad(unused) is None


def mean_with_peer(peer):
    """A stand-in for an all-reduce("mean") callback: the other rank's gradient is
    ``peer[id(param)]``."""
    def callback(param, grad):
        return (grad + peer[id(param)]) * 0.5

    return callback


@pytest.mark.parametrize("peer_overflows", [False, True])
def test_scaler_checks_the_all_reduced_gradients(kit, device, peer_overflows):
    """With an all-reduce callback the scaler unscales and checks what the callbacks
    returned: an inf on the peer makes this rank skip too; an identical peer gives the
    weights of a run without callbacks, bit for bit."""
    runs = {}
    for with_callback in (False, True):
        p = Problem(kit, device)
        scaler = amp.GradScaler(init_scale=2.0**8)
        opt = kit.sgd(p.params, 0.1)
        gm = amp.GradManager(p.params)
        if with_callback:
            # The peer's (scaled) gradients: this rank's own, or inf in the first one.
            with gm:
                gm.backward(scaler.scale(p.loss()))
            peer = {id(q): kit.tensor(kit.grad(q), device) for q in p.params}
            gm.zero_grad()
            if peer_overflows:
                inf = np.full(kit.numpy(p.params[0]).shape, np.inf, np.float32)
                peer[id(p.params[0])] = kit.tensor(inf, device)
            gm = amp.GradManager(p.params, callbacks=mean_with_peer(peer))
            scaler = amp.GradScaler(init_scale=2.0**8)
        before = p.weights()
        with gm:
            scaler.backward(gm, p.loss())
        opt.step()
        runs[with_callback] = (p.weights(), before, scaler.get_scale(),
                               scaler.stats()["last_step_skipped"])
    weights, before, scale, skipped = runs[True]
    if peer_overflows:
        assert skipped and scale == 2.0**7
        assert bits(weights) == bits(before)
    else:
        assert not skipped and scale == 2.0**8
        assert bits(weights) == bits(runs[False][0])
