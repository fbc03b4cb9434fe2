"""The scaler's policy inside a traced step (unified_amp/_tracing.py), on a fake backend
whose "trace" is a switch: inside one nothing is read back to the host, the calls that
need the host raise UnsupportedTraceError and change nothing, and the scale the trace
starts from is the host's. MegEngine's real trace: tests/native/test_megengine_trace.py."""

import math
import weakref

import pytest

import unified_amp as amp
from unified_amp import _registry, capabilities
from unified_amp._scale_rule import next_scale

from .fake_backend import FakeBackend, FakeOptimizer, FakeTensor, linear_loss


class FakeDeviceScale:
    """The scale "on the device": flags are never read through the backend."""

    def __init__(self, backend, scale, tracker, skipped):
        self.backend = backend
        self.scale_v, self.tracker_v, self.skipped_v = scale, tracker, skipped
        self.last, self.steps, self.writes = False, 0, 0

    def write(self, scale, tracker, skipped):
        self.writes += 1
        self.scale_v, self.tracker_v, self.skipped_v = scale, tracker, skipped

    def scale(self, y):
        return self.backend.scale(y, self.scale_v)

    def scaled_cotangents(self, ys, dys):
        return self.backend.scaled_cotangents(ys, dys, self.scale_v)

    def check(self, grads):
        return {"found": not all(math.isfinite(v) for g in grads for v in g.values)}

    def unscale_and_check(self, grads):
        for g in grads:
            g.values = [v * (1.0 / self.scale_v) for v in g.values]
        return self.check(grads)

    def step(self, optimizer, unscale, flags, args, kwargs):
        params = optimizer.param_groups[0]["params"]
        old = ([list(p.values) for p in params], dict(optimizer.state))
        result = optimizer.step(*args, **kwargs)
        if any(f["found"] for f in flags):  # the select
            for p, values in zip(params, old[0]):
                p.values = values
            optimizer.state = old[1]
        return result

    def update(self, found_host, flags, growth, backoff, interval, *, steps, count,
               new_scale):
        found = found_host or any(f["found"] for f in flags)
        self.scale_v, self.tracker_v = next_scale(self.scale_v, self.tracker_v, found,
                                                  growth, backoff, interval)
        self.skipped_v += int(found and count)
        self.last, self.steps = found, steps

    def poll(self):
        return self.steps, self.scale_v, self.tracker_v, self.skipped_v, self.last

    def read(self):
        return self.scale_v, self.tracker_v

    def load(self, scale, tracker, telemetry=None):
        self.scale_v = scale
        if tracker is not None:
            self.tracker_v = tracker
        if telemetry is not None:
            self.steps, self.skipped_v, self.last = telemetry


class TracingFake(FakeBackend, capabilities.Tracing):
    """Its "trace" is a switch: setting ``tracing`` to a mode starts one, first calling
    what ``before_traces`` registered (as the MegEngine adapter does before each traced
    call)."""

    trace_name = "fake.trace"

    def __init__(self):
        super().__init__()
        self._tracing = None  # None, "rerun" or "once"
        self.copies = []
        self.reads_in_trace = 0
        self.before = []  # weak methods

    @property
    def tracing(self):
        return self._tracing

    @tracing.setter
    def tracing(self, mode):
        if mode is not None and self._tracing is None:
            for ref in self.before:
                if ref() is not None:
                    ref()()
        self._tracing = mode

    def before_traces(self, callback):
        self.before.append(weakref.WeakMethod(callback))

    def trace_mode(self):
        return self._tracing

    def trace_refusal(self):
        return None  # no framework setting stands in the way

    def device_scale(self, optimizer, scale, tracker, skipped):
        assert optimizer is None and self.tracing is None  # made outside any trace
        self.copies.append(FakeDeviceScale(self, scale, tracker, skipped))
        return self.copies[-1]

    def flag_is_set(self, flag):
        self.reads_in_trace += self.tracing is not None
        return super().flag_is_set(flag)

    def nonfinite_counts(self, tensors):
        self.reads_in_trace += self.tracing is not None
        return super().nonfinite_counts(tensors)


@pytest.fixture
def fake():
    backend = TracingFake()
    amp.register_backend("fake", lambda: backend)
    amp.set_backend("fake")
    yield backend
    _registry._reset_for_tests()


def model():
    params = [FakeTensor([1.0, 2.0]), FakeTensor([0.5])]
    return params, FakeOptimizer(params)


def loss_of(params, overflow):
    return linear_loss(params, [[math.inf if overflow else 1.0, 0.5], [0.25]])


def torch_form(scaler, params, opt, overflow):
    gm = amp.GradManager(params)
    with gm:
        gm.backward(scaler.scale(loss_of(params, overflow)))
    scaler.step(opt)
    scaler.update()
    gm.zero_grad()


OVERFLOWS = [False, True, False, False, True, False, False, False]


def run(fake, traced_steps):
    params, opt = model()
    scaler = amp.GradScaler(init_scale=2.0**4, growth_interval=2)
    history = []
    for i, overflow in enumerate(OVERFLOWS):
        fake.tracing = "rerun" if i in traced_steps else None
        torch_form(scaler, params, opt, overflow)
        fake.tracing = None
        history.append(scaler.get_scale())
    return [p.values for p in params], history, scaler.stats()["skipped_steps"]


def test_traced_steps_read_nothing_back_and_train_as_eager_ones(fake):
    eager = run(fake, traced_steps=())
    assert fake.reads_in_trace == 0
    for traced in ([1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7], [4, 5]):
        assert run(fake, traced) == eager
        assert fake.reads_in_trace == 0  # the overflows inside were decided on the device
    assert eager[2] == 2 and min(eager[1]) < max(eager[1])


def test_the_trace_starts_from_the_hosts_current_scale(fake):
    """Eager steps write nothing to the device: the trace copy of the scale is made, or
    brought up to date, right before a trace starts, from the host's current values."""
    params, opt = model()
    scaler = amp.GradScaler(init_scale=2.0**4, growth_interval=2)
    for overflow in (True, False, False, False):
        torch_form(scaler, params, opt, overflow)
    scaler.scale_factor = 64.0
    assert fake.copies == []  # no trace has started yet
    fake.tracing = "rerun"
    (copy,) = fake.copies
    assert (copy.scale_v, copy.tracker_v, copy.skipped_v) == (64.0, 1, 1)
    torch_form(scaler, params, opt, True)
    fake.tracing = None
    assert scaler.get_scale() == 32.0 and scaler.stats()["skipped_steps"] == 2
    writes = copy.writes
    torch_form(scaler, params, opt, False)  # eager again: the scale stays on the device
    fake.tracing = "rerun"
    fake.tracing = None
    assert copy.writes == writes and scaler.get_scale() == 32.0


def _backward(scaler, params, opt):
    gm = amp.GradManager(params)
    with gm:
        scaler.backward(gm, loss_of(params, True))


def _unscale(scaler, params, opt):
    gm = amp.GradManager(params)
    with gm:
        gm.backward(scaler.scale(loss_of(params, True)))
    scaler.unscale(gm)


REFUSED = {
    "backward": (_backward, "GradScaler.backward(gm, loss)"),
    "unscale": (_unscale, "GradScaler.unscale()"),
    "get_scale": (lambda s, p, o: s.get_scale(), "GradScaler.get_scale()"),
    "scale_factor": (lambda s, p, o: s.scale_factor, "GradScaler.get_scale()"),
    "set_scale_factor": (lambda s, p, o: setattr(s, "scale_factor", 8.0),
                         "Setting GradScaler.scale_factor"),
    "state_dict": (lambda s, p, o: s.state_dict(), "GradScaler.state_dict()"),
    "load_state_dict": (lambda s, p, o: s.load_state_dict({"scale": 8.0}),
                        "GradScaler.load_state_dict()"),
    "new_scale": (lambda s, p, o: s.update(new_scale=8.0), "update(new_scale=...)"),
    "clip": (lambda s, p, o: amp.clip_grad_norm(p, 1.0), "amp.clip_grad_norm()"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_call_that_needs_the_host_raises_and_changes_nothing(fake, name):
    call, what = REFUSED[name]
    params, opt = model()
    scaler = amp.GradScaler(init_scale=2.0**4)
    before = ([list(p.values) for p in params], scaler.state_dict())
    fake.tracing = "rerun"
    with pytest.raises(amp.UnsupportedTraceError, match="inside fake.trace") as info:
        call(scaler, params, opt)
    fake.tracing = None
    assert what in str(info.value) and "changed nothing" in str(info.value)
    assert ([list(p.values) for p in params], scaler.state_dict()) == before
    assert fake.reads_in_trace == 0


def test_outside_a_trace_nothing_changes(fake):
    """The same calls eagerly: no error, and the device scale stays unused."""
    params, opt = model()
    scaler = amp.GradScaler(init_scale=2.0**4)
    _backward(scaler, params, opt)
    scaler.get_scale()
    assert scaler.adapter_view.device_scale is None


@pytest.mark.parametrize("case", ["once", "inexact-factor", "made-inside", "refused"])
def test_a_trace_the_scaler_cannot_follow_raises_before_scaling(fake, case):
    params, opt = model()
    if case == "refused":  # a framework setting the adapter says traces cannot follow
        fake.trace_refusal = lambda: "the fake's in-place mode is on."
    if case == "made-inside":
        fake.tracing = "rerun"
    scaler = amp.GradScaler(backoff_factor=0.3 if case == "inexact-factor" else 0.5)
    fake.tracing = "once" if case == "once" else "rerun"
    match = {"once": "without_host=True", "inexact-factor": "backoff_factor=0.3",
             "made-inside": "Make the GradScaler before",
             "refused": "in-place mode is on. Or trace only"}[case]
    with pytest.raises(amp.UnsupportedTraceError, match=match):
        scaler.scale(loss_of(params, False))
    fake.tracing = None
    assert scaler.adapter_view.device_scale is None


def _host(scaler):
    state = scaler.state_dict()
    return state["scale"], state["_growth_tracker"], scaler.stats()["skipped_steps"]


def test_eager_automatic_steps_write_no_copy_and_each_trace_starts_from_the_host(fake):
    """backward(gm, loss) eagerly, overflows among the steps: nothing is written to the
    device, and whenever a trace starts the copy holds the host's values."""
    params, opt = model()
    scaler = amp.GradScaler(init_scale=2.0**4, growth_interval=2)
    gm = amp.GradManager(params)
    for i, overflow in enumerate(OVERFLOWS):
        with gm:
            scaler.backward(gm, loss_of(params, overflow))
        opt.step()
        gm.zero_grad()
        writes = sum(c.writes for c in fake.copies)
        fake.tracing = "rerun"  # a trace starts (and ends at once)
        fake.tracing = None
        copy = fake.copies[-1]
        assert (copy.scale_v, copy.tracker_v, copy.skipped_v) == _host(scaler)
        assert copy.writes <= writes + 1 and len(fake.copies) == 1
    assert scaler.stats()["skipped_steps"] == 2


def test_a_backward_that_fails_part_way_leaves_the_hosts_values_for_the_next_trace(fake):
    params, opt = model()
    scaler = amp.GradScaler(init_scale=2.0**4, growth_interval=2)
    gm = amp.GradManager(params)
    with gm:
        scaler.backward(gm, loss_of(params, False))
    gm.zero_grad()
    before = _host(scaler)

    def failing(ys, dys):
        raise RuntimeError("the framework's backward failed")

    gm.backward = failing
    with pytest.raises(RuntimeError, match="backward failed"):
        with gm:
            scaler.backward(gm, loss_of(params, False))
    assert _host(scaler) == before
    fake.tracing = "rerun"
    fake.tracing = None
    copy = fake.copies[-1]
    assert (copy.scale_v, copy.tracker_v, copy.skipped_v) == before


def test_traced_steps_after_eager_automatic_ones_train_as_eager_ones(fake):
    """Automatic-mode steps eagerly (an overflow among them, nothing written to the device),
    then traced steps in torch.amp's form: the same weights and scales as all eager."""
    def steps(traced_from):
        params, opt = model()
        scaler = amp.GradScaler(init_scale=2.0**4, growth_interval=2)
        gm = amp.GradManager(params)
        history = []
        for i, overflow in enumerate(OVERFLOWS):
            if i < traced_from:
                with gm:
                    scaler.backward(gm, loss_of(params, overflow))
                opt.step()
                gm.zero_grad()
            else:
                fake.tracing = "rerun"
                torch_form(scaler, params, opt, overflow)
                fake.tracing = None
            history.append(scaler.get_scale())
        return [p.values for p in params], history, scaler.stats()["skipped_steps"]

    eager = steps(traced_from=len(OVERFLOWS))
    for start in (2, 3, 5):
        assert steps(traced_from=start) == eager
    assert fake.reads_in_trace == 0
