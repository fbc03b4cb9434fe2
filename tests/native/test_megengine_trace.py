"""unified_amp under ``megengine.jit.trace`` (symbolic=False and True), overflows planted.

- The forward and loss traced, the scaler outside: bit for bit megengine.amp's run and
  the eager run (weights, scale history), in this process.
- The whole step traced: the scenarios of megengine_trace_scenarios.py run in a process
  of their own (one for all, to spare a MegEngine import each), since a host read
  inside a trace can kill the process (SIGSEGV) instead of raising. A step the scaler can run on the device trains exactly as the eager step
  (weights, scale history, skipped steps); a call that needs the host raises
  ``amp.UnsupportedTraceError`` naming what to move out of the trace, with the weights
  and the scale as they were before the step. Never a crash, never a silent difference.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

import megengine.amp
import megengine.functional as F
import megengine.optimizer as optim
from megengine.autodiff import GradManager
from megengine.jit import trace

import unified_amp as amp

from . import megengine_trace_scenarios as sc

SCENARIOS_PY = os.path.join(os.path.dirname(__file__), "megengine_trace_scenarios.py")


def forward_traced_loop(autocast, GradScaler, symbolic):
    """megengine.amp's documented use of trace: the forward and loss traced;
    backward(gm, loss) and the optimizer outside. symbolic None runs it eagerly."""
    model, batches = sc.model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler(init_scale=sc.INIT, growth_interval=sc.INTERVAL)

    def forward(x, y):
        with autocast():
            return F.nn.cross_entropy(model(x), y)

    fn = forward if symbolic is None else trace(forward, symbolic=symbolic)
    history = []
    for i in range(sc.STEPS):
        x, y = sc.batch(batches, i, i in sc.OVERFLOW_AT)
        with gm:
            scaler.backward(gm, fn(x, y))
        opt.step().clear_grad()
        history.append(scaler.scale_factor)
    return sc.weights(model), history


@pytest.mark.parametrize("symbolic", [False, True], ids=["symbolic=False", "symbolic=True"])
def test_traced_forward_matches_megengine_amp_and_eager(symbolic):
    native = forward_traced_loop(megengine.amp.autocast, megengine.amp.GradScaler, symbolic)
    ours = forward_traced_loop(amp.autocast, amp.GradScaler, symbolic)
    eager = forward_traced_loop(amp.autocast, amp.GradScaler, None)
    assert ours == native == eager
    assert min(eager[1]) < max(eager[1])  # the planted overflows backed the scale off


@pytest.mark.parametrize("symbolic", [False, True], ids=["symbolic=False", "symbolic=True"])
def test_overflow_report_of_a_traced_forward_says_it_could_not_see_it(symbolic):
    """trace_forward's flags inside a trace read back as finite after a replay; the
    report must not claim "every traced forward output was finite"."""
    model, batches = sc.model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler(init_scale=sc.INIT).watch(model)

    @trace(symbolic=symbolic)
    def forward(x, y):
        with amp.autocast():
            return F.nn.cross_entropy(model(x), y)

    with amp.trace_forward(model):
        for i in range(3):  # the overflow at step 1 is met by a replay
            x, y = sc.batch(batches, i, i == 1)
            with gm:
                scaler.backward(gm, forward(x, y))
            opt.step().clear_grad()
    report = scaler.last_overflow()
    assert report is not None and report.step == 2
    assert report.forward_in_trace and not report.traced
    assert report.cause == "forward"
    assert "inside a traced function" in str(report)


@pytest.fixture(scope="module")
def scenario_process():
    """Every scenario, in order, in one fresh interpreter: its return code, stderr and
    results by name. without_host goes last: MegEngine leaves that mode's hooks
    installed after an error, and they break making the next model."""
    names = RUNS + sorted(REFUSED, key=lambda n: n == "without_host")
    env = dict(os.environ, MEGENGINE_LOGGING_LEVEL="ERROR", UNIFIED_AMP_BACKEND="megengine")
    proc = subprocess.run([sys.executable, "-W", "ignore", SCENARIOS_PY, *names], env=env,
                          capture_output=True, text=True, timeout=600)
    results: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results.setdefault(r["name"], []).append(r)
    return proc.returncode, proc.stderr, results


def results_of(scenario_process, name):
    """The scenario's results; a crash before they were printed fails the test."""
    returncode, stderr, results = scenario_process
    if name not in results:
        how = (f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else
               f"exited with {returncode}")
        pytest.fail(f"no result for {name!r}: the scenario process {how}; stderr:\n"
                    f"{stderr[-3000:]}")
    return results[name]


def test_no_scenario_killed_the_process(scenario_process):
    returncode, stderr, _ = scenario_process
    assert returncode == 0, stderr[-3000:]


# Loops the scaler runs on the device inside a trace.
RUNS = ["torch_form", "unscale_then_step", "clip_native", "backward_then_step", "watched",
        "adam", "eager_between", "automatic_first", "weight_decay", "weight_decay_clip",
        "clip_sgd"]
# Scenarios with eager steps among the traced ones: those make overflow reports.
EAGER_STEPS = {"eager_between", "automatic_first"}


@pytest.mark.parametrize("name", RUNS)
def test_traced_whole_step_trains_as_the_eager_step(scenario_process, name):
    results = results_of(scenario_process, name)
    assert [r["symbolic"] for r in results] == [False, True]
    for r in results:
        eager, traced = r["eager"], r["traced"]
        assert "error" not in traced, traced
        assert traced["weights"] == eager["weights"]
        assert traced["history"] == eager["history"]
        assert traced["losses"] == eager["losses"]
        assert traced["skipped"] == eager["skipped"] == len(sc.OVERFLOW_AT)
        assert traced["steps"] == eager["steps"] == sc.STEPS
        assert min(eager["history"]) < max(eager["history"])  # it backed off and grew
        # A step decided on the device makes no overflow report (that needs a host
        # read); the steps run eagerly in between do.
        assert traced["report"] == (name in EAGER_STEPS)


# Calls that need the host: (scenario, the call named, what the message must offer).
REFUSED = {
    "automatic": ("GradScaler.backward(gm, loss)", "unscale_grad=False"),
    "manual_unscale": ("GradScaler.unscale()", "scaler.unscale_(optimizer)"),
    "scale_factor_dy": ("GradScaler.get_scale() (or scale_factor)", "scaler.scale(loss)"),
    "new_scale": ("GradScaler.update(new_scale=...)", "between traced calls"),
    "read_state": ("GradScaler.state_dict()", "between traced calls"),
    "without_host": ("without_host=True", "without_host=False"),
    "inexact_backoff": ("backoff_factor=0.3", "exact in float32"),
    "clip_unified": ("amp.clip_grad_norm()", "megengine.optimizer.clip_grad_norm"),
    "inplace_update": ("MEGENGINE_INPLACE_UPDATE=1", "Unset it"),
}
# These raise after the step itself ran (as eagerly), so the weights moved, once.
REFUSED_AFTER_THE_STEP = {"new_scale", "read_state"}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_traced_call_that_needs_the_host_raises_a_clear_error(scenario_process, name):
    results = results_of(scenario_process, name)
    assert results, "no result"
    what, fix = REFUSED[name]
    for r in results:
        traced = r["traced"]
        assert traced.get("error") == "UnsupportedTraceError", traced
        assert traced["step"] == 0  # at the first traced call, the one with no overflow
        assert what in traced["message"] and fix in traced["message"]
        assert "outside the trace" in traced["message"] or "between traced" in traced["message"]
        assert traced["scale_unchanged"]
        assert traced["weights_unchanged"] == (name not in REFUSED_AFTER_THE_STEP)


def megengine_alone(trace_kwargs, clip):
    """MegEngine without unified_amp: plain SGD, optionally after clip_grad_norm, eager
    and traced (trace_kwargs None: eager). Returns the weights after the loop."""
    model, batches = sc.model_and_data()
    gm = GradManager().attach(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        with gm:
            gm.backward(F.nn.cross_entropy(model(x), y))
        if clip:
            optim.clip_grad_norm(model.parameters(), 0.5)
        opt.step().clear_grad()

    fn = step if trace_kwargs is None else trace(step, **trace_kwargs)
    for i in range(sc.STEPS):
        fn(*sc.batch(batches, i, False))
    return sc.weights(model)


# The limit COMPILE.md states: MegEngine's graph optimizer (default opt_level=2) alone
# reorders clip_grad_norm's multiply with SGD's (lr * (grad * coef) as (lr * coef) * grad),
# so MegEngine's own traced step differs from its eager step in the last bits; at
# opt_level=0, or without the clip, it does not. The scaler's traced step with the same
# clip equals the eager one (the clip_sgd scenario above).
@pytest.mark.parametrize("symbolic", [False, True], ids=["symbolic=False", "symbolic=True"])
def test_megengine_alone_traces_a_clipped_sgd_step_to_other_bits(symbolic):
    eager = megengine_alone(None, clip=True)
    assert megengine_alone({"symbolic": symbolic}, clip=True) != eager
    assert megengine_alone({"symbolic": symbolic, "opt_level": 0}, clip=True) == eager


def test_megengine_alone_traces_an_unclipped_sgd_step_to_eager_bits():
    eager = megengine_alone(None, clip=False)
    assert megengine_alone({"symbolic": True}, clip=False) == eager


def test_the_error_is_a_documented_runtime_error():
    assert issubclass(amp.UnsupportedTraceError, RuntimeError)
    assert issubclass(amp.UnsupportedTraceError, amp.UnifiedAmpError)


def test_a_scaler_made_inside_a_trace_raises_instead_of_freezing_its_scale():
    model, batches = sc.model_and_data()
    gm = GradManager().attach(model.parameters())

    @trace(symbolic=False)
    def step(x, y):
        scaler = amp.GradScaler(init_scale=sc.INIT)
        with gm:
            gm.backward(scaler.scale(F.nn.cross_entropy(model(x), y)))

    with pytest.raises(amp.UnsupportedTraceError, match="Make the GradScaler before"):
        step(*sc.batch(batches, 0, False))
