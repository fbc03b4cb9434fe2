"""``amp.keep_float32`` on the real backends: a layer whose float16 output overflows
makes every step skip and the overflow report names the pin; pinned, that layer runs in
float32, the layers after it stay float16 and the steps are taken -- with
``amp.autocast`` + GradScaler and under ``amp.initialize`` at O1 and O2 alike.

The model (tests/kits: ``pin_model``) is fc1 -> block.linear * 1/1024 -> head, on a
batch of ones: fc1 gives 4, block.linear 4 * 4 * 8192 = 131072 (past float16's 65504,
so inf in float16), the block 128 and the head 4 * 128 / 128 = 4. Every value is exact
in float16 and float32, so the loss against a target of 3 is exactly 1 once the block
runs in float32. Tiny, for MegEngine's CPU build.
"""

import copy
import pickle

import numpy as np
import pytest

import unified_amp as amp

from .loops import bits

W_FC1 = np.ones((4, 4))
W_BLOCK = np.full((4, 4), 8192.0)
W_HEAD = np.full((1, 4), 1 / 128)
FACTOR = 1 / 1024
X = np.ones((2, 4))
TARGET = np.full((2, 1), 3.0)
STEPS = 3
LR = 2.0**-18  # small: the activations (128) make large weight gradients
FIX = "amp.keep_float32(model.block.linear)"


def make(kit, device):
    return kit.pin_model(device, W_FC1, W_BLOCK, FACTOR, W_HEAD)


def weights(kit, model):
    return bits([kit.numpy(p) for p in model.parameters()])


def plain_steps(kit, device, model, scaler, n=STEPS):
    """``n`` float16 steps with amp.autocast and the scaler's automatic mode."""
    params = list(model.parameters())
    gm, opt = amp.GradManager(params), kit.sgd(params, LR)
    losses = []
    for _ in range(n):
        with gm:
            with amp.autocast(dtype="float16", device=device):
                loss = kit.mse(model(kit.tensor(X, device)), kit.tensor(TARGET, device))
            scaler.backward(gm, loss)
        opt.step()
        gm.zero_grad()
        losses.append(float(kit.numpy(loss)))
    return losses


def apex_steps(kit, device, model, opt, n=STEPS):
    gm = amp.GradManager(list(model.parameters()))
    losses = []
    for _ in range(n):
        with gm:
            loss = kit.mse(model(kit.tensor(X, device)), kit.tensor(TARGET, device))
            with amp.scale_loss(loss, opt) as scaled:
                gm.backward(scaled)
        opt.step()
        gm.zero_grad()
        losses.append(float(kit.numpy(loss)))
    return losses


def test_an_overflowing_layer_skips_every_step_and_the_report_names_the_pin(kit, device):
    model = make(kit, device)
    before = weights(kit, model)
    scaler = amp.GradScaler(init_scale=64.0).watch(model)
    with amp.trace_forward(model):
        losses = plain_steps(kit, device, model, scaler)
    assert all(np.isnan(v) or np.isinf(v) for v in losses)
    assert scaler.stats()["skipped_steps"] == STEPS
    assert weights(kit, model) == before
    report = scaler.last_overflow()
    assert report.cause == "forward-float16"
    assert (report.first_nonfinite.module, report.first_nonfinite.dtype) == (
        "block.linear", "float16")
    assert FIX in str(report)


def test_the_pinned_layer_runs_in_float32_and_the_steps_are_taken(kit, device):
    model = make(kit, device)
    before = weights(kit, model)
    assert amp.keep_float32(model.block.linear) is model.block.linear
    scaler = amp.GradScaler(init_scale=64.0).watch(model)
    with amp.trace_forward(model):
        losses = plain_steps(kit, device, model, scaler)
    assert losses[0] == 1.0  # exact: the block ran in float32
    assert scaler.stats()["skipped_steps"] == 0 and scaler.last_overflow() is None
    assert model.seen == {"fc1": "float16", "block": "float32", "head": "float16"}
    assert weights(kit, model) != before
    assert all(kit.dtype_name(p) == "float32" for p in model.parameters())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_under_opt_levels_the_overflow_skips_and_the_pin_fixes_it(kit, device, level):
    model = make(kit, device)
    model, opt = amp.initialize(model, kit.sgd(list(model.parameters()), LR),
                                opt_level=level, low_dtype="float16", max_loss_scale=64.0)
    before = weights(kit, model)
    with amp.trace_forward(model):
        apex_steps(kit, device, model, opt)
    scaler = amp.loss_scaler()
    assert scaler.stats()["skipped_steps"] == STEPS
    assert weights(kit, model) == before
    assert FIX in str(scaler.last_overflow())

    model = make(kit, device)
    amp.keep_float32(model.block.linear)  # before initialize: its weights stay float32
    params = list(model.parameters())
    model, opt = amp.initialize(model, kit.sgd(params, LR), opt_level=level,
                                low_dtype="float16", max_loss_scale=64.0)
    before = weights(kit, model)
    losses = apex_steps(kit, device, model, opt)
    assert losses[0] == 1.0
    assert amp.loss_scaler().stats()["skipped_steps"] == 0
    assert model.seen == {"fc1": "float16", "block": "float32", "head": "float16"}
    low = "float16" if level == "O2" else "float32"
    assert [kit.dtype_name(p) for p in (model.fc1.weight, model.block.linear.weight,
                                   model.head.weight)] == [low, "float32", low]
    stepped = list(amp.master_params(opt))
    # A float32 weight needs no master: the optimizer steps the pinned weight itself.
    assert any(m is model.block.linear.weight for m in stepped)
    assert weights(kit, model) != before


def test_pinning_after_o2_casts_the_weights_back_from_their_masters(kit, device):
    model = make(kit, device)
    # 8192 + 2**-10 is a float32 value that float16 rounds to 8192.
    kit.assign(model.block.linear.weight, W_BLOCK + 2.0**-10)
    exact = kit.numpy(model.block.linear.weight)
    assert bits([exact]) != bits([W_BLOCK.astype(np.float32)])
    model, opt = amp.initialize(model, kit.sgd(list(model.parameters()), LR),
                                opt_level="O2", low_dtype="float16", max_loss_scale=64.0)
    assert kit.dtype_name(model.block.linear.weight) == "float16"
    amp.keep_float32(model.block.linear)
    assert kit.dtype_name(model.block.linear.weight) == "float32"
    assert bits([kit.numpy(model.block.linear.weight)]) == bits([exact])  # the master's
    apex_steps(kit, device, model, opt)
    assert amp.loss_scaler().stats()["skipped_steps"] == 0
    assert model.seen == {"fc1": "float16", "block": "float32", "head": "float16"}
    masters = list(amp.master_params(opt))
    # It keeps its master, and each step copies the master in.
    assert all(m is not model.block.linear.weight for m in masters)
    stepped = [m for m in masters if tuple(m.shape) == (4, 4)
               and bits([kit.numpy(m)]) == bits([kit.numpy(model.block.linear.weight)])]
    assert stepped
    amp.keep_float32(model.block.linear, enabled=False)
    assert kit.dtype_name(model.block.linear.weight) == "float16"  # as O2 had it


def test_pin_is_idempotent_undone_and_names_a_non_module(kit, device, backend):
    model = make(kit, device)
    x = kit.tensor(X, device)

    def run():
        with amp.autocast(dtype="float16", device=device):
            out = model(x)
        return dict(model.seen), kit.numpy(out)

    plain = run()
    assert amp.keep_float32(model.block, model.head) is model.block
    assert amp.keep_float32(model.block) is model.block  # again: nothing changes
    pinned = run()
    assert pinned[0] == {"fc1": "float16", "block": "float32", "head": "float32"}
    assert amp.keep_float32(model.block, model.head, enabled=False) is model.block
    assert bits([run()[1]]) == bits([plain[1]]) and run()[0] == plain[0]
    amp.keep_float32(model.block, enabled=False)  # unpinning twice is harmless too

    for bad, word in ((x, "Tensor"), ([model.fc1], "list"), ("head", "str"),
                      (model.parameters(), "")):
        with pytest.raises(TypeError, match=rf"argument 1 is a \w*{word}"):
            amp.keep_float32(model.fc1, bad)
        assert run()[0] == plain[0]  # the first argument was not pinned either
    with pytest.raises(TypeError, match="at least one module"):
        amp.keep_float32()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        amp.keep_float32(model.fc1, enabled="no")


def test_the_pin_survives_pickle_deepcopy_and_state_dict(kit, device):
    model = make(kit, device)
    keys = sorted(model.state_dict())
    amp.keep_float32(model.block.linear)
    assert sorted(model.state_dict()) == keys
    x, want = kit.tensor(X, device), {"fc1": "float16", "block": "float32",
                                      "head": "float16"}
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        copied.load_state_dict(model.state_dict())
        with amp.autocast(dtype="float16", device=device):
            out = copied(x)
        assert copied.seen == want
        assert float(kit.numpy(out)[0, 0]) == 4.0
    with amp.autocast(dtype="float16", device=device):
        model(x)
    assert model.seen == want


def test_a_compiled_or_traced_forward_keeps_the_pinned_dtypes(kit, device):
    model = make(kit, device)
    amp.keep_float32(model.block.linear)
    x = kit.tensor(X, device)

    def forward(x):
        with amp.autocast(dtype="float16", device=device):
            return model(x)

    eager = kit.numpy(forward(x))
    eager_seen = dict(model.seen)
    compiled = kit.compile_forward(forward)
    for _ in range(2):
        out = compiled(x)
    assert eager_seen == {"fc1": "float16", "block": "float32", "head": "float16"}
    assert model.seen == eager_seen
    assert kit.dtype_name(out) == "float16"
    assert bits([kit.numpy(out)]) == bits([eager])
