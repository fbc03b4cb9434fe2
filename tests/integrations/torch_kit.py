"""What every torch runner test shares: a tiny model, its batches, the planted overflows,
and what a run records, so that two runs of one runner (torch.amp's scaler, then
unified_amp's) can be compared byte for byte."""

import pickle

import torch
import torch.nn.functional as F

INF = float("inf")
# The scaler both runs are built with: a growth every 2 clean steps, so that a short run
# shows backoffs and growths alike.
SCALER_ARGS = dict(init_scale=2.0**10, growth_interval=2)
N_BATCHES = 8  # per epoch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def dataset():
    """Fixed batches (shuffle off), so that both runs see the same data in the same order."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(8 * N_BATCHES, 8, generator=g)
    y = torch.randint(0, 4, (8 * N_BATCHES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def loader():
    return torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=False)


class Plan:
    """The planted overflows and what the run saw. Micro-batches are counted from 1 by
    the loss calls (a run's loss goes through ``loss``), so the same Plan carried across
    a checkpoint resume keeps counting.

    ``inf_loss``: micro-batches whose loss is multiplied by inf (an inf loss, so every
    gradient is inf or NaN). ``inf_grad``: micro-batches whose loss is finite but whose
    first weight gets an inf gradient element (a hook on that parameter)."""

    def __init__(self, inf_loss=(3,), inf_grad=(10,)):
        self.inf_loss, self.inf_grad = set(inf_loss), set(inf_grad)
        self.calls = 0
        self.dtypes = set()      # of the first layer's output: what autocast made of it
        self.stepped = []        # the micro-batches at which a step changed the weights
        self.scales = []         # the scale after each micro-batch

    def loss(self, logits, y):
        self.calls += 1
        loss = F.cross_entropy(logits.float(), y)
        return loss * INF if self.calls in self.inf_loss else loss

    def attach(self, net, optimizer=None):
        """Plants the inf gradients on ``net``, records its forward's dtype, and
        watches ``optimizer`` (if given) for the steps that ran."""
        def poison(grad):
            if self.calls in self.inf_grad:
                grad = grad.clone()
                grad[0, 0] = INF
            return grad

        net[0].weight.register_hook(poison)
        # Inside the model: runners (Fabric, accelerate) hand the loss float32 outputs.
        net[0].register_forward_hook(lambda mod, args, out: self.dtypes.add(out.dtype))
        if optimizer is not None:
            self.watch(optimizer)

    def watch(self, optimizer):
        """Records the micro-batch at which a step changed the weights: a skipped step
        either never calls ``optimizer.step`` or (fused optimizers, which skip inside
        their kernel) calls it and leaves every weight as it was."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        before = []

        def pre(*_):
            before[:] = [p.detach().clone() for p in params]

        def post(*_):
            if any(not torch.equal(a, p) for a, p in zip(before, params)):
                self.stepped.append(self.calls)

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    def record_scale(self, scaler):
        self.scales.append(scaler.get_scale())


def optimizer(net, fused=False):
    return torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused or None)


def weights(net):
    return [p.detach().numpy().tobytes() for p in net.parameters()]


def optimizer_state(opt):
    """Every tensor and number of the optimizer's per-parameter state, as bytes."""
    out = []
    for state in opt.state_dict()["state"].values():
        for key, value in sorted(state.items()):
            out.append((key, torch.as_tensor(value).numpy().tobytes()))
    return out


TORCH_AMP_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                  "_growth_tracker")


def scaler_bytes(state):
    """A scaler's state dict as torch.amp reads it, pickled, so types and key order
    count: torch.amp's five keys (unified_amp's dict also holds megengine.amp's
    "scale_factor" and the stats() counters, which torch.amp's load ignores)."""
    assert list(state)[:1] == ["scale"] and set(TORCH_AMP_KEYS) <= set(state), state
    return pickle.dumps({k: state[k] for k in state if k in TORCH_AMP_KEYS})


def assert_same(native, ours):
    """Two runs' records (dicts of the same keys) equal, key by key, so a failure
    names what differed."""
    assert native.keys() == ours.keys()
    for key in native:
        assert native[key] == ours[key], f"{key} differs"


def assert_really_amp(plan, accumulate=1, expected_dtype=torch.float16):
    """The control run did run AMP: a low-precision forward, exactly the optimizer steps
    whose accumulation window holds no planted overflow, and a scale that backed off and
    grew."""
    assert plan.dtypes == {expected_dtype}, plan.dtypes
    planted = plan.inf_loss | plan.inf_grad
    ends = range(accumulate, plan.calls + 1, accumulate)
    clean = [e for e in ends if not any(e - accumulate < k <= e for k in planted)]
    assert planted and len(clean) < len(ends)
    assert plan.stepped == clean, (plan.stepped, clean)
    pairs = list(zip(plan.scales, plan.scales[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), plan.scales
