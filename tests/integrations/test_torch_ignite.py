"""pytorch-ignite's `create_supervised_trainer(amp_mode="amp", scaler=...)`: torch.amp's
GradScaler, then unified_amp's, in ignite's own update function (its gradient
accumulation) and a resume through ignite's `Checkpoint` handler (model, optimizer,
scaler and trainer state). Weights, optimizer state, scale after every iteration, the
steps that ran and the scaler state the handler saved are equal byte for byte. ignite's
supervised step offers no gradient clipping.

ignite's amp_mode="amp" enters `autocast("cuda")`, which leaves CPU tensors alone: the
test's `model_fn` (ignite's hook around the forward) adds `torch.autocast("cpu",
float16)`, so the forward really runs in float16 on CPU."""

import pytest
import torch
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver

import unified_amp

from . import pins
from . import torch_kit as kit

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler

pytestmark = pytest.mark.filterwarnings(
    "ignore:CUDA is not available or torch_xla is imported. Disabling autocast:UserWarning")


def forward_fp16(net, x):
    with torch.autocast("cpu", dtype=torch.float16):
        return net(x)


def trainer_for(GradScaler, plan, accumulate, **scaler_args):
    net = kit.model()
    opt = kit.optimizer(net)
    plan.attach(net, opt)
    scaler = GradScaler("cpu", **scaler_args)
    trainer = create_supervised_trainer(
        net, opt, plan.loss, device="cpu", amp_mode="amp", scaler=scaler,
        gradient_accumulation_steps=accumulate, model_fn=forward_fp16)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda _: plan.record_scale(scaler))
    return trainer, {"model": net, "optimizer": opt, "scaler": scaler, "trainer": trainer}


def run(GradScaler, tmp_path, accumulate):
    """Epoch 1 with a Checkpoint handler at its end, then a new trainer (a scaler at its
    defaults) restored with `Checkpoint.load_objects` and run on to epoch 2."""
    plan = kit.Plan(inf_loss=(3,), inf_grad=(11,))
    folder = tmp_path / GradScaler.__module__
    trainer, objects = trainer_for(GradScaler, plan, accumulate, **kit.SCALER_ARGS)
    trainer.add_event_handler(Events.EPOCH_COMPLETED,
                              Checkpoint(objects, DiskSaver(str(folder), require_empty=False)))
    trainer.run(kit.loader(), max_epochs=1)
    (path,) = folder.iterdir()

    trainer, objects = trainer_for(GradScaler, plan, accumulate)
    Checkpoint.load_objects(objects, torch.load(path))
    trainer.run(kit.loader(), max_epochs=2)
    assert trainer.state.epoch == 2
    return plan, dict(weights=kit.weights(objects["model"]),
                      optimizer=kit.optimizer_state(objects["optimizer"]),
                      scales=plan.scales, stepped=plan.stepped,
                      saved_scaler=kit.scaler_bytes(torch.load(path)["scaler"]),
                      final_scaler=kit.scaler_bytes(objects["scaler"].state_dict()))


@pytest.mark.parametrize("accumulate", [1, 2], ids=["plain", "accumulate2"])
def test_supervised_trainer_same_bytes_with_either_scaler(tmp_path, accumulate):
    plan, native = run(NATIVE, tmp_path, accumulate)
    kit.assert_really_amp(plan, accumulate)
    assert plan.calls == 2 * kit.N_BATCHES
    _, ours = run(OURS, tmp_path, accumulate)
    kit.assert_same(native, ours)


def test_runs_on_the_pinned_version():
    pins.assert_installed_as_pinned("torch", "pytorch-ignite")
