"""Where torch.amp.GradScaler raises AssertionError, ours raises an error that is also one
(``amp.ScalerStateError`` / ``amp.ScalerArgumentError``), so ``except AssertionError``
written against torch.amp keeps catching it. Each case runs on torch.amp first, to prove
that torch really asserts there, then on ours."""

import pickle

import pytest
import torch

import unified_amp as amp

NATIVE, OURS = torch.amp.GradScaler, amp.GradScaler


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model):
    return model(torch.ones(4, 3)).sum()


def unscale_before_scale(cls):
    model, opt = _model_and_opt()
    scaler = cls("cpu")
    _loss(model).backward()
    scaler.unscale_(opt)


def step_before_scale(cls):
    model, opt = _model_and_opt()
    scaler = cls("cpu")
    _loss(model).backward()
    scaler.step(opt)


def update_before_scale(cls):
    cls("cpu").update()


def step_with_no_inf_checks(cls):
    model, opt = _model_and_opt()
    other = torch.nn.Linear(3, 1)
    scaler = cls("cpu")
    scaler.scale(other(torch.ones(4, 3)).sum()).backward()  # nothing reaches opt's params
    scaler.step(opt)


def update_with_nothing_checked(cls):
    model, _ = _model_and_opt()
    scaler = cls("cpu")
    scaler.scale(_loss(model)).backward()
    scaler.update()


def growth_factor_one(cls):
    cls("cpu", growth_factor=1.0)


def backoff_factor_one(cls):
    cls("cpu", backoff_factor=1.0)


def pickle_mid_iteration(cls):
    model, opt = _model_and_opt()
    scaler = cls("cpu")
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    pickle.dumps(scaler)


def new_scale_of_two_elements(cls):
    model, opt = _model_and_opt()
    scaler = cls("cpu")
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update(new_scale=torch.ones(2))


CASES = [unscale_before_scale, step_before_scale, update_before_scale,
         step_with_no_inf_checks, update_with_nothing_checked, growth_factor_one,
         backoff_factor_one, pickle_mid_iteration, new_scale_of_two_elements]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_ours_is_an_assertion_error_where_torch_amp_asserts(case):
    with pytest.raises(AssertionError) as native:
        case(NATIVE)
    assert type(native.value) is AssertionError  # the premise: torch.amp asserts here
    with pytest.raises(AssertionError) as ours:
        case(OURS)
    assert isinstance(ours.value, amp.UnifiedAmpError), ours.value
    # and still the type our docs promised before (RuntimeError / ValueError)
    assert isinstance(ours.value, (RuntimeError, ValueError)), type(ours.value)
    assert str(ours.value), "the message names what went wrong"
