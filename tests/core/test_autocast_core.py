"""autocast's arguments, nesting and errors, on the fake backend."""

import pytest

import unified_amp as amp


def state(fake):
    return fake.autocast_state[-1]


def test_context_manager_sets_and_restores(fake):
    assert not amp.is_autocast_enabled()
    with amp.autocast(dtype="float16"):
        assert state(fake) == (True, "float16")
        assert amp.is_autocast_enabled()
    assert state(fake) == (False, None)


def test_nested_disabled_block_turns_autocast_off_then_restores(fake):
    with amp.autocast(dtype="float16"):
        with amp.autocast(enabled=False):
            assert not amp.is_autocast_enabled()
        assert state(fake) == (True, "float16")
    assert not amp.is_autocast_enabled()


def test_decorator_and_reentrant_use_of_one_instance(fake):
    ctx = amp.autocast(dtype="float16")

    @ctx
    def depth(n):
        assert amp.is_autocast_enabled()
        return len(fake.autocast_state) if n == 0 else depth(n - 1)

    assert depth(2) == 4  # the base state plus three nested entries of the same instance
    assert len(fake.autocast_state) == 1


@pytest.mark.parametrize("spelling,expected", [
    ("float16", "float16"), ("bfloat16", "bfloat16"), ("fp16", "float16"),
    ("half", "float16"), ("bf16", "bfloat16"), (None, None)])
def test_dtype_spellings(spelling, expected):
    assert amp.autocast(dtype=spelling).dtype == expected


@pytest.mark.parametrize("bad", ["float32", "int8", "float64", "", "FP16", "float16 ",
                                 "Half"])
def test_invalid_dtype_string_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError) as info:
        amp.autocast(dtype=bad)
    assert repr(bad) in str(info.value)
    assert "'float16', 'half', 'fp16', 'bfloat16', 'bf16'" in str(info.value)


def test_torch_call_form(fake):
    ctx = amp.autocast("cuda", dtype="float16", enabled=False)
    assert (ctx.device, ctx.dtype, ctx.enabled) == ("cuda", "float16", False)
    ctx = amp.autocast("cpu", "bfloat16")
    assert (ctx.device, ctx.dtype, ctx.enabled) == ("cpu", "bfloat16", True)


def test_megengine_call_form():
    ctx = amp.autocast(True, low_prec_dtype="float16", high_prec_dtype="float32")
    assert (ctx.enabled, ctx.dtype) == (True, "float16")
    with pytest.raises(ValueError, match="high_prec_dtype"):
        amp.autocast(True, high_prec_dtype="float16")
    with pytest.raises(TypeError, match="low_prec_dtype"):
        amp.autocast(dtype="float16", low_prec_dtype="float16")


def test_bad_enabled_and_device():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        amp.autocast(enabled="yes")
    with pytest.raises(ValueError, match="'tpu'"):
        amp.autocast(device="tpu")
    assert amp.autocast(device="gpu0").device == "cuda"


def test_unsupported_precision_raises_on_entry_and_leaves_state_alone(fake):
    ctx = amp.autocast(dtype="bfloat16")  # constructing is fine
    with pytest.raises(amp.UnsupportedPrecisionError):
        with ctx:
            pytest.fail("the block must not run")
    assert fake.autocast_state == [(False, None)]
    # A disabled block never computes in that dtype, so it is allowed.
    with amp.autocast(enabled=False, dtype="bfloat16"):
        assert not amp.is_autocast_enabled()


def test_exception_inside_block_still_restores(fake):
    with pytest.raises(KeyError):
        with amp.autocast(dtype="float16"):
            raise KeyError("boom")
    assert fake.autocast_state == [(False, None)]


def test_signatures_are_explicit():
    import inspect

    assert list(inspect.signature(amp.autocast).parameters)[:4] == [
        "enabled", "dtype", "device", "contract"]
    assert list(inspect.signature(amp.GradScaler).parameters) == [
        "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled",
        "device", "process_group"]


def test_call_form_errors_name_the_class_and_the_forms():
    with pytest.raises(TypeError, match=r"autocast\(\): .*unexpected keyword.*call forms"):
        amp.autocast(dtpye="float16")
    with pytest.raises(TypeError, match=r"GradScaler\(\): .*call forms"):
        amp.GradScaler(init_scael=2.0)


def test_a_dtype_in_the_device_slot_gets_a_hint():
    with pytest.raises(ValueError, match=r"'float16' is a dtype.*autocast\(dtype='float16'\)"):
        amp.autocast("float16")


def test_torch_keyword_spellings_are_accepted(fake):
    ctx = amp.autocast(device_type="cpu", dtype="bfloat16", enabled=True, cache_enabled=False)
    assert (ctx.enabled, ctx.dtype, ctx.device, ctx.contract) == (True, "bfloat16", "cpu", True)
    fake.refuse = set()
    with amp.autocast(device_type="cpu", dtype="bfloat16", contract=False):
        assert amp.is_autocast_enabled()
