"""Training steps written once against unified_amp's public API (plus a test kit for
making tensors and models). The contract tests drive both backends through these."""

import numpy as np

import unified_amp as amp


class Problem:
    """A small MLP classification problem on one device, reproducible from a seed."""

    def __init__(self, kit, device, seed=0, sizes=(8, 16, 4), n=16):
        self.kit, self.device = kit, device
        self.params, self.forward = kit.mlp_params(sizes, device, seed)
        rng = np.random.RandomState(seed + 100)
        self.x = rng.randn(n, sizes[0]).astype(np.float32)
        self.y = rng.randint(0, sizes[-1], n).astype(np.int32)

    def loss(self, overflow=False, rows=slice(None)):
        """Cross-entropy on (a slice of) the data; ``overflow`` plants an inf in the
        input so that every gradient it reaches is inf/NaN."""
        x = self.x[rows].copy()
        if overflow:
            x[0, 0] = np.inf
        xt = self.kit.tensor(x, self.device)
        yt = self.kit.tensor(self.y[rows], self.device, "int32")
        return self.kit.cross_entropy(self.forward(xt), yt)

    def weights(self):
        return [self.kit.numpy(p).copy() for p in self.params]


def torch_style_step(scaler, gm, opt, problem, overflow=False, dtype="float16"):
    """scale -> backward -> step -> update (torch.amp's pattern, manual mode)."""
    with amp.autocast(dtype=dtype, device=problem.device):
        with gm:
            gm.backward(scaler.scale(problem.loss(overflow)))
    scaler.step(opt)
    scaler.update()
    gm.zero_grad()


def megengine_style_step(scaler, gm, opt, problem, overflow=False, dtype="float16"):
    """scaler.backward(gm, loss) then the optimizer's own step (automatic mode)."""
    with amp.autocast(dtype=dtype, device=problem.device):
        with gm:
            scaler.backward(gm, problem.loss(overflow))
    opt.step()
    gm.zero_grad()


STEPS = {"torch-style": torch_style_step, "megengine-style": megengine_style_step}


def bits(arrays):
    """Exact byte content, for bit-for-bit comparisons."""
    return [np.ascontiguousarray(a).tobytes() for a in arrays]


def state_bits(kit, opt):
    return [(k, np.asarray(v).tobytes()) for k, v in kit.opt_state(opt)]
