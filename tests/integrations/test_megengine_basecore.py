"""MegEngine's basecore with its scaler slot, `Solver(..., grad_scaler=...)`:
megengine.amp's GradScaler, then unified_amp's, in basecore's own loop (a `BaseTrainer`
whose iterations call `Solver.minimize`, its `clip_grad` function, its `step_grad=`
accumulation) and a resume through basecore's `Checkpoint` (model, optimizer, scaler
and the trainer's progress). Weights, optimizer state, scale after every iteration, the
steps that ran and the scaler state basecore saved are equal byte for byte.

How basecore calls the scaler (basecore 0.1.10, engine/solver.py): `minimize` enters
`megengine.amp.autocast()` (when a scaler is given) and, inside `with grad_manager:`,
calls `grad_scaler.backward(grad_manager, total_loss)` with no other argument, so
megengine.amp's defaults apply: `unscale_grad=True` and `update_scale` (unscaling and
updating the scale after every backward). `step_grad=False` skips only the optimizer
step and the clipping, so accumulation calls `backward` into gradients that already hold
unscaled values: see test_step_grad_accumulation."""

import pickle

import numpy as np
import pytest

import megengine as mge
import megengine.amp
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as optim
from basecore.engine import BaseHook, BaseTrainer, Solver
from basecore.engine.solver import clip_grad
from basecore.utils.checkpoint import Checkpoint
from megengine.autodiff import GradManager

import unified_amp

from . import pins

NATIVE, OURS = megengine.amp.GradScaler, unified_amp.GradScaler
SCALER_ARGS = dict(init_scale=2.0**4, growth_interval=2)
N_BATCHES = 6  # per epoch; MegEngine's CPU kernels are slow, so the run is short


def batches():
    rng = np.random.RandomState(0)
    return [(rng.randn(8, 8).astype("float32"), rng.randint(0, 4, 8).astype("int32"))
            for _ in range(N_BATCHES)]


def model():
    rng = np.random.RandomState(1)
    net = M.Sequential(M.Linear(8, 16), M.ReLU(), M.Linear(16, 4))
    for p in net.parameters():
        p._reset(mge.tensor(rng.randn(*p.shape).astype("float32") * 0.3))
    return net


class Plan:
    """Planted overflows, counted by loss call from 1 (one Plan per run, carried across
    the resume): ``inf_loss`` multiplies the loss by inf; ``inf_grad`` keeps the loss
    finite and puts an inf into the first weight's gradient (a GradManager callback,
    MegEngine's gradient hook). Records the forward's dtype, the scale after every
    iteration, and the iterations whose optimizer step changed the weights."""

    def __init__(self, inf_loss=(2,), inf_grad=(8,)):
        self.inf_loss, self.inf_grad = set(inf_loss), set(inf_grad)
        self.calls, self.dtypes, self.scales, self.stepped = 0, set(), [], []

    def loss(self, net, x, y):
        self.calls += 1
        logits = net(x)
        self.dtypes.add(np.dtype(logits.dtype))
        loss = F.nn.cross_entropy(logits, y)
        return {"total_loss": loss * float("inf") if self.calls in self.inf_loss else loss}

    def grad_manager(self, net):
        target = net[0].weight
        mask = np.zeros(target.shape, "float32")
        mask[0, 0] = np.inf

        def poison(param, grad):
            if param is target and self.calls in self.inf_grad:
                return grad + mge.tensor(mask)
            return grad

        return GradManager().attach(net.parameters(), callbacks=[poison])


class Record(BaseHook):
    def __init__(self, plan):
        self.plan = plan

    def before_iter(self):
        self.before = weights(self.trainer.model)

    def after_iter(self):
        if weights(self.trainer.model) != self.before:
            self.plan.stepped.append(self.plan.calls)
        self.plan.scales.append(self.trainer.solver.grad_scaler.scale_factor)


class Trainer(BaseTrainer):
    def __init__(self, net, solver, plan, accumulate):
        super().__init__(net, batches(), solver, hooks=[Record(plan)])
        self.plan, self.accumulate = plan, accumulate

    def train_one_iter(self):
        x, y = self.dataloader[self.progress.iter - 1]
        step = self.progress.iter % self.accumulate == 0
        self.solver.grad_scaler.last_micro_batch = step  # read only by DocumentedForm
        self.solver.minimize(self.plan.loss, self.model, mge.tensor(x), mge.tensor(y),
                             step_grad=step)


class DocumentedForm(megengine.amp.GradScaler):
    """megengine.amp in the accumulation form its docs give: `unscale_grad=False` on all
    but the last micro-batch, so that one unscale (and one update) covers the sum. The
    reference for basecore's accumulation, which calls `backward(gm, loss)` with the
    defaults on every micro-batch."""

    last_micro_batch = True

    def backward(self, gm, y=None, dy=None, **kwargs):
        return super().backward(gm, y, dy, unscale_grad=self.last_micro_batch)


def weights(net):
    return [p.numpy().tobytes() for p in net.parameters()]


def optimizer_state(opt):
    return [(k, np.asarray(v.numpy() if hasattr(v, "numpy") else v).tobytes())
            for state in opt.state_dict()["state"].values() for k, v in sorted(state.items())]


def parts(GradScaler, plan, accumulate, clip, **scaler_args):
    net = model()
    opt = optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(**scaler_args)
    clip_fn = clip_grad(net.parameters(), "norm", max_norm=clip) if clip else None
    solver = Solver(opt, plan.grad_manager(net), grad_scaler=scaler, grad_clip_fn=clip_fn)
    return net, opt, scaler, Trainer(net, solver, plan, accumulate)


def run(GradScaler, tmp_path, accumulate=1, clip=None):
    """Epoch 1, a basecore Checkpoint, then new parts (a scaler at its defaults) resumed
    from it (progress included) for epoch 2."""
    plan = Plan()
    folder = str(tmp_path / GradScaler.__module__)
    net, opt, scaler, trainer = parts(GradScaler, plan, accumulate, clip, **SCALER_ARGS)
    trainer.train(max_info=[1, N_BATCHES])
    Checkpoint(folder, net, optimizer=opt, grad_scaler=scaler,
               progress=trainer.progress).save("mid.pkl")

    net, opt, scaler, trainer = parts(GradScaler, plan, accumulate, clip)
    saved = Checkpoint(folder, net, optimizer=opt, grad_scaler=scaler,
                       progress=trainer.progress).resume()["grad_scaler"]
    assert (trainer.progress.epoch, trainer.progress.iter) == (2, 1)
    trainer.train(max_info=[2, N_BATCHES])
    assert trainer.solver.grad_scaler is scaler
    return plan, dict(weights=weights(net), optimizer=optimizer_state(opt),
                      scales=plan.scales, stepped=plan.stepped,
                      saved_scaler=pickle.dumps(saved),
                      final_scaler=pickle.dumps(scaler.state_dict()))


MEGENGINE_AMP_KEYS = ("scale_factor", "growth_factor", "backoff_factor", "growth_interval",
                      "_growth_tracker")


def as_megengine_saves(state):
    """unified_amp's state_dict holds torch.amp's "scale" first, then megengine.amp's
    "scale_factor", the rest of both natives' keys and the stats() counters
    (docs/DROP_IN.md), so that checkpoints move between frameworks and back to
    megengine.amp. megengine.amp's keys alone must pickle to megengine.amp's bytes."""
    assert state["scale"] == state["scale_factor"]
    return {k: v for k, v in state.items() if k in MEGENGINE_AMP_KEYS}


def assert_same(native, ours):
    assert native.keys() == ours.keys()
    for key in native:
        if key.endswith("_scaler"):
            assert pickle.loads(ours[key]).keys() >= {"scale"}
            assert native[key] == pickle.dumps(as_megengine_saves(pickle.loads(ours[key]))), \
                f"{key} differs"
        else:
            assert native[key] == ours[key], f"{key} differs"


def assert_really_amp(plan):
    """The control ran AMP: float16 forward, every step but the planted ones changed the
    weights, and the scale backed off and grew."""
    assert plan.dtypes == {np.dtype("float16")}, plan.dtypes
    planted = plan.inf_loss | plan.inf_grad
    assert plan.stepped == [c for c in range(1, plan.calls + 1) if c not in planted]
    pairs = list(zip(plan.scales, plan.scales[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), plan.scales


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clip-norm"])
def test_solver_same_bytes_with_either_scaler(tmp_path, clip):
    plan, native = run(NATIVE, tmp_path, clip=clip)
    assert_really_amp(plan)
    assert plan.calls == 2 * N_BATCHES
    _, ours = run(OURS, tmp_path, clip=clip)
    assert_same(native, ours)
    # and a megengine.amp checkpoint resumes into unified_amp's scaler unchanged
    ours_loaded = OURS()
    ours_loaded.load_state_dict(pickle.loads(native["saved_scaler"]))
    assert pickle.dumps(as_megengine_saves(ours_loaded.state_dict())) == native["saved_scaler"]


def test_step_grad_accumulation(tmp_path):
    """basecore's `step_grad=False` accumulation calls `backward(gm, loss)` (unscale and
    update) on every micro-batch, so the second backward adds scaled gradients to the
    first's unscaled ones. megengine.amp unscales that mix: its weights differ from its
    own documented accumulation form (DocumentedForm). unified_amp's automatic mode
    rescales what it holds before each backward and gives the true sum: the documented
    form's weights and optimizer state, byte for byte. Its scale history differs from
    that form's by design of the call (basecore updates the scale after every
    micro-batch, the documented form once per step), so it is not compared; the steps
    that ran are. Both planted overflows fall on the last micro-batch of a step, where
    every form skips the whole step."""
    plan, mixed = run(NATIVE, tmp_path, accumulate=2)
    assert plan.dtypes == {np.dtype("float16")} and plan.stepped == [4, 6, 10, 12]
    _, documented = run(DocumentedForm, tmp_path, accumulate=2)
    assert mixed["weights"] != documented["weights"]  # megengine.amp's own form mixes
    _, ours = run(OURS, tmp_path, accumulate=2)
    for key in ("weights", "optimizer", "stepped"):
        assert ours[key] == documented[key], f"{key} differs"


def test_runs_on_the_pinned_version():
    pins.assert_installed_as_pinned("megengine", "basecore")
