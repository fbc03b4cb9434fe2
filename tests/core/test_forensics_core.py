"""Overflow forensics on the fake backend with the forensics probes: what a report says, when it is made (only
after an overflow), the once-per-run warning, and forward tracing's hooks."""

import gc
import json
import math
import pickle
import warnings

import pytest

import unified_amp as amp
from unified_amp._pin_hint import pin_expression

from ..spies import record_calls
from .fake_backend import NamedModule, FakeOptimizer, FakeTensor

INF, NAN = math.inf, math.nan


def model_of(backend, **scales):
    """A NamedModule running one scaling child per keyword, in order."""
    return NamedModule(**{name: NamedModule(scale=s, backend=backend)
                         for name, s in scales.items()})


def loss_on(params, grads, value=1.5):
    """A scalar loss whose gradient with respect to ``params[i]`` is ``grads[i]``."""
    return FakeTensor([value], deps=list(zip(params, grads)))


def step(scaler, params, opt, grads, *, form="torch", value=1.5, forward=None):
    """One iteration; ``forward()`` (a traced model call) runs first when given."""
    gm = amp.GradManager(params)
    with gm:
        if forward is not None:
            forward()
        loss = loss_on(params, grads, value)
        if form == "torch":
            gm.backward(scaler.scale(loss))
            scaler.step(opt)
            scaler.update()
        else:  # megengine.amp's automatic mode, then the optimizer's own step
            scaler.backward(gm, loss)
            opt.step()
    gm.zero_grad()


@pytest.fixture
def net(capable_fake):
    model = model_of(capable_fake, encoder=1.0, head=2.0)
    params = model.parameters()  # encoder.weight, head.weight
    return model, params, FakeOptimizer(params)


# -- what a report says --------------------------------------------------------------------
@pytest.mark.parametrize("form", ["torch", "megengine"])
def test_report_names_the_nonfinite_gradients_of_a_watched_model(capable_fake, net, form):
    model, params, opt = net
    scaler = amp.GradScaler(init_scale=8.0).watch(model)
    step(scaler, params, opt, [[1.0], [1.0]], form=form)
    assert scaler.last_overflow() is None and scaler.stats()["overflows"] == []

    step(scaler, params, opt, [[1.0], [INF]], form=form, value=0.25)
    report = scaler.last_overflow()
    assert report.as_dict() == {
        "step": 2, "scale": 8.0, "loss": 0.25, "checked": 2,
        "gradients": [{"name": "head.weight", "shape": [1], "inf": 1, "nan": 0}],
        "traced": False, "first_nonfinite": None, "bad_samples": [],
        "forward_in_trace": False, "overflows_since_update": 1, "micro_batch": 1,
        "micro_batches": 1, "cause": "backward",
        "line": report.line()}
    assert str(report) == report.line() == (
        "unified_amp: step 2 skipped (scale 8, loss 0.25): inf/NaN gradients in 1 of 2"
        " parameters: head.weight (1 inf of 1); the loss was finite, so the scaled"
        " gradients overflowed in the backward pass; the scale backs off")
    assert scaler.stats()["overflows"] == [report.as_dict()]
    json.dumps(report.as_dict())  # plain data


def test_unwatched_gradients_are_named_by_position_and_kinds_are_counted(capable_fake, net):
    _, params, opt = net
    scaler = amp.GradScaler()
    step(scaler, params, opt, [[NAN], [INF]], value=NAN)
    report = scaler.last_overflow()
    assert [(g.name, g.inf, g.nan) for g in report.gradients] == [
        ("param[0]", 0, 1), ("param[1]", 1, 0)]
    assert report.cause == "forward"
    assert report.line().endswith(
        "param[0] (1 NaN of 1), param[1] (1 inf of 1); the loss itself is inf/NaN, so the"
        " forward pass made it; amp.trace_forward(model) finds the layer")


def test_names_sort_naturally_and_long_lists_are_cut(capable_fake):
    model = model_of(capable_fake, **{f"layer{i}": 1.0 for i in (10, 9, 2, 1, 0, 3)})
    params = model.parameters()
    scaler = amp.GradScaler().watch(model)
    step(scaler, params, FakeOptimizer(params), [[INF]] * len(params))
    report = scaler.last_overflow()
    assert [g.name for g in report.gradients] == [
        "layer0.weight", "layer1.weight", "layer2.weight", "layer3.weight",
        "layer9.weight", "layer10.weight"]
    assert "layer9.weight (1 inf of 1) and 1 more;" in report.line()


def test_a_loss_the_scaler_never_saw_is_reported_as_unknown(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler().watch(model)
    gm = amp.GradManager(params)
    with gm:  # megengine.amp's manual mode: the scale handed out as dy
        gm.backward(loss_on(params, [[INF], [1.0]]), FakeTensor([scaler.scale_factor]))
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow()
    assert report.loss is None and report.cause == "unknown"
    assert report.line().endswith(
        "; forward or backward pass, unknown without the loss; amp.trace_forward(model)"
        " finds the layer")


def test_history_keeps_the_newest_reports(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler().watch(model, history=2)
    for _ in range(5):
        step(scaler, params, opt, [[INF], [1.0]])
    assert [r["step"] for r in scaler.stats()["overflows"]] == [4, 5]
    assert scaler.last_overflow().step == 5


# -- no cost on a clean step -------------------------------------------------------------


@pytest.mark.parametrize("form", ["torch", "megengine"])
def test_a_clean_step_calls_the_adapter_exactly_as_without_forensics(capable_fake, monkeypatch,
                                                                     form):
    logs = []
    for watched in (False, True):
        model = model_of(capable_fake, encoder=1.0, head=2.0)
        params = model.parameters()
        scaler = amp.GradScaler(init_scale=8.0)
        if watched:
            scaler.watch(model)
        log = record_calls(monkeypatch, capable_fake)
        capable_fake.syncs = 0
        for _ in range(4):
            step(scaler, params, FakeOptimizer(params), [[1.0], [2.0]], form=form)
        logs.append(list(log))
        monkeypatch.undo()
        assert capable_fake.syncs == 4 and capable_fake.forensic_reads == 0
    assert logs[0] == logs[1]


def test_an_overflow_step_adds_one_read_of_the_gradients(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler().watch(model)
    step(scaler, params, opt, [[INF], [1.0]])
    assert (capable_fake.syncs, capable_fake.forensic_reads, capable_fake.flags_made) == (1, 1, 0)


def test_a_failing_report_warns_and_the_step_is_still_skipped(capable_fake, net, monkeypatch):
    model, params, opt = net

    def broken(grads, losses, flags):
        raise RuntimeError("adapter bug")

    monkeypatch.setattr(capable_fake, "read_overflow", broken)
    scaler = amp.GradScaler().watch(model)
    with pytest.warns(RuntimeWarning, match="overflow report failed.*adapter bug"):
        step(scaler, params, opt, [[INF], [1.0]])
    assert opt.steps == 0 and scaler.stats()["skipped_steps"] == 1


# -- the warning, once per run of skipped steps --------------------------------------------
def overflow_warnings(record):
    return [w for w in record if issubclass(w.category, amp.OverflowWarning)]


def test_a_run_of_skips_warns_exactly_once_per_run(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler(init_scale=2.0**16).watch(model, warn_after=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for script in ([True] * 10, [False], [True] * 2, [False], [True] * 8):
            for overflow in script:
                step(scaler, params, opt, [[INF if overflow else 1.0], [1.0]])
    caught = overflow_warnings(record)
    assert len(caught) == 2
    assert str(caught[0].message).startswith(
        "unified_amp: 3 steps in a row (steps 1-3) skipped for inf/NaN gradients; loss"
        " scale now 8192: training is not progressing. Last: unified_amp: step 3 skipped"
        " (scale 16384, loss 1.5): inf/NaN gradients in 1 of 2 parameters:"
        " encoder.weight (1 inf of 1);")
    assert "(steps 15-17)" in str(caught[1].message)
    assert caught[0].filename == __file__  # attributed to the training loop's line


def test_a_scale_that_collapses_below_the_floor_warns_once(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler(init_scale=4.0).watch(model, warn_after=1000, warn_below=1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):  # 4 -> 2 -> 1: not below the floor yet
            step(scaler, params, opt, [[INF], [1.0]])
        assert overflow_warnings(record) == []
        for _ in range(30):  # 0.5, 0.25, ... 2**-29
            step(scaler, params, opt, [[INF], [1.0]])
    (caught,) = overflow_warnings(record)
    assert "3 steps in a row (steps 1-3)" in str(caught.message)
    assert "loss scale now 0.5, below warn_below=1" in str(caught.message)


def test_one_skip_below_the_floor_is_no_collapse(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler(init_scale=0.5).watch(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for overflow in (True, False, True, False):
            step(scaler, params, opt, [[INF if overflow else 1.0], [1.0]])
    assert overflow_warnings(record) == []


def test_watch_rejects_bad_arguments_with_the_fix(capable_fake, net):
    model, params, _ = net
    scaler = amp.GradScaler()
    with pytest.raises(TypeError, match="expects a fake module.*got list. Pass the model"
                                        " itself, not its parameters"):
        scaler.watch(params)
    with pytest.raises(ValueError, match="warn_after must be >= 1; got 0"):
        scaler.watch(model, warn_after=0)
    with pytest.raises(TypeError, match="history must be an int; got 2.5"):
        scaler.watch(model, history=2.5)
    with pytest.raises(ValueError, match="warn_below must be a finite number >= 0"):
        scaler.watch(model, warn_below=-1)
    assert scaler.watch(model) is scaler and scaler.watch() is scaler
    with pytest.raises(TypeError, match="trace_forward\\(\\) expects a fake module"):
        amp.trace_forward(params)


def test_a_pickled_scaler_keeps_no_model_and_still_reports(capable_fake, net):
    model, params, opt = net
    scaler = amp.GradScaler().watch(model)
    step(scaler, params, opt, [[INF], [1.0]])
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.last_overflow() is None  # reports and watched models stay behind
    step(clone, params, opt, [[1.0], [INF]])
    assert [g.name for g in clone.last_overflow().gradients] == ["param[1]"]


# -- forward tracing ---------------------------------------------------------------------
def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for _, m in model.named_modules())


@pytest.mark.parametrize("case, inputs, precision, first, samples, cause", [
    ("fp16 overflow", [1.0, 2.0], "float16", ("big", "float16"), (), "forward-float16"),
    ("NaN sample", [1.0, NAN, 3.0], "float16", ("small", "float16"), (1,), "input"),
    ("bfloat16 inf", [1.0, 1e305], "bfloat16", ("big", "bfloat16"), (), "forward-bfloat16"),
    ("float32 inf", [1.0, 1e305], None, ("big", "float32"), (), "forward-float32"),
    ("all finite", [1.0, 2.0], None, None, (), "backward"),
])
def test_tracing_names_the_first_nonfinite_module(capable_fake, case, inputs, precision, first,
                                                   samples, cause):
    capable_fake.refuse = set()  # the capable_fake computes bfloat16 too
    model = model_of(capable_fake, small=1.0, big=1e5, last=1.0)
    params = model.parameters()
    scaler = amp.GradScaler()

    def forward():
        with amp.autocast(enabled=precision is not None, dtype=precision):
            model(FakeTensor(inputs))

    assert hook_count(model) == 0
    with amp.trace_forward(model) as trace:
        # one per module, the model's own included, and the model's input check
        assert trace.active and hook_count(model) == 5
        step(scaler, params, FakeOptimizer(params), [[1.0], [INF], [1.0]], forward=forward)
    assert not trace.active and hook_count(model) == 0
    report = scaler.last_overflow()
    assert report.traced and report.cause == cause and report.bad_samples == samples
    got = report.first_nonfinite
    assert (None if got is None else (got.module, got.dtype)) == first
    # Traced models name the gradients too, without watch().
    assert [g.name for g in report.gradients] == ["big.weight"]
    # the verdict, then one read for the counts, the loss and the trace's flags together
    assert (capable_fake.syncs, capable_fake.forensic_reads) == (1, 1)


def test_the_line_says_what_to_do_about_a_float16_overflow(capable_fake):
    model = model_of(capable_fake, small=1.0, big=1e5)
    params = model.parameters()
    scaler = amp.GradScaler(init_scale=4.0)

    def forward():
        with amp.autocast(dtype="float16"):
            model(FakeTensor([1.0]))

    with amp.trace_forward(model):
        step(scaler, params, FakeOptimizer(params), [[INF], [INF]], forward=forward,
             value=INF)
    assert scaler.last_overflow().line() == (
        "unified_amp: step 1 skipped (scale 4, loss inf): inf/NaN gradients in 2 of 2"
        " parameters: big.weight (1 inf of 1), small.weight (1 inf of 1); first"
        " non-finite forward output: big (NamedModule, float16), a float16 overflow"
        " (|x| > 65504): run it in float32 with amp.keep_float32(model.big) or use"
        " bfloat16")


def test_the_fix_names_the_module_from_the_watched_model(capable_fake):
    """Traced at a submodule, watched as a whole: the pin is spelled from the watched
    model, the way the user holds it; Sequential-style indices become subscripts."""
    encoder = NamedModule(**{"0": NamedModule(scale=1.0, backend=capable_fake),
                             "layer3": NamedModule(scale=1e5, backend=capable_fake)})
    model = NamedModule(encoder=encoder, head=NamedModule(scale=1.0, backend=capable_fake))
    params = model.parameters()

    def forward():
        with amp.autocast(dtype="float16"):
            model(FakeTensor([1.0]))

    for watch, pin in ((True, "model.encoder.layer3"), (False, "model.layer3")):
        scaler = amp.GradScaler()
        if watch:
            scaler.watch(model)
        with amp.trace_forward(encoder):
            step(scaler, params, FakeOptimizer(params), [[INF], [INF], [INF]],
                 forward=forward)
        first = scaler.last_overflow().first_nonfinite
        assert (first.module, first.pin, first.fix) == (
            "layer3", pin, f"amp.keep_float32({pin})")
        assert f"run it in float32 with amp.keep_float32({pin})" in \
            str(scaler.last_overflow())
    assert pin_expression("layers.10.attn") == "model.layers[10].attn"
    assert pin_expression("") == "model"
    assert pin_expression("blocks.a-b") == "model.blocks['a-b']"


def test_tracing_reads_nothing_on_a_clean_step_and_forgets_at_update(capable_fake):
    # A trace's flags are dropped once every live scaler has passed them: collect the
    # earlier tests' scalers that wait in reference cycles (apex's, through patched
    # models), so that this test's scaler is the only one.
    gc.collect()
    model = model_of(capable_fake, small=1.0, big=2.0)
    params = model.parameters()
    scaler = amp.GradScaler()
    with amp.trace_forward(model) as trace:
        for _ in range(3):
            step(scaler, params, FakeOptimizer(params), [[1.0], [1.0]],
                 forward=lambda: model(FakeTensor([1.0, 2.0])))
            assert trace._records == []  # update() dropped this step's flags
    assert capable_fake.flags_made == 3 * 4  # input + 3 module outputs, each step
    assert capable_fake.forensic_reads == 0 and capable_fake.syncs == 3


def test_a_trace_stands_alone_without_a_scaler(capable_fake):
    model = model_of(capable_fake, small=1.0, big=1e5)
    with amp.trace_forward(model) as trace:
        with amp.autocast(dtype="float16"):
            model(FakeTensor([1.0]))
        first, samples = trace.first_nonfinite()
        assert (first.module, first.type, first.dtype, samples) == (
            "big", "NamedModule", "float16", ())
        trace.clear()
        assert trace.first_nonfinite() == (None, ())
    assert repr(trace) == "ForwardTrace(NamedModule, stopped)"


def test_the_api_reference_quotes_a_line_the_contract_tests_assert():
    import pathlib
    import re

    from ..contract.test_forensics_contract import LINES

    api = pathlib.Path(__file__).resolve().parents[2] / "docs" / "API.md"
    section = api.read_text().split("`str(report)` is one line", 1)[1]
    quoted = re.search(r"```\n(.*?)\n```", section, re.S).group(1)
    assert quoted == LINES["float16", True]
