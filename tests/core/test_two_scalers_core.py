"""Two GradScalers in one process share no state: one overflowing leaves the other's
overflow reports, forward traces, skip decisions and scale alone."""

import math

import unified_amp as amp

from .fake_backend import FakeOptimizer, FakeTensor
from .test_forensics_core import loss_on, model_of, step

INF = math.inf


def test_one_scalers_overflow_leaves_the_others_forensics_and_decisions_alone(capable_fake):
    model_a = model_of(capable_fake, small=1.0, big=1e5)  # big overflows float16
    model_b = model_of(capable_fake, encoder=1.0, head=2.0)
    params_a, params_b = model_a.parameters(), model_b.parameters()
    opt_a, opt_b = FakeOptimizer(params_a), FakeOptimizer(params_b)
    scaler_a = amp.GradScaler(init_scale=4.0).watch(model_a)
    scaler_b = amp.GradScaler(init_scale=8.0, growth_interval=1).watch(model_b)
    gm_a = amp.GradManager(params_a)
    with amp.trace_forward(model_a), amp.trace_forward(model_b):
        with gm_a:
            with amp.autocast(dtype="float16"):
                model_a(FakeTensor([1.0]))
            # B's whole iteration, clean, runs between A's forward and A's backward: its
            # update() must not drop the flags A's report needs.
            step(scaler_b, params_b, opt_b, [[1.0], [1.0]],
                 forward=lambda: model_b(FakeTensor([1.0, 2.0])))
            gm_a.backward(scaler_a.scale(loss_on(params_a, [[1.0], [INF]], value=INF)))
        scaler_a.step(opt_a)
        scaler_a.update()
        # And B's next iteration, after A's overflow, is clean and reported as such.
        step(scaler_b, params_b, opt_b, [[1.0], [1.0]],
             forward=lambda: model_b(FakeTensor([1.0, 2.0])))

    report = scaler_a.last_overflow()
    assert report is not None and report.traced
    assert report.first_nonfinite is not None
    assert (report.first_nonfinite.module, report.first_nonfinite.dtype) == ("big", "float16")
    assert report.cause == "forward-float16"
    assert [g.name for g in report.gradients] == ["big.weight"]
    assert (opt_a.steps, scaler_a.get_scale(), scaler_a.stats()["skipped_steps"]) == (0, 2.0, 1)

    assert scaler_b.last_overflow() is None and scaler_b.stats()["overflows"] == []
    assert opt_b.steps == 2  # both of B's steps ran
    assert scaler_b.stats()["skipped_steps"] == 0
    assert scaler_b.get_scale() == 32.0  # grew after each clean step (growth_interval=1)
