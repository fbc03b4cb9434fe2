"""torch.amp.GradScaler's private state that torch's own grad-scaling tests (and code in
the wild) use, side by side: ``_init_scale`` / ``_init_growth_tracker`` through
``load_state_dict`` and pickling, and ``_unscale_grads_`` on sparse gradients, float16
ones with duplicate indices included. Each case runs on torch.amp's scaler and ours and
compares what the caller observes."""

import pickle

import pytest
import torch

import unified_amp

NATIVE, OURS = torch.amp.GradScaler, unified_amp.GradScaler


def observed(scaler):
    return (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval(), scaler._init_scale, scaler._init_growth_tracker)


def test_the_settings_read_as_torch_amps_private_attributes():
    def run(GradScaler, enabled=True):
        scaler = GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25,
                            growth_interval=5, enabled=enabled)
        if not enabled:  # torch.amp keeps no factors then
            return scaler._enabled, scaler._device
        scaler.set_growth_factor(3.0)
        return (scaler._enabled, scaler._device, scaler._growth_factor,
                scaler._backoff_factor, scaler._growth_interval)

    assert run(OURS) == run(NATIVE) == (True, "cpu", 3.0, 0.25, 5)
    assert run(OURS, False) == run(NATIVE, False) == (False, "cpu")


@pytest.mark.parametrize("scaled_first", [False, True], ids=["lazy", "initialised"])
def test_load_state_dict_sets_the_init_values(scaled_first):
    def run(GradScaler):
        source = GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5,
                            growth_interval=2)
        target = GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8,
                            growth_interval=1)
        target._init_growth_tracker = 7  # overwritten by the load
        if scaled_first:  # torch.amp creates its scale tensor here
            target.scale(torch.full((1,), 4.0))
        target.load_state_dict(source.state_dict())
        return observed(target), target.scale(torch.ones(1)).item()

    assert run(OURS) == run(NATIVE) == ((3.0, 4.0, 0.5, 2, 3.0, 0), 3.0)


def trained(GradScaler, steps):
    """A scaler after ``steps`` clean steps with growth_interval=2."""
    scaler = GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5,
                        growth_interval=2)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(steps):
        scaler.scale(w.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


@pytest.mark.parametrize("steps", [0, 3])
def test_pickling_carries_the_current_scale_and_tracker_as_init_values(steps):
    def run(GradScaler):
        clone = pickle.loads(pickle.dumps(trained(GradScaler, steps)))
        return observed(clone), clone.scale(torch.tensor([4.0])).item()

    ours, native = run(OURS), run(NATIVE)
    assert ours == native
    # 3 clean steps at growth_interval 2: grown once (x4), one step towards the next
    assert native == (((3.0, 4.0, 0.5, 2, 3.0, 0), 12.0) if steps == 0 else
                      ((12.0, 4.0, 0.5, 2, 12.0, 1), 48.0))


def sparse_grad(values, dtype, indices=((0, 1, 1), (2, 0, 2))):
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values), (2, 3),
                                   dtype=dtype)


CASES = {
    "float32-clean": (torch.float32, [16.0, 32.0, 64.0], ((0, 1, 1), (2, 0, 2))),
    "float32-inf": (torch.float32, [16.0, 32.0, float("inf")], ((0, 1, 1), (2, 0, 2))),
    "float32-nan": (torch.float32, [16.0, 32.0, float("nan")], ((0, 1, 1), (2, 0, 2))),
    "float16-clean": (torch.float16, [16.0, 32.0, 64.0], ((0, 1, 1), (2, 0, 2))),
    # duplicate index (0, 2): each 64000 fits float16, their sum (128000) does not
    "float16-duplicates-overflow": (torch.float16, [64000.0, 32.0, 64000.0],
                                    ((0, 1, 0), (2, 0, 2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unscale_grads_on_sparse_gradients(case):
    dtype, values, indices = CASES[case]

    def run(GradScaler):
        scaler = GradScaler("cpu")
        p = sparse_grad([1.0, 1.0, 1.0], dtype).clone()
        opt = torch.optim.SGD([p], lr=1.0)
        p.grad = sparse_grad(values, dtype, indices)
        inv = torch.full((1,), 0.25)
        found = scaler._unscale_grads_(opt, inv, torch.zeros(1), dtype == torch.float16)
        flags = {str(d): f.item() for d, f in found.items()}
        return flags, p.grad.is_coalesced(), p.grad.to_dense()

    (flags, coalesced, dense), (n_flags, n_coalesced, n_dense) = run(OURS), run(NATIVE)
    assert flags == n_flags == {"cpu": float(case.endswith(("inf", "nan", "overflow")))}
    assert coalesced == n_coalesced
    torch.testing.assert_close(dense, n_dense, equal_nan=True, rtol=0, atol=0)


def test_unscale_grads_refuses_float16_unless_allowed():
    for GradScaler in (NATIVE, OURS):
        p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        p.grad = torch.ones(2, dtype=torch.float16)
        opt = torch.optim.SGD([p], lr=1.0)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            GradScaler("cpu")._unscale_grads_(opt, torch.ones(1), torch.zeros(1), False)


@pytest.mark.parametrize("device", [(), ("cuda",)], ids=["no device given", "cuda"])
def test_on_a_cuda_machine_a_cpu_models_scale_and_flags_stay_on_the_cpu(monkeypatch, device):
    """torch.amp's scaler made for CUDA (its default) keeps its scale where the first
    loss it scales lives, and its found-inf flags where the gradients live: a CPU model
    trains with it on a GPU machine. Ours, side by side, with torch.cuda reporting a GPU.
    This torch has no CUDA: a tensor put on "cuda" would fail, which is the check."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}
    for make in (NATIVE, OURS):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make(*device, init_scale=2.0**10)
        history = []
        for step in range(3):
            x = torch.randn(3, 4)
            x[0, 0] = float("inf") if step == 1 else x[0, 0]
            scaler.scale(model(x).sum()).backward()
            scaler.unscale_(opt)
            flags = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
            history.append((scaler._scale.device, scaler._growth_tracker.device,
                            {d: float(f) for d, f in flags.items()}))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            history.append(scaler.get_scale())
        seen[make] = history, [p.detach().clone() for p in model.parameters()]
    assert seen[OURS][0] == seen[NATIVE][0]
    assert seen[OURS][0][2] == (torch.device("cpu"), torch.device("cpu"),
                                {torch.device("cpu"): 1.0})
    for a, b in zip(seen[OURS][1], seen[NATIVE][1]):
        assert torch.equal(a, b)
