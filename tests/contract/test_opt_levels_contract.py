"""apex's API on the real backends: the dtypes of each opt level, skipped steps at O2,
O1 vs O2, checkpoints, the GAN with one loss scale per loss_id, clipping the masters and
accumulating with delay_unscale. Written once with ``gm.backward(scaled_loss)``, which
both frameworks run (torch's ``scaled_loss.backward()`` form: tests/native)."""

import pathlib
import pickle

import numpy as np
import pytest

import unified_amp as amp

from .apex_table import COLUMNS, TABLE, expected
from .loops import bits, state_bits

LEVELS = sorted(TABLE)
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "APEX.md"


class Net:
    """A Linear-BatchNorm-ReLU-Linear classifier with Adam, through amp.initialize."""

    def __init__(self, kit, device, level, seed=0, n=16, lr=1e-2, init_seed=None,
                 batch_norm=True, **kwargs):
        self.kit, self.device = kit, device
        model = kit.apex_model(device, seed if init_seed is None else init_seed,
                               batch_norm=batch_norm)
        self.original = list(model.parameters())
        opt = kit.adam(list(self.original), lr)
        self.model, self.opt = amp.initialize(model, opt, opt_level=level, **kwargs)
        self.gm = amp.GradManager(list(self.model.parameters()))
        rng = np.random.RandomState(seed + 100)
        self.x = rng.randn(n, 4).astype(np.float32)
        self.y = rng.randint(0, 3, n).astype(np.int32)

    def loss(self, overflow=False, rows=slice(None)):
        x = self.x[rows].copy()
        if overflow:
            x[0, 0] = np.inf
        out = self.model(self.kit.tensor(x, self.device))
        return out, self.kit.cross_entropy(out, self.kit.tensor(self.y[rows], self.device,
                                                                "int32"))

    def step(self, overflow=False):
        with self.gm:
            _, loss = self.loss(overflow)
            with amp.scale_loss(loss, self.opt) as scaled:
                self.gm.backward(scaled)
        self.opt.step()
        self.gm.zero_grad()
        return float(self.kit.numpy(loss))

    def weights(self):
        """The model's parameters and whatever the optimizer steps, as bytes."""
        return bits([self.kit.numpy(p) for p in self.original]
                    + [self.kit.numpy(m) for m in amp.master_params(self.opt)])

    def stepped(self, p):
        """What the optimizer steps in place of model parameter ``p``."""
        return list(amp.master_params(self.opt))[
            [id(q) for q in self.original].index(id(p))]


@pytest.mark.parametrize("low_dtype", [None, "float16"])
@pytest.mark.parametrize("level", LEVELS)
def test_dtypes_of_each_opt_level_are_the_documented_ones(kit, device, level, low_dtype):
    net = Net(kit, device, level, low_dtype=low_dtype)
    low = amp.opt_properties().low_dtype
    assert low == (low_dtype or ("float16" if device == "cuda" or kit.name == "megengine"
                                 else "bfloat16"))
    model, fc1_w = net.model, net.model.fc1.weight
    masters = [m for m in amp.master_params(net.opt)
               if all(m is not p for p in net.original)]
    got = {"weights": kit.dtype_name(fc1_w),
           "batch norm weights": kit.dtype_name(kit.batch_norm_weight(model)),
           "master weights": kit.dtype_name(masters[0]) if masters else "none"}
    assert len({kit.dtype_name(m) for m in masters}) <= 1
    with net.gm:
        out, loss = net.loss()
        got["model output"] = kit.dtype_name(out)
        with amp.scale_loss(loss, net.opt) as scaled:
            net.gm.backward(scaled)
            got["weight gradients"] = kit.dtype_name(fc1_w.grad)
        got["gradients the optimizer uses"] = kit.dtype_name(net.stepped(fc1_w).grad)
    net.opt.step()
    got.update({k: v for k, v in model.seen.items()})
    props, scaler = amp.opt_properties(), amp.loss_scaler()
    got["loss scale"] = ("off" if not scaler.is_enabled() else "dynamic"
                         if props.loss_scale == "dynamic" else f"{props.loss_scale}, checked")
    want = {c: expected(level, c, kit.name).replace("low", low) for c in COLUMNS}
    assert got == want
    assert np.isfinite(kit.numpy(loss))


def test_o2_skipped_step_leaves_model_masters_and_optimizer_state_bit_identical(kit,
                                                                                 device):
    net = Net(kit, device, "O2")
    for _ in range(2):  # Adam's state exists before the overflow
        net.step()
    weights, state = net.weights(), state_bits(kit, net.opt)
    assert state
    net.step(overflow=True)
    assert net.weights() == weights
    assert state_bits(kit, net.opt) == state
    assert all(kit.grad(p) is None for p in net.original)
    assert all(kit.grad(m) is None for m in amp.master_params(net.opt))
    assert amp.loss_scaler().get_scale() == 2.0**15
    assert amp.loss_scaler().stats()["skipped_steps"] == 1
    net.step()  # and training resumes
    assert net.weights() != weights


def test_o2_reaches_the_loss_o1_reaches(kit, device):
    losses = {}
    for level in ("O0", "O1", "O2"):
        net = Net(kit, device, level, low_dtype="float16", lr=2e-2)
        losses[level] = [net.step() for _ in range(25)]
    assert losses["O1"][-1] < 0.6 * losses["O1"][0]  # it trains
    np.testing.assert_allclose(losses["O2"][-5:], losses["O1"][-5:], rtol=3e-2)
    np.testing.assert_allclose(losses["O1"][-5:], losses["O0"][-5:], rtol=3e-2)


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_mid_run_resumes_bit_identically(kit, device, level):
    overflows = [False, True, False, False, False, True, False]
    runs = []
    for restart in (False, True):
        net = Net(kit, device, level)
        history, saved = [], None
        for i, overflow in enumerate(overflows):
            if i == 3:
                saved = pickle.dumps((net.model.state_dict(), net.opt.state_dict(),
                                      amp.state_dict()))
            if restart and i == 3:  # a fresh process: new model, optimizer, initialize
                net = Net(kit, device, level, init_seed=7)
                model_state, opt_state, amp_state = pickle.loads(saved)
                net.model.load_state_dict(model_state)
                net.opt.load_state_dict(opt_state)
                amp.load_state_dict(amp_state)
            net.step(overflow and level != "O3")  # O3's scale is 1.0: nothing to skip
            history.append((net.weights(), amp.state_dict()))
        runs.append(history)
    assert runs[0][3:] == runs[1][3:]


def test_gan_one_loss_scale_per_loss_id(kit, device):
    """D with loss_id=0, G with loss_id=1: an overflow planted in D's loss backs off
    only D's scale and skips only D's step."""
    d = kit.apex_model(device, seed=1, sizes=(3, 8, 1))
    g = kit.apex_model(device, seed=2, sizes=(2, 8, 3), batch_norm=False)
    opt_d, opt_g = kit.adam(list(d.parameters()), 1e-2), kit.adam(list(g.parameters()), 1e-2)
    # max_loss_scale caps the first scale (apex's rule), low enough that these float16
    # gradients never overflow by themselves: the planted inf is the only overflow.
    [d, g], [opt_d, opt_g] = amp.initialize([d, g], [opt_d, opt_g], opt_level="O1",
                                            num_losses=2, max_loss_scale=2.0**10)
    gm_d, gm_g = amp.GradManager(list(d.parameters())), amp.GradManager(list(g.parameters()))
    rng = np.random.RandomState(3)
    ones, zeros = (kit.tensor(np.full((8, 1), v, np.float32), device) for v in (1.0, 0.0))
    for overflow in (False, True, False):
        real = rng.randn(8, 3).astype(np.float32)
        if overflow:
            real[0, 0] = np.inf
        z = kit.tensor(rng.randn(8, 2).astype(np.float32), device)
        d_before, g_before = bits(kit.numpy(p) for p in d.parameters()), \
            bits(kit.numpy(p) for p in g.parameters())
        kit.zero_grad(opt_d)
        with gm_d:
            loss_d = kit.mse(d(kit.tensor(real, device)), ones) + kit.mse(d(g(z)), zeros)
            with amp.scale_loss(loss_d, opt_d, loss_id=0) as scaled:
                gm_d.backward(scaled)
        opt_d.step()
        kit.zero_grad(opt_g)
        with gm_g:
            loss_g = kit.mse(d(g(z)), ones)
            with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled:
                gm_g.backward(scaled)
        opt_g.step()
        assert (bits(kit.numpy(p) for p in d.parameters()) == d_before) == overflow
        assert bits(kit.numpy(p) for p in g.parameters()) != g_before
    assert amp.loss_scaler(0).get_scale() == 2.0**9
    assert amp.loss_scaler(1).get_scale() == 2.0**10
    assert amp.loss_scaler(0).stats()["skipped_steps"] == 1
    assert amp.loss_scaler(1).stats()["skipped_steps"] == 0


def test_gradients_scaled_by_another_loss_block_are_refused(kit, device):
    """One GradManager over D and G, D's loss from G's output not detached: the backward
    in D's block (loss_id=0) fills G's gradients, scaled by scale 0, and nothing unscales
    them. G's scale_loss and opt_g.step() raise before using them; zeroing G's gradients
    lets G's step go on, on the gradient of G's own loss only."""
    d = kit.apex_model(device, seed=1, sizes=(3, 8, 1), batch_norm=False)
    g = kit.apex_model(device, seed=2, sizes=(2, 8, 3), batch_norm=False)
    opt_d, opt_g = kit.sgd(list(d.parameters()), 0.1), kit.sgd(list(g.parameters()), 0.1)
    [d, g], [opt_d, opt_g] = amp.initialize([d, g], [opt_d, opt_g], opt_level="O1",
                                            num_losses=2, low_dtype="float16")
    gm = amp.GradManager(list(d.parameters()) + list(g.parameters()))
    rng = np.random.RandomState(3)
    ones = kit.tensor(np.ones((8, 1), np.float32), device)
    z = kit.tensor(rng.randn(8, 2).astype(np.float32), device)
    with gm:
        loss_d = kit.mse(d(g(z)), ones)
        with amp.scale_loss(loss_d, opt_d, loss_id=0) as scaled:
            gm.backward(scaled)
    opt_d.step()
    g_before = bits(kit.numpy(p) for p in g.parameters())
    with pytest.raises(RuntimeError, match=r"optimizer 1 of amp.initialize.*loss_id=0.*detach"):
        opt_g.step()
    with gm:
        loss_g = kit.mse(d(g(z)), ones)
        with pytest.raises(RuntimeError, match="zero this optimizer's gradients"):
            with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled:
                gm.backward(scaled)
    assert bits(kit.numpy(p) for p in g.parameters()) == g_before
    kit.zero_grad(opt_g)
    gm.zero_grad()
    with gm:
        loss_g = kit.mse(d(g(z)), ones)
        with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled:
            gm.backward(scaled)
    got = np.concatenate([kit.grad(p).ravel() for p in g.parameters()])
    opt_g.step()
    assert bits(kit.numpy(p) for p in g.parameters()) != g_before
    scale = amp.loss_scaler(0).get_scale()
    assert np.abs(got).max() < scale / 1000, "G stepped on gradients scaled by scale 0"


def test_clipping_the_master_params_sees_true_scale_gradients(kit, device):
    ref = Net(kit, device, "O0")
    with ref.gm:
        ref.gm.backward(ref.loss()[1])
    true_norm = float(np.sqrt(sum((kit.grad(p) ** 2).sum() for p in ref.original)))

    net = Net(kit, device, "O2", low_dtype="float16")
    with net.gm:
        _, loss = net.loss()
        with amp.scale_loss(loss, net.opt) as scaled:
            net.gm.backward(scaled)
    norm = amp.clip_grad_norm(amp.master_params(net.opt), max_norm=true_norm / 2)
    assert abs(norm - true_norm) / true_norm < 2e-2  # not 65536 times larger
    net.opt.step()


def test_delay_unscale_accumulation_equals_one_big_batch(kit, device):
    grads = []
    for split in (False, True):
        # no batch norm: its statistics would differ between the halves and the whole
        net = Net(kit, device, "O2", low_dtype="float16", batch_norm=False)
        chunks = [slice(0, 8), slice(8, 16)] if split else [slice(None)]
        for i, rows in enumerate(chunks):
            with net.gm:
                _, loss = net.loss(rows=rows)
                loss = loss * (1.0 / len(chunks))
                with amp.scale_loss(loss, net.opt, delay_unscale=i < len(chunks) - 1) as s:
                    net.gm.backward(s)
        grads.append([kit.grad(m) for m in amp.master_params(net.opt)])
        assert amp.loss_scaler().stats()["steps"] == 1
    for big, acc in zip(*grads):
        np.testing.assert_allclose(acc, big, rtol=2e-2, atol=2e-3)


def test_docs_table_is_the_tested_table():
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "level":
            assert tuple(cells[1:]) == COLUMNS
        if cells[0] in TABLE:
            rows[cells[0]] = tuple(cells[1:])
    assert rows == TABLE
