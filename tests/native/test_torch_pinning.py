"""``amp.keep_float32`` and torch's module replicas: ``nn.DataParallel`` copies each
module's attributes into a replica per GPU (``torch.nn.parallel.replicate``), the pin
included, and gives the replica its own copies of the weights. A pinned replica must run
its own weights, not the original's. ``replicate`` itself needs CUDA devices, so the
replicas here are made the way it makes them, on CPU."""

import torch

import unified_amp as amp


def replicate(module, scale):
    """A replica as torch.nn.parallel.replicate makes one: the module's attributes
    copied, its parameters replaced by (here: scaled) copies, its children replicas."""
    replica = module._replicate_for_data_parallel()
    for name, p in module._parameters.items():
        setattr(replica, name, p.detach() * scale)
    for name, child in module._modules.items():
        replica._modules[name] = replicate(child, scale)
    return replica


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_a_pinned_replica_runs_its_own_weights_in_float32():
    m = model()
    amp.keep_float32(m[0])
    replica = replicate(m, 2.0)
    x = torch.randn(3, 4)
    with amp.autocast(dtype="bfloat16", device="cpu"):
        hidden = replica[0](x)
        out = replica(x)
    assert hidden.dtype == torch.float32
    assert torch.equal(hidden, torch.nn.functional.linear(x, replica[0].weight,
                                                          replica[0].bias))
    assert not torch.equal(hidden, torch.nn.functional.linear(x, m[0].weight, m[0].bias))
    with amp.autocast(dtype="bfloat16", device="cpu"):
        expected = replica[2](torch.relu(hidden))
    assert torch.equal(out, expected)


def test_a_forward_wrapped_after_pinning_gets_no_extra_keyword():
    """A wrapper installed over the pin (as a user's, taking only the input) is called
    as before; the pin then runs the module it was made for."""
    m = model()
    amp.keep_float32(m[0])
    pin = m[0].forward
    m[0].forward = lambda x: pin(x) * 1.0
    x = torch.randn(3, 4)
    with amp.autocast(dtype="bfloat16", device="cpu"):
        out = m[0](x)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(x, m[0].weight, m[0].bias))


def test_unpinning_takes_the_pre_hook_off():
    m = model()
    hooks = dict(m[0]._forward_pre_hooks)
    amp.keep_float32(m[0])
    assert len(m[0]._forward_pre_hooks) == len(hooks) + 1
    amp.keep_float32(m[0], enabled=False)
    assert dict(m[0]._forward_pre_hooks) == hooks
    x = torch.randn(3, 4)
    with amp.autocast(dtype="bfloat16", device="cpu"):
        assert m[0](x).dtype == torch.bfloat16
