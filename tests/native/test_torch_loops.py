"""Loops written the way torch.amp users write them, run twice: once with
torch.amp.GradScaler, once with unified_amp.GradScaler. Only the class differs; weights,
optimizer state, scale history and everything the loop observes (gradients, norms,
warnings, errors) must come out the same, byte for byte.

Each loop also asserts that it exercised what it is about (an overflow reached the
clipping, a step was skipped, ...), so that equal results mean something.
"""

import copy
import math
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import unified_amp

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler
INF = float("inf")


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).to(dtype)


def data(step, micro=0, overflow=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(8, 8, generator=g).to(dtype)
    y = torch.randint(0, 4, (8,), generator=g)
    if overflow:
        x[0, 0] = INF
    return x, y


def scaled_backward(scaler, model, step, overflow=False, micro=0, divide=1):
    """The torch.amp recipe's forward (bfloat16 autocast) and scaled backward."""
    x, y = data(step, micro, overflow=overflow)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y) / divide
    scaler.scale(loss).backward()


def state_bytes(modules, optimizers):
    """Every weight and every optimizer-state entry, as bytes."""
    weights = [p.detach().numpy().tobytes() for m in modules for p in m.parameters()]
    states = []
    for opt in optimizers:
        for s in opt.state.values():
            for key, v in sorted(s.items()):
                states.append((key, v.detach().numpy().tobytes()
                               if isinstance(v, torch.Tensor) else repr(v)))
    return weights, states


def skipped_some(history):
    return any(b < a for a, b in zip(history, history[1:]))


# -- clipping and .grad between unscale_ and step ----------------------------------------
def clip_loop(GradScaler, error_if_nonfinite=False, overflow_at=(2, 5)):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    seen = []
    for step in range(8):
        scaled_backward(scaler, model, step, overflow=step in overflow_at)
        scaler.unscale_(opt)
        seen.append([p.grad is None for p in model.parameters()])
        try:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0,
                                                  error_if_nonfinite=error_if_nonfinite)
            seen.append(repr(float(norm)))
        except RuntimeError as exc:  # what Lightning Fabric's clip_gradients does
            seen.append(("raised", "non-finite" in str(exc)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append(scaler.get_scale())
    return state_bytes([model], [opt]), seen


@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_clipping_after_unscale_sees_the_overflow(error_if_nonfinite):
    native, ours = clip_loop(NATIVE, error_if_nonfinite), clip_loop(OURS, error_if_nonfinite)
    assert native == ours
    seen = native[1]
    assert not any(any(flags) for flags in seen[0::3])  # .grad is never None
    norms = seen[1::3]
    if error_if_nonfinite:
        assert norms.count(("raised", True)) == 2
    else:
        assert sum(n in ("'inf'", "'nan'", "inf", "nan") for n in norms) == 2, norms


def touch_grads_loop(GradScaler, overflow_at=(1, 4)):
    """Gradient surgery between unscale_ and step (a clamp written through .grad)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    history = []
    for step in range(7):
        scaled_backward(scaler, model, step, overflow=step in overflow_at)
        scaler.unscale_(opt)
        for p in model.parameters():
            p.grad.copy_(p.grad.clamp(-0.05, 0.05))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(scaler.get_scale())
    return state_bytes([model], [opt]), history


def test_gradients_touched_between_unscale_and_step():
    native, ours = touch_grads_loop(NATIVE), touch_grads_loop(OURS)
    assert native == ours
    assert skipped_some(native[1])


def invalidated_loop(GradScaler, make_opt):
    """A clean unscale_, then every gradient overwritten with inf/NaN before step():
    the verdict was taken at unscale_, so the step runs and the weights become
    non-finite -- with both scalers."""
    model = mlp()
    opt = make_opt(model.parameters())
    scaler = GradScaler("cpu", init_scale=128.0)
    for step in range(3):
        opt.zero_grad()
        scaled_backward(scaler, model, step)
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.copy_(torch.tensor(INF if j % 2 else math.nan))
        scaler.step(opt)
        scaler.update()
    return state_bytes([model], [opt]), [bool(torch.isfinite(p).all())
                                          for p in model.parameters()]


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
@pytest.mark.parametrize("ctor", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
def test_gradients_invalidated_between_unscale_and_step(ctor, kind):
    kwargs = {"plain": {"foreach": False}, "foreach": {"foreach": True},
              "fused": {"fused": True}}[kind]

    def make_opt(ps):
        return ctor(ps, lr=1e-3, **kwargs)

    native, ours = invalidated_loop(NATIVE, make_opt), invalidated_loop(OURS, make_opt)
    assert native == ours
    assert not any(native[1])


# -- gradient penalty, accumulation, several models ----------------------------------------
def penalty_loop(GradScaler, overflow_at=(3,)):
    """The gradient-penalty recipe from torch.amp's documentation."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    history = []
    for step in range(6):
        x, y = data(step, overflow=step in overflow_at)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()),
                                           create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grads = [g * inv_scale for g in scaled_grads]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            loss = loss + 0.1 * penalty
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(scaler.get_scale())
    return state_bytes([model], [opt]), history


def test_gradient_penalty_with_create_graph():
    native, ours = penalty_loop(NATIVE), penalty_loop(OURS)
    assert native == ours
    assert skipped_some(native[1])


def accumulation_loop(GradScaler, micro=3, overflow_at=((2, 1),)):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    history = []
    for step in range(6):
        for m in range(micro):
            scaled_backward(scaler, model, step, (step, m) in overflow_at, m, divide=micro)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(scaler.get_scale())
    return state_bytes([model], [opt]), history


def test_accumulation_over_several_backward_passes():
    native, ours = accumulation_loop(NATIVE), accumulation_loop(OURS)
    assert native == ours
    assert skipped_some(native[1])


def multiple_loop(GradScaler, poison_at=(2,)):
    """torch.amp's 'several models, losses and optimizers' recipe; at some steps one
    of model1's gradients is poisoned, so opt1 skips while opt0 steps."""
    model0, model1 = mlp(0), mlp(1)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05)
    opt1 = torch.optim.Adam(model1.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    history = []
    for step in range(6):
        x, _ = data(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out0, out1 = model0(x), model1(x)
            loss0 = (2 * out0 + 3 * out1).float().mean()
            loss1 = (3 * out0 - 5 * out1).float().mean()
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if step in poison_at:
            model1[2].weight.grad[0, 0] = INF
        scaler.unscale_(opt0)  # optional in the recipe: here, for clipping
        torch.nn.utils.clip_grad_norm_(model0.parameters(), 1.0)
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
        opt0.zero_grad()
        opt1.zero_grad()
        history.append(scaler.get_scale())
    return state_bytes([model0, model1], [opt0, opt1]), history


def test_several_models_losses_and_optimizers_one_scaler():
    native, ours = multiple_loop(NATIVE), multiple_loop(OURS)
    assert native == ours
    assert skipped_some(native[1])


# -- sparse and float64 gradients ----------------------------------------------------------
def sparse_loop(GradScaler, make_sparse_opt, overflow_at=(2,)):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 8, sparse=True)
    head = torch.nn.Linear(8, 4)
    opt_sparse = make_sparse_opt(emb.parameters())
    opt_dense = torch.optim.Adam(head.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    history = []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        idx, y = torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 4, (8,), generator=g)
        h = emb(idx).mean(1)
        if step in overflow_at:
            h = h * torch.tensor([INF] + [1.0] * 7).unsqueeze(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(head(h), y)
        scaler.scale(loss).backward()
        assert emb.weight.grad.is_sparse
        scaler.step(opt_sparse)
        scaler.step(opt_dense)
        scaler.update()
        opt_sparse.zero_grad()
        opt_dense.zero_grad()
        history.append(scaler.get_scale())
    return state_bytes([emb, head], [opt_sparse, opt_dense]), history


@pytest.mark.parametrize("make_sparse_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.SparseAdam(list(ps), lr=1e-2),
], ids=["sgd", "sparse-adam"])
def test_sparse_gradients(make_sparse_opt):
    native, ours = sparse_loop(NATIVE, make_sparse_opt), sparse_loop(OURS, make_sparse_opt)
    assert native == ours
    assert skipped_some(native[1])


def float64_loop(GradScaler, overflow_at=(1, 2)):
    model = mlp(dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    history = []
    for step in range(7):
        x, y = data(step, overflow=step in overflow_at, dtype=torch.float64)
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(scaler.get_scale())
    return state_bytes([model], [opt]), history


def test_float64_parameters():
    native, ours = float64_loop(NATIVE), float64_loop(OURS)
    assert native == ours
    assert skipped_some(native[1])


# -- fused and foreach optimizers, a preset grad_scale -------------------------------------
OPTIMIZERS = {
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}


def preset_loop(GradScaler, make_opt, preset, unscale, overflow_at=(2, 5)):
    model = mlp()
    opt = make_opt(model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    seen = []
    for step in range(7):
        scaled_backward(scaler, model, step, overflow=step in overflow_at)
        if unscale:
            scaler.unscale_(opt)
        if preset is not None:
            opt.grad_scale = torch.tensor(preset)  # read by fused kernels only
        scaler.step(opt)
        seen.append(hasattr(opt, "grad_scale"))  # torch.amp removes it after the step
        scaler.update()
        opt.zero_grad()
        seen.append(scaler.get_scale())
    return state_bytes([model], [opt]), seen


# A preset grad_scale is read by fused kernels; Adam/SGD without fused=True refuse one.
CASES = [(name, preset) for name in sorted(OPTIMIZERS)
         for preset in ([None, 3.0] if name.endswith("fused") else [None])]


@pytest.mark.parametrize("unscale", [False, True], ids=["step-only", "unscale_-first"])
@pytest.mark.parametrize("name,preset", CASES,
                         ids=[f"{n}-{'preset' if p else 'no-preset'}" for n, p in CASES])
def test_fused_and_foreach_optimizers_with_and_without_a_preset_grad_scale(name, preset,
                                                                            unscale):
    native = preset_loop(NATIVE, OPTIMIZERS[name], preset, unscale)
    ours = preset_loop(OURS, OPTIMIZERS[name], preset, unscale)
    assert native[1] == ours[1]
    assert native[0] == ours[0]
    assert skipped_some(native[1][1::2])


# -- the older step(grad_scaler=...) contract ----------------------------------------------
class SelfUnscalingSGD(torch.optim.Optimizer):
    """An optimizer of torch's older contract: it asks the scaler for the scale and the
    inf check and unscales inside its own step."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        inv = 1.0
        if grad_scaler is not None:
            found = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
            if found:
                return "skipped"
            inv = 1.0 / grad_scaler._get_scale_async().item()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * inv)
        return "stepped"


class ReadsGradScale(torch.optim.Optimizer):
    """An optimizer of the newer contract that records what the scaler hands it."""

    def __init__(self, params, log):
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.log = log

    def step(self, closure=None):
        self.log.append((None if self.grad_scale is None else float(self.grad_scale),
                         float(self.found_inf)))


def grad_scaler_kwarg_loop(GradScaler, overflow_at=(1,)):
    model = mlp()
    log = []
    first, second = SelfUnscalingSGD(model.parameters(), 0.05), ReadsGradScale(
        model.parameters(), log)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    results = []
    for step in range(4):
        scaled_backward(scaler, model, step, overflow=step in overflow_at)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(scaler.step(first))
        results.append([w.category.__name__ for w in caught])
        scaler.step(second)
        scaler.update()
        first.zero_grad()
        results.append(scaler.get_scale())
    return state_bytes([model], []), results, log


def test_optimizers_that_take_the_scaler_itself():
    native, ours = grad_scaler_kwarg_loop(NATIVE), grad_scaler_kwarg_loop(OURS)
    assert native == ours
    results, log = native[1], native[2]
    assert "skipped" in results and ["FutureWarning"] in results
    assert all(scale is not None for scale, _ in log)  # the second one still gets a scale


# -- checkpoints, pickling ------------------------------------------------------------------
def pickle_loop(GradScaler, overflow_at=(1, 4)):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    history = []
    for step in range(7):
        scaled_backward(scaler, model, step, overflow=step in overflow_at)
        scaler.step(opt)
        try:
            pickle.dumps(scaler)
            history.append("pickled mid-iteration")
        except Exception:  # noqa: BLE001 - the two raise different types; both refuse
            history.append("refused mid-iteration")
        scaler.update()
        opt.zero_grad()
        scaler = pickle.loads(pickle.dumps(scaler))  # between iterations: allowed
        scaler = copy.deepcopy(scaler)
        history.append(scaler.get_scale())
    return state_bytes([model], [opt]), history


def test_pickling_between_iterations():
    native, ours = pickle_loop(NATIVE), pickle_loop(OURS)
    assert native == ours
    assert native[1][0] == "refused mid-iteration"
    assert skipped_some(native[1][1::2])


# -- what runners and user code read -----------------------------------------------------
def test_runners_that_check_isinstance_turn_amp_on():
    """A runner in the style of Enchanter's: AMP only when its scaler slot holds torch's
    scaler class."""

    class Runner:
        def __init__(self, model, optimizer, scaler=None):
            self.model, self.optimizer, self.scaler = model, optimizer, scaler

        def train_step(self, x, y):
            amp_on = isinstance(self.scaler, torch.amp.GradScaler)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp_on):
                loss = F.cross_entropy(self.model(x), y)
            if amp_on:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()
            self.optimizer.zero_grad()
            return amp_on

    def run(GradScaler):
        model = mlp()
        runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.05),
                        GradScaler("cpu", init_scale=2.0**8))
        used = [runner.train_step(*data(step, overflow=step == 2)) for step in range(4)]
        return used, state_bytes([model], [])

    native, ours = run(NATIVE), run(OURS)
    assert native == ours and native[0] == [True] * 4


def test_isinstance_of_both_torch_scaler_classes():
    assert isinstance(OURS(), unified_amp.GradScaler)
    assert isinstance(OURS("cpu"), torch.amp.GradScaler)
    assert not isinstance(OURS("cpu"), torch.cuda.amp.GradScaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available. Disabling." on CPU
        cuda_scaler = OURS("cuda")
        native_cuda = torch.cuda.amp.GradScaler() if not torch.cuda.is_available() else None
    assert isinstance(cuda_scaler, torch.cuda.amp.GradScaler)
    assert isinstance(cuda_scaler, unified_amp.GradScaler)
    if native_cuda is not None:
        assert cuda_scaler.is_enabled() == native_cuda.is_enabled() is False
    assert isinstance(pickle.loads(pickle.dumps(OURS("cpu"))), torch.amp.GradScaler)


def test_private_attributes_that_code_in_the_wild_reads():
    """_scale, _growth_tracker, _get_scale_async(), _found_inf_per_device() (the usual
    'was this step skipped?' idiom) and _per_optimizer_states' stages, at each point of
    an iteration, the same values as torch.amp's."""

    def run(GradScaler):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        seen = []
        for step in range(5):
            scaled_backward(scaler, model, step, overflow=step in (1, 3))
            seen.append(float(scaler._scale))
            scaler.unscale_(opt)
            seen.append(scaler._per_optimizer_states[id(opt)]["stage"].name)
            scaler.step(opt)
            seen.append(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
            seen.append(scaler._per_optimizer_states[id(opt)]["stage"].name)
            scaler.update()
            opt.zero_grad()
            seen.append((float(scaler._get_scale_async()), int(scaler._growth_tracker),
                         scaler._get_growth_tracker()))
        return seen

    native, ours = run(NATIVE), run(OURS)
    assert native == ours
    assert 1.0 in native  # a skipped step was visible through _found_inf_per_device


def test_isfinite_norm_idiom_detects_the_overflow():
    """Code that detects an overflow from the clipped norm (and skips on its own)."""

    def run(GradScaler):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = GradScaler("cpu", init_scale=2.0**8)
        flags = []
        for step in range(3):
            scaled_backward(scaler, model, step, overflow=step == 1)
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            flags.append(bool(torch.isfinite(norm)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return flags

    assert run(NATIVE) == run(OURS) == [True, False, True]


def test_forgetting_to_scale_raises_instead_of_shrinking_gradients():
    """torch.amp raises when scale() was never called; we raise whenever nothing was
    scaled since the last update(), and when backward ran on the unscaled loss."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for GradScaler in (NATIVE, OURS):
        scaler = GradScaler("cpu")
        F.cross_entropy(model(data(0)[0]), data(0)[1]).backward()
        with pytest.raises((AssertionError, RuntimeError),
                           match="did not use scaler.scale\\(loss or outputs\\)"):
            scaler.step(opt)
        opt.zero_grad()
    scaler = OURS("cpu")
    weights = state_bytes([model], [])
    for wrong in ("unscaled-loss", "never-scaled-this-iteration"):
        x, y = data(1)
        loss = F.cross_entropy(model(x), y)
        if wrong == "unscaled-loss":
            scaler.scale(loss)  # computed, but backward runs on the loss itself
        loss.backward()
        with pytest.raises(RuntimeError, match="scale"):
            scaler.step(opt)
        with pytest.raises(RuntimeError, match="scale"):
            scaler.unscale_(opt)
        opt.zero_grad()
        x, y = data(2)
        scaler.scale(F.cross_entropy(model(x), y)).backward()  # a proper iteration
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert state_bytes([model], []) != weights  # the proper iterations did step


def test_the_backward_watch_needs_no_hook_and_keeps_its_errors():
    """The scaler learns whether a backward went through a scale() output only when it
    asks, at the step (autograd frees what the output's node saved): a backward that
    keeps the graph is no false alarm, and a backward through an output scaled before an
    unscale_() but run after it is still found to have mixed scaled into unscaled
    gradients."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = OURS("cpu", init_scale=4.0)
    scaler.scale((w * 2).sum()).backward(retain_graph=True)
    scaler.step(opt)  # no "no backward pass has gone through" error
    scaler.update()
    opt.zero_grad()
    scaler.scale((w * 2).sum()).backward()  # micro-batch 1
    later = scaler.scale((w * 3).sum())  # micro-batch 2, scaled before the unscale
    scaler.unscale_(opt)
    later.backward()  # adds scaled gradients into unscaled ones
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="then a backward pass added scaled gradients"):
        scaler.step(opt)
    assert torch.equal(w.detach(), before)


def test_automatic_mode_then_scaler_step_unscales_once():
    """scaler.backward(gm, loss) unscales and updates; a torch user's habitual
    scaler.step(opt) afterwards must neither unscale again nor step an overflow."""
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    scaler = OURS(init_scale=2.0**8)
    gm = unified_amp.GradManager(model.parameters())
    for step in range(4):
        x, y = data(step, overflow=step == 2)
        before = state_bytes([model], [])
        with gm:
            scaler.backward(gm, F.cross_entropy(model(x), y))
        scaler.step(opt)
        assert scaler.stats()["last_step_skipped"] == (step == 2)
        assert (state_bytes([model], []) == before) == (step == 2)
        gm.zero_grad()
        if step != 2:  # the same step in fp32 with no scaler at all
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        np.testing.assert_allclose(model[0].weight.detach().numpy(),
                                   reference[0].weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    assert scaler.stats()["skipped_steps"] == 1


def test_unscaling_after_every_micro_batch_raises():
    """torch.amp refuses a second unscale_ of an optimizer before update(); the same
    mistake through megengine.amp's form (unscale of a GradManager or parameter list)
    would mix unscaled and scaled gradients, so it raises too, and changes nothing."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for GradScaler, call in ((NATIVE, "unscale_"), (OURS, "unscale_"), (OURS, "unscale")):
        scaler = GradScaler("cpu", init_scale=4.0)
        scaled_backward(scaler, model, 0, micro=0, divide=2)
        target = opt if call == "unscale_" else list(model.parameters())
        getattr(scaler, call)(target)
        scaled_backward(scaler, model, 0, micro=1, divide=2)
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="already been called on this optimizer"
                                               "|mix unscaled and scaled values"):
            getattr(scaler, call)(target)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        opt.zero_grad()


def test_zero_grad_in_place_between_iterations():
    def run(GradScaler):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        history = []
        for step in range(6):
            scaled_backward(scaler, model, step, overflow=step == 2)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
            history.append(scaler.get_scale())
        return state_bytes([model], [opt]), history

    native, ours = run(NATIVE), run(OURS)
    assert native == ours and skipped_some(native[1])
