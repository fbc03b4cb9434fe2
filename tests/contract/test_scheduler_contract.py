"""The documented pattern for LR schedulers (docs/DISTRIBUTED.md): step the scheduler only
when the optimizer stepped, read from ``scaler.stats()["last_step_skipped"]`` after the
iteration's update, in either call form, on both backends."""

import pytest

import unified_amp as amp

from .loops import STEPS, Problem


@pytest.mark.parametrize("style", sorted(STEPS))
def test_scheduler_follows_the_optimizer_through_a_planted_overflow(kit, device, style):
    p = Problem(kit, device)
    gm = amp.GradManager(p.params)
    opt = kit.sgd(p.params, lr=0.1)
    sched = kit.lr_milestones(opt, milestones=list(range(1, 10)), gamma=0.5)
    scaler = amp.GradScaler(init_scale=2.0**10)
    lrs = []
    for i in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        STEPS[style](scaler, gm, opt, p, overflow=(i == 2))
        if not scaler.stats()["last_step_skipped"]:
            sched.step()
    # The LR each optimizer step used: the skipped step 2 did not count as a step.
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.025, 0.0125, 0.00625])
    assert scaler.stats()["skipped_steps"] == 1
