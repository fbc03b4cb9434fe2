"""Enchanter's runner with its scaler slot, `runner.scaler = GradScaler(...)`: torch.amp's
GradScaler, then unified_amp's, in Enchanter's own ClassificationRunner loop, with a
resume through Enchanter's `runner.save`/`runner.load` (model and optimizer; Enchanter's
checkpoint holds no scaler, so the scaler's state_dict travels beside it, as a user must
carry it). Weights, optimizer state, scale after every step, the steps that ran and the
scaler state are equal byte for byte. Enchanter's loop offers neither gradient clipping
nor accumulation.

Enchanter keys AMP on CUDA: it scales only if `isinstance(runner.scaler,
torch.cuda.amp.GradScaler)` and autocasts with `torch.cuda.amp.autocast`, and on CPU that
scaler disables itself and that autocast does nothing. So on CPU the test points the
names Enchanter looks up at their device-generic forms (`torch.amp.GradScaler`,
`torch.autocast("cpu", float16)`); the runner's code is otherwise its own. That on CUDA
unified_amp's scaler passes Enchanter's own check is tested below too."""

import pytest
import torch

import enchanter.engine.runner as runner_module
import enchanter.tasks.classification as classification_module
import unified_amp
from enchanter.callbacks import Callback, TensorBoardLogger
from enchanter.tasks import ClassificationRunner

from . import pins
from . import torch_kit as kit

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler


@pytest.fixture
def cpu_amp(monkeypatch):
    monkeypatch.setattr(runner_module, "amp", torch.amp)
    monkeypatch.setattr(classification_module, "GradScaler", torch.amp.GradScaler)
    monkeypatch.setattr(classification_module, "autocast",
                        lambda enabled: torch.autocast("cpu", torch.float16, enabled=enabled))


class RecordScale(Callback):
    def __init__(self, plan, runner):
        super().__init__()
        self.plan, self.runner = plan, runner

    def on_train_step_end(self, logs=None):
        self.plan.record_scale(self.runner.scaler)


def one_epoch(GradScaler, plan, tmp_path, load=None, **scaler_args):
    net = kit.model()
    opt = kit.optimizer(net)
    runner = ClassificationRunner(net, opt, plan.loss, TensorBoardLogger(str(tmp_path / "tb")))
    runner.callbacks = [RecordScale(plan, runner)]
    runner.scaler = GradScaler("cpu", **scaler_args)
    if load is not None:
        runner.load(load["runner"])
        runner.scaler.load_state_dict(load["scaler"])
    plan.attach(net, opt)
    runner.add_loader("train", kit.loader())
    runner.train_config(epochs=1)
    runner.run(phase="train", verbose=False)
    return runner


def run(GradScaler, tmp_path):
    """Epoch 1, `runner.save`, then a new runner (a scaler at its defaults) that
    `runner.load`s it, takes the scaler state, and trains epoch 2."""
    plan = kit.Plan(inf_loss=(3,), inf_grad=(11,))
    runner = one_epoch(GradScaler, plan, tmp_path, **kit.SCALER_ARGS)
    path = tmp_path / f"{GradScaler.__module__}.pth"
    runner.save(filename=str(path))
    saved = runner.scaler.state_dict()
    runner = one_epoch(GradScaler, plan, tmp_path, load={"runner": str(path), "scaler": saved})
    return plan, dict(weights=kit.weights(runner.model),
                      optimizer=kit.optimizer_state(runner.optimizer),
                      scales=plan.scales, stepped=plan.stepped,
                      saved_scaler=kit.scaler_bytes(saved),
                      final_scaler=kit.scaler_bytes(runner.scaler.state_dict()))


def test_runner_same_bytes_with_either_scaler(cpu_amp, tmp_path):
    plan, native = run(NATIVE, tmp_path)
    kit.assert_really_amp(plan)
    assert plan.calls == 2 * kit.N_BATCHES
    _, ours = run(OURS, tmp_path)
    kit.assert_same(native, ours)


def test_on_cuda_ours_passes_enchanters_own_amp_check():
    """Unpatched, Enchanter scales only a `torch.cuda.amp.GradScaler`; unified_amp's
    CUDA scaler is one (disabled here, where CUDA is absent, as torch's is)."""
    with pytest.warns(UserWarning, match="CUDA is not available"):
        ours = OURS("cuda")
    assert isinstance(ours, runner_module.amp.GradScaler)
    assert runner_module.amp is torch.cuda.amp


def test_runs_on_the_pinned_version():
    pins.assert_installed_as_pinned("torch", "enchanter")
