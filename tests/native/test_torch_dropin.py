"""unified_amp.GradScaler in an unchanged torch.amp loop gives torch.amp's weights and
scale history bit for bit. Only the GradScaler class differs between the two runs."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import unified_amp

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler


def data(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(8, 8, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y


def torch_amp_loop(GradScaler, steps=14, overflow_at=((3, 1), (8, 0)), ckpt_at=6,
                   dtype=torch.float16):
    """A typical torch.amp loop: two optimizers, 2-step accumulation, unscale_ + clipping,
    a planted overflow, and a scaler checkpoint round trip."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    head = torch.nn.Linear(8, 4)
    opt_body = torch.optim.SGD(body.parameters(), lr=0.05, momentum=0.9)
    opt_head = torch.optim.Adam(head.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    history = []
    for step in range(steps):
        for micro in range(2):
            x, y = data(step, micro)
            if (step, micro) in overflow_at:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(head(body(x)), y) / 2
            scaler.scale(loss).backward()
        scaler.unscale_(opt_body)
        torch.nn.utils.clip_grad_norm_(body.parameters(), max_norm=0.5)
        scaler.step(opt_body)
        scaler.step(opt_head)
        scaler.update()
        opt_body.zero_grad()
        opt_head.zero_grad()
        history.append(scaler.get_scale())
        if step == ckpt_at:
            state = copy.deepcopy(scaler.state_dict())
            scaler = GradScaler("cpu")
            scaler.load_state_dict(state)
    weights = [p.detach().numpy().tobytes() for p in [*body.parameters(), *head.parameters()]]
    states = [np.asarray(v).tobytes() for opt in (opt_body, opt_head)
              for s in opt.state.values() for _, v in sorted(s.items())]
    return weights, states, history



def assert_backoff_and_growth(history):
    """The loop did exercise both rules, so equal histories mean something."""
    steps = list(zip(history, history[1:]))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps), history


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_same_weights_optimizer_state_and_scale_history(dtype):
    native = torch_amp_loop(NATIVE, dtype=dtype)
    ours = torch_amp_loop(OURS, dtype=dtype)
    assert native[2] == ours[2]
    assert native[0] == ours[0]
    assert native[1] == ours[1]
    assert_backoff_and_growth(native[2])


def test_frequent_overflows_and_default_arguments():
    every_other = tuple((s, 0) for s in range(0, 14, 2))
    native = torch_amp_loop(NATIVE, overflow_at=every_other)
    ours = torch_amp_loop(OURS, overflow_at=every_other)
    assert native == ours


def test_scale_of_a_list_and_state_dict_match():
    a, b = NATIVE("cpu", init_scale=3.0), OURS("cpu", init_scale=3.0)
    t = [torch.tensor([1.5, -2.0]), (torch.tensor(0.25),)]
    sa, sb = a.scale(t), b.scale(t)
    assert torch.equal(sa[0], sb[0]) and torch.equal(sa[1][0], sb[1][0])
    assert type(sa[1]) is type(sb[1]) is tuple
    assert torch_amp_keys(b.state_dict()) == a.state_dict()
    assert (a.get_scale(), a.is_enabled()) == (b.get_scale(), b.is_enabled())


def torch_amp_keys(state):
    """Ours, as torch.amp reads it: its five keys, in its order (pickled bytes count).
    Ours also holds megengine.amp's "scale_factor" and the stats() counters, which
    torch.amp's load_state_dict() ignores."""
    keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    return {k: state[k] for k in keys}


def test_native_state_dict_loads_into_ours_and_back():
    native = NATIVE("cpu", init_scale=512.0, growth_interval=7)
    ours = OURS()
    ours.load_state_dict(native.state_dict())
    assert torch_amp_keys(ours.state_dict()) == native.state_dict()
    again = NATIVE("cpu")
    again.load_state_dict(ours.state_dict())
    assert again.state_dict() == native.state_dict()


def test_torch_amp_resumes_from_a_checkpoint_of_a_run_with_ours():
    """After steps and skips: torch.amp's own scaler loads ours and holds its numbers."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = OURS("cpu", init_scale=2.0**10, growth_interval=2)
    for overflow in (False, True, False):
        loss = model(torch.randn(4, 3)).pow(2).mean() * (float("inf") if overflow else 1.0)
        ours.scale(loss).backward()
        ours.step(opt)
        ours.update()
        opt.zero_grad()
    native = NATIVE("cpu")
    native.load_state_dict(ours.state_dict())
    assert native.state_dict() == torch_amp_keys(ours.state_dict())
    assert (native.get_scale(), native._get_growth_tracker()) == (2.0**9, 1)


BAD_STATE_DICTS = {
    "empty": {},
    "missing a key": {"scale": 8.0, "growth_factor": 2.0},
    "no mapping": [("scale", 8.0)],
    "None": None,
}


@pytest.mark.parametrize("bad", sorted(BAD_STATE_DICTS))
def test_a_bad_state_dict_raises_torch_amps_type(bad):
    """Where torch.amp refuses a state dict, ours raises amp.StateDictError, which is
    also the type torch.amp raises (RuntimeError for an empty dict, KeyError for a
    missing key, TypeError for no mapping)."""
    with pytest.raises(Exception) as native:
        NATIVE("cpu").load_state_dict(BAD_STATE_DICTS[bad])
    with pytest.raises(unified_amp.StateDictError) as ours:
        OURS("cpu").load_state_dict(BAD_STATE_DICTS[bad])
    assert isinstance(ours.value, type(native.value)), (native.value, ours.value)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_grad_norm_is_torchs_bit_for_bit_on_finite_gradients(norm_type, max_norm):
    def params():
        g = torch.Generator().manual_seed(3)
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in ((4, 3), (3,), (5,))]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * 3
        return ps

    theirs, ours = params(), params()
    norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert unified_amp.clip_grad_norm(ours, max_norm, norm_type) == float(norm)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(theirs, ours))


def test_unified_amp_never_touches_torch_autocast_dispatch():
    """The dtype contract lives on torch's function-mode stack, not in torch's dispatcher:
    neither the scaler nor an enabled unified block registers a kernel, so plain
    torch.autocast keeps torch's exact dispatch path and dtypes, before and after."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, unified_amp as amp
        has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::softmax.int", "AutocastCPU")
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        def native():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return str(x.softmax(-1).dtype)
        scaler = amp.GradScaler("cpu")
        w = torch.nn.Parameter(torch.ones(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (w * 2).softmax(0).sum()
        scaler.scale(loss).backward()
        scaler.step(torch.optim.SGD([w], lr=0.1))
        scaler.update()
        before = has(), native()
        with amp.autocast(dtype="bfloat16", device="cpu"):
            ours = str(x.softmax(-1).dtype)
        print(*before, ours, has(), native())
    """)
    env = dict(os.environ, UNIFIED_AMP_BACKEND="torch")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.stdout.split() == ["False", "torch.bfloat16", "torch.float32", "False",
                                   "torch.bfloat16"], proc.stderr


def test_scale_history_matches_torch_amp_through_underflow():
    """Every step non-finite for 170 steps: torch.amp's scale sinks into float32's
    subnormals without an error; ours must do the same, value for value."""

    def run(GradScaler):
        w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        opt = torch.optim.SGD([w], lr=0.1)
        scaler = GradScaler("cpu")
        scales = []
        for _ in range(170):
            scaler.scale((w * torch.tensor([float("nan"), 1.0])).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales, w.detach().tolist()

    native, ours = run(NATIVE), run(OURS)
    assert native == ours
    # 2**16 * 2**-160 is a float32 subnormal (torch does not flush it); 2**-154 is not
    assert native[0][159] == 2.0**-144 and native[0][-1] == 0.0


def layernorm_mlp_run(autocast_factory, steps=30):
    """A LayerNorm/softmax MLP trained in bfloat16 autocast, with torch.amp's scaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 8, (16,), generator=g)
        with autocast_factory():
            logits = model(x)
            loss = -(logits.log_softmax(-1).gather(1, y[:, None])).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def test_contract_false_reproduces_torch_autocast_bit_for_bit():
    native = layernorm_mlp_run(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    # once with the contract on first, so its kernels are registered in this process
    contract = layernorm_mlp_run(lambda: unified_amp.autocast("cpu", dtype=torch.bfloat16))
    plain = layernorm_mlp_run(
        lambda: unified_amp.autocast("cpu", dtype=torch.bfloat16, contract=False))
    keyword = layernorm_mlp_run(
        lambda: unified_amp.autocast(device_type="cpu", dtype=torch.bfloat16,
                                     contract=False))
    assert plain == native and keyword == native
    assert contract != native  # the dtype contract does change numerics (documented)
