"""Hugging Face accelerate with its scaler slot, `accelerator.scaler`: torch.amp's
GradScaler, then unified_amp's, in a loop written the accelerate way
(`accelerator.accumulate`, `accelerator.backward`, `accelerator.clip_grad_norm_`, the
prepared optimizer's step) and a resume through `accelerator.save_state`/`load_state`,
which save and load the scaler. Weights, optimizer state, scale after every batch, the
steps that ran, accelerate's own `optimizer_step_was_skipped`, and the scaler state
accelerate saved are equal byte for byte.

accelerate keys fp16 on CUDA: on CPU `Accelerator(mixed_precision="fp16")` makes no
scaler and no autocast (`native_amp` stays False; bf16 gets autocast and no scaler). So
the test sets the fp16 path after construction and before `prepare`, as accelerate does
on a GPU: `native_amp = True` (prepare then wraps the forward in `torch.autocast("cpu",
float16)`) and the scaler in `accelerator.scaler`."""

import pytest
import torch
from accelerate import Accelerator

import unified_amp

from . import pins
from . import torch_kit as kit

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler


def prepared(GradScaler, plan, accumulate, **scaler_args):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True,
                              gradient_accumulation_steps=accumulate)
    assert accelerator.scaler is None and not accelerator.native_amp  # on CPU, as said
    accelerator.native_amp = True
    accelerator.scaler = scaler = GradScaler("cpu", **scaler_args)
    net = kit.model()
    opt = kit.optimizer(net)
    plan.attach(net, opt)
    net, opt, data = accelerator.prepare(net, opt, kit.loader())
    assert opt.scaler is scaler
    return accelerator, net, opt, data


def epoch(accelerator, net, opt, data, plan, clip, skipped):
    for x, y in data:
        with accelerator.accumulate(net):
            accelerator.backward(plan.loss(net(x), y))
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            skipped.append(accelerator.optimizer_step_was_skipped)
        plan.record_scale(accelerator.scaler)


def run(GradScaler, tmp_path, accumulate, clip):
    """Epoch 1, `save_state`, then a new Accelerator (a scaler at its defaults) that
    `load_state`s it and trains epoch 2."""
    plan, skipped = kit.Plan(inf_loss=(3,), inf_grad=(11,)), []
    accelerator, net, opt, data = prepared(GradScaler, plan, accumulate, **kit.SCALER_ARGS)
    epoch(accelerator, net, opt, data, plan, clip, skipped)
    folder = tmp_path / GradScaler.__module__
    accelerator.save_state(str(folder))

    accelerator, net, opt, data = prepared(GradScaler, plan, accumulate)
    accelerator.load_state(str(folder))
    epoch(accelerator, net, opt, data, plan, clip, skipped)
    return plan, dict(weights=kit.weights(accelerator.unwrap_model(net)),
                      optimizer=kit.optimizer_state(opt.optimizer),
                      scales=plan.scales, stepped=plan.stepped, skipped=skipped,
                      saved_scaler=kit.scaler_bytes(torch.load(folder / "scaler.pt")),
                      final_scaler=kit.scaler_bytes(accelerator.scaler.state_dict()))


@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.5)],
                         ids=["plain", "accumulate2-clip"])
def test_accelerator_same_bytes_with_either_scaler(tmp_path, accumulate, clip):
    plan, native = run(NATIVE, tmp_path, accumulate, clip)
    kit.assert_really_amp(plan, accumulate)
    assert plan.calls == 2 * kit.N_BATCHES
    assert sum(native["skipped"]) == 2  # accelerate saw both planted overflows skipped
    _, ours = run(OURS, tmp_path, accumulate, clip)
    kit.assert_same(native, ours)


def test_runs_on_the_pinned_version():
    pins.assert_installed_as_pinned("torch", "accelerate")
