"""Lightning Fabric with its scaler slot, `MixedPrecision("16-mixed", "cpu", scaler=...)`:
torch.amp's GradScaler, then unified_amp's, in a loop written the Fabric way
(`fabric.backward`, `fabric.clip_gradients`, `fabric.no_backward_sync` for accumulation,
`fabric.save`/`fabric.load` with the scaler in the state for a resume). Weights,
optimizer state, scale after every batch, the steps that ran and the scaler state Fabric
saved are equal byte for byte.

`Fabric(precision="16-mixed")` on CPU becomes bfloat16 without a scaler; passing the
plugin is Fabric's documented way to choose a scaler, and float16 on CPU."""

import pytest
import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.precision import MixedPrecision

import unified_amp

from . import pins
from . import torch_kit as kit

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler


def epoch(fabric, net, opt, scaler, plan, accumulate, clip):
    for i, (x, y) in enumerate(fabric.setup_dataloaders(kit.loader())):
        boundary = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(net, enabled=not boundary):
            fabric.backward(plan.loss(net(x), y))
        if boundary:
            if clip:
                # Fabric raises on a non-finite norm by default; under AMP an overflowed
                # step is the scaler's to skip.
                fabric.clip_gradients(net, opt, max_norm=clip, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
        plan.record_scale(scaler)


def setup(GradScaler, plan, **scaler_args):
    scaler = GradScaler("cpu", **scaler_args)
    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    net = kit.model()
    opt = kit.optimizer(net)
    plan.attach(net, opt)
    net, opt = fabric.setup(net, opt)
    assert fabric.strategy.precision.scaler is scaler
    return fabric, net, opt, scaler


def run(GradScaler, tmp_path, accumulate, clip):
    """Epoch 1, `fabric.save`, then a new Fabric (a scaler at its defaults) that
    `fabric.load`s the checkpoint and trains epoch 2."""
    plan = kit.Plan(inf_loss=(3,), inf_grad=(11,))
    fabric, net, opt, scaler = setup(GradScaler, plan, **kit.SCALER_ARGS)
    epoch(fabric, net, opt, scaler, plan, accumulate, clip)
    path = tmp_path / f"{GradScaler.__module__}.ckpt"
    fabric.save(path, {"model": net, "optimizer": opt, "scaler": scaler})

    fabric, net, opt, scaler = setup(GradScaler, plan)
    fabric.load(path, {"model": net, "optimizer": opt, "scaler": scaler})
    epoch(fabric, net, opt, scaler, plan, accumulate, clip)
    return plan, dict(weights=kit.weights(net), optimizer=kit.optimizer_state(opt),
                      scales=plan.scales, stepped=plan.stepped,
                      saved_scaler=kit.scaler_bytes(torch.load(path)["scaler"]),
                      final_scaler=kit.scaler_bytes(scaler.state_dict()))


@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.5)],
                         ids=["plain", "accumulate2-clip"])
def test_fabric_same_bytes_with_either_scaler(tmp_path, accumulate, clip):
    plan, native = run(NATIVE, tmp_path, accumulate, clip)
    kit.assert_really_amp(plan, accumulate)
    assert plan.calls == 2 * kit.N_BATCHES
    _, ours = run(OURS, tmp_path, accumulate, clip)
    kit.assert_same(native, ours)


def test_runs_on_the_pinned_version():
    pins.assert_installed_as_pinned("torch", "lightning-fabric")
