"""PyTorch Lightning's Trainer with its scaler slot, `MixedPrecision("16-mixed", "cpu",
scaler=...)`: torch.amp's GradScaler, then unified_amp's, in the Trainer's own loop
(its gradient clipping, gradient accumulation and checkpoint resume). Weights,
optimizer state, scale after every batch, the steps that ran, and the scaler state the
Trainer saved in its checkpoints are equal byte for byte.

Lightning turns `Trainer(precision="16-mixed")` on CPU into bfloat16 without a scaler;
passing the plugin is its documented way to choose a scaler, and float16 on CPU."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

import unified_amp

from . import pins
from . import torch_kit as kit

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler


class Net(pl.LightningModule):
    def __init__(self, plan, fused):
        super().__init__()
        self.net = kit.model()
        self.plan, self.fused = plan, fused
        plan.attach(self.net)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.plan.loss(self.net(x), y)

    def configure_optimizers(self):
        opt = kit.optimizer(self.net, fused=self.fused)
        self.plan.watch(opt)
        return opt


class RecordScale(pl.Callback):
    def __init__(self, plan):
        self.plan = plan

    def on_train_batch_end(self, trainer, *args):
        self.plan.record_scale(trainer.precision_plugin.scaler)


def run(GradScaler, tmp_path, accumulate, clip, fused):
    """Epoch 1, a checkpoint, then a new Trainer (with a scaler at its defaults) resumed
    from that checkpoint for epoch 2."""
    plan = kit.Plan(inf_loss=(3,), inf_grad=(11,))

    def trainer(epochs, scaler):
        return pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=epochs,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            accumulate_grad_batches=accumulate, gradient_clip_val=clip,
            callbacks=[RecordScale(plan)], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False)

    first = trainer(1, GradScaler("cpu", **kit.SCALER_ARGS))
    first.fit(Net(plan, fused), kit.loader())
    mid = tmp_path / f"{GradScaler.__module__}-mid.ckpt"
    first.save_checkpoint(mid)

    scaler = GradScaler("cpu")
    second = trainer(2, scaler)
    net = Net(plan, fused)
    second.fit(net, kit.loader(), ckpt_path=mid)
    assert second.precision_plugin.scaler is scaler  # the slot kept the scaler passed
    end = tmp_path / f"{GradScaler.__module__}-end.ckpt"
    second.save_checkpoint(end)
    saved = [torch.load(p, weights_only=False)["MixedPrecision"] for p in (mid, end)]
    return plan, dict(weights=kit.weights(net.net),
                      optimizer=kit.optimizer_state(second.optimizers[0]),
                      scales=plan.scales, stepped=plan.stepped,
                      saved_scaler=[kit.scaler_bytes(s) for s in saved])


@pytest.mark.parametrize("accumulate, clip, fused", [(1, None, False), (2, 0.5, False),
                                                     (1, None, True)],
                         ids=["plain", "accumulate2-clip", "fused-adam"])
def test_trainer_same_bytes_with_either_scaler(tmp_path, accumulate, clip, fused):
    """fused-adam: Lightning leaves the unscaling to the optimizer (it skips `unscale_`
    for an optimizer that says `_step_supports_amp_scaling`) and forbids clipping."""
    plan, native = run(NATIVE, tmp_path, accumulate, clip, fused)
    kit.assert_really_amp(plan, accumulate)
    assert plan.calls == 2 * kit.N_BATCHES
    _, ours = run(OURS, tmp_path, accumulate, clip, fused)
    kit.assert_same(native, ours)


def test_runs_on_the_pinned_version():
    pins.assert_installed_as_pinned("torch", "pytorch-lightning")
