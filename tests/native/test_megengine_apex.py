"""apex-style MegEngine code: ``gm.backward(scaled_loss)``, ``opt.step().clear_grad()``
chaining through a skipped step, and O3's answer to MegEngine's limits (batch norm and
the optimizer's update stay float32)."""

import numpy as np
import pytest

import megengine as mge
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as optim

import unified_amp as amp


@pytest.fixture(autouse=True)
def _megengine_backend():
    amp.set_backend("megengine")
    yield


def conv_net():
    mge.random.seed(0)
    return M.Sequential(M.Conv2d(1, 4, 3, padding=1), M.BatchNorm2d(4), M.ReLU(),
                        M.MaxPool2d(2))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_conv_batch_norm_net_trains_and_chains_through_a_skipped_step(level):
    model = conv_net()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level)
    gm = amp.GradManager(model.parameters())
    assert model[1].weight.dtype == np.float32  # batch norm: float32 at every level
    assert model[0].weight.dtype == np.float16
    rng = np.random.RandomState(0)
    x = rng.randn(4, 1, 6, 6).astype("float32")
    before = None
    for i in range(4):
        xi = x.copy()
        if i == 2:
            xi[0, 0, 0, 0] = np.inf
            before = [p.numpy().tobytes() for p in model.parameters()]
        with gm:
            out = model(mge.tensor(xi))
            assert out.dtype == np.float32
            loss = F.nn.square_loss(out, F.zeros_like(out))  # float32 loss outside autocast
            with amp.scale_loss(loss, opt) as scaled_loss:
                gm.backward(scaled_loss)
        stepped = opt.step()
        assert stepped is opt  # so opt.step().clear_grad() works on a skipped step too
        stepped.clear_grad()
        if i == 2:
            assert [p.numpy().tobytes() for p in model.parameters()] == before
    if level == "O2":  # O3's fixed scale 1.0 is checked for overflows but never changes
        assert amp.loss_scaler().get_scale() == 2.0**15
    assert amp.loss_scaler().stats()["skipped_steps"] == 1
