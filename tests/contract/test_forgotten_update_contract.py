"""megengine.amp's manual form with ``scaler.update()`` forgotten, on every backend
(issue 29, item 3): ``gm.backward(scaler.scale(loss)); scaler.unscale(gm); opt.step()`` in
a loop, with a scale at which every step overflows.

megengine.amp allows unscaling new gradients again and again without ``update()``, so
the loop runs as there: every step is skipped and the scale stays where it is, since only
``update()`` backs it off. What it must not be is silent or misreported: ``stats()``
counts the checks and overflows since the last update, the reports say that the scale has
not backed off, and one ``OverflowWarning``, at the first check no update() preceded, says
that it cannot.
"""

import warnings

import numpy as np

import unified_amp as amp

from .loops import bits

# float32 holds 3 * 2**127 as inf: every gradient overflows at this scale, the loss not.
SCALE = 2.0**127


def _stalled_loop(kit, device, steps, **watch):
    w = kit.param(np.array([0.5, -1.0], np.float32), device)
    x = kit.tensor(np.array([3.0, 3.0], np.float32), device)
    gm, opt = amp.GradManager([w]), kit.sgd([w], 0.1)
    scaler = amp.GradScaler(init_scale=SCALE)
    if watch:
        scaler.watch(**watch)
    before = bits([kit.numpy(w)])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(steps):
            with gm:
                gm.backward(scaler.scale(kit.total(kit.mul(w, x))))
            scaler.unscale(gm)  # the overflowed gradients are dropped here
            opt.step()
    assert bits([kit.numpy(w)]) == before  # every step skipped
    caught = [str(r.message) for r in record if r.category is amp.OverflowWarning]
    return scaler, caught


def test_stats_count_the_checks_and_overflows_since_the_last_update(kit, device):
    # 70 checks: more than the iteration keeps one by one (the rest are counted).
    scaler, _ = _stalled_loop(kit, device, 70)
    stats = scaler.stats()
    assert (stats["steps"], stats["skipped_steps"], stats["scale"]) == (0, 0, SCALE)
    assert (stats["checks_since_update"], stats["overflows_since_update"]) == (70, 70)
    scaler.update()  # the update the loop forgot: one step, skipped, the scale backs off
    stats = scaler.stats()
    assert (stats["steps"], stats["skipped_steps"], stats["last_step_skipped"]) == (1, 1,
                                                                                    True)
    assert stats["scale"] == SCALE / 2
    assert (stats["checks_since_update"], stats["overflows_since_update"]) == (0, 0)


def test_a_loop_that_never_updates_is_warned_about_once(kit, device):
    # At the second check of the same gradients, the first that no update() preceded.
    _, caught = _stalled_loop(kit, device, 8, warn_after=3)
    assert len(caught) == 1
    assert caught[0].startswith(
        "unified_amp: a gradient check found inf/NaN gradients (step 1) and the next check"
        " of the same gradients came with no scaler.update() between them: the loss scale"
        " stays 1.70141e+38, since only update() backs it off, so the following steps"
        " may overflow and be dropped too. Call scaler.update() once per iteration, after"
        " the optimizer step")


def test_reports_do_not_say_the_scale_backs_off_when_no_update_came(kit, device):
    scaler, _ = _stalled_loop(kit, device, 4)
    history = scaler.stats()["overflows"]
    assert [r["overflows_since_update"] for r in history] == [1, 2, 3, 4]
    assert history[0]["line"].endswith("; the scale backs off")
    assert history[-1]["line"].endswith(
        "the loss was finite, so the scaled gradients overflowed in the backward pass; 4"
        " checks since the last update() found inf/NaN, and only update() backs the scale"
        " off")
    assert "the scale backs off" not in history[-1]["line"]
