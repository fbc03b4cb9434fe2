"""The required core and the optional capabilities of an adapter.

The scaler, autocast and GradManager tests run on ``FakeBackend``, which implements the
required core and nothing more; these check what happens at the edge: a feature that
needs a capability the adapter lacks says so, naming the backend, the capability and
what is missing, before it changes anything; a feature that copes without one runs; an
adapter that lacks part of the required core is refused when it is loaded.
"""

import math
import warnings
from pathlib import Path

import pytest

import unified_amp as amp
from unified_amp import _registry, capabilities, interface

from .fake_backend import (CapableFakeBackend, FakeBackend, FakeModule, FakeOptimizer,
                           FakeTensor, NamedModule, linear_loss)


def test_the_required_core_is_small():
    """What a new backend implements: the core's methods and the Tape's (its own
    GradManager recording), 30 at most (docs/DESIGN.md gives the count)."""
    required = interface.missing(object(), interface.Backend)
    tape = interface.missing(object(), interface.Tape)
    assert "name" in required and "unscale_and_check" in required
    assert not set(required) & set(interface.missing(object(), capabilities.OptLevelCasting))
    assert len(required) - 1 + len(tape) <= 30  # (name is an attribute)
    design = (Path(__file__).parents[2] / "docs" / "DESIGN.md").read_text()
    count = len(required) - 1 + len(tape)
    assert f"`unified_amp/interface.py`: {count} methods" in design  # the count it gives


def test_the_fake_provides_the_core_and_no_capability(fake):
    assert interface.missing(fake, interface.Backend) == []
    for protocol in capabilities._OPTIONAL:
        assert capabilities.capability(fake, protocol) is None, protocol
    capable = CapableFakeBackend()
    assert capabilities.capability(capable, capabilities.OptLevelCasting) is capable
    assert capabilities.capability(capable, capabilities.ForensicsProbes) is capable


def test_initialize_without_opt_levels_names_the_backend_and_capability(fake):
    params = [FakeTensor([1.0, 2.0])]
    model, opt = FakeModule(params, backend=fake), FakeOptimizer(params)
    with pytest.raises(amp.MissingCapabilityError) as info:
        amp.initialize(model, opt, opt_level="O2")
    message = str(info.value)
    assert "amp.initialize needs the OptLevelCasting capability" in message
    assert "'fake' backend" in message and "FakeBackend" in message
    assert "cast_module" in message and "master_copy" in message
    assert isinstance(info.value, NotImplementedError)
    assert params[0].dtype == "float32" and "forward" not in vars(model)  # unchanged
    assert opt.param_groups[0]["params"] == params
    amp.initialize(model, opt, opt_level="O2", enabled=False)  # needs nothing


def test_tracing_and_watching_without_probes_say_so(fake):
    model = NamedModule(encoder=NamedModule(scale=2.0, backend=fake))
    with pytest.raises(amp.MissingCapabilityError, match=r"amp\.trace_forward needs the"
                                                         r" ForensicsProbes capability"):
        amp.trace_forward(model)
    scaler = amp.GradScaler()
    with pytest.raises(amp.MissingCapabilityError, match=r"GradScaler\.watch\(model\)"
                                                         r" needs the ForensicsProbes"):
        scaler.watch(model)
    scaler.watch(warn_after=2)  # the warning's settings need no probes


def test_a_scaler_without_probes_skips_overflows_without_reports_but_warns(fake):
    p = FakeTensor([1.0])
    opt = FakeOptimizer([p])
    scaler = amp.GradScaler(init_scale=4.0).watch(warn_after=2)
    gm = amp.GradManager([p])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with gm:
                gm.backward(scaler.scale(linear_loss([p], [[math.inf]])))
            assert scaler.step(opt) is None  # skipped
            scaler.update()
            gm.zero_grad()
    assert p.values == [1.0] and opt.steps == 0
    assert scaler.last_overflow() is None and scaler.stats()["overflows"] == []
    assert scaler.stats()["skipped_steps"] == 2 and scaler.get_scale() == 1.0
    assert [type(w.message) for w in caught] == [amp.OverflowWarning]


def test_keep_float32_of_low_precision_weights_needs_opt_levels(fake):
    low = FakeModule([FakeTensor([1.0], "float16")], backend=fake)
    with pytest.raises(amp.MissingCapabilityError, match=r"amp\.keep_float32 of a module"
                                                         r" with float16 weights"):
        amp.keep_float32(low)
    plain = FakeModule([FakeTensor([1.0])], backend=fake)
    assert amp.keep_float32(plain) is plain  # float32 weights: the core is enough


class _WithoutCheck(FakeBackend):
    unscale_and_check = None  # type: ignore[assignment]


def test_an_adapter_without_part_of_the_core_is_refused_when_loaded():
    amp.register_backend("partial", _WithoutCheck)
    try:
        amp.set_backend("partial")
        with pytest.raises(amp.MissingCapabilityError) as info:
            amp.get_backend()
        assert "'partial' backend's adapter _WithoutCheck" in str(info.value)
        assert "has no unscale_and_check." in str(info.value)
    finally:
        _registry._reset_for_tests()


def test_capability_takes_only_the_optional_protocols(fake):
    with pytest.raises(TypeError, match="one of the optional capabilities"):
        capabilities.capability(fake, interface.LossScaling)
