import contextlib

import numpy as np

import megengine as mge
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as O
from megengine.core.tensor.dtype import bfloat16

from .base import KitBase

# Ops only combine tensors on one comp node, and MegEngine's own code (optimizers,
# modules) makes tensors on the default device; so tests run with the default device set
# to the test's device (Kit.on_device), as a MegEngine user targeting it would.
_DEV = {"cpu": "cpux", "cuda": "gpux"}


@contextlib.contextmanager
def _on(dev):
    saved = mge.get_default_device()
    mge.set_default_device(_DEV[dev])
    try:
        yield
    finally:
        mge.set_default_device(saved)


class _ApexNet(M.Module):
    """Linear - BatchNorm1d - ReLU - Linear; ``seen`` records the dtypes inside forward."""

    def __init__(self, weights, batch_norm):
        super().__init__()
        w1, b1, w2, b2 = (np.asarray(a, np.float32) for a in weights)
        self.fc1 = M.Linear(w1.shape[1], w1.shape[0])
        self.bn = M.BatchNorm1d(w1.shape[0]) if batch_norm else M.Identity()
        self.fc2 = M.Linear(w2.shape[1], w2.shape[0])
        for p, a in zip((self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias),
                        (w1, b1, w2, b2)):
            p._reset(mge.tensor(a, device=p.device))
        self.seen = {}

    def forward(self, x):
        self.seen["inputs in the model"] = np.dtype(x.dtype).name
        h = self.fc1(x)
        self.seen["activations"] = np.dtype(h.dtype).name
        h = self.bn(h)
        self.seen["batch norm output"] = np.dtype(h.dtype).name
        return self.fc2(F.relu(h))


class _Scaled(M.Module):
    """``linear(x) * factor``: a block whose inner Linear may overflow float16 while the
    block's own output fits it."""

    def __init__(self, w, factor):
        super().__init__()
        self.linear = M.Linear(w.shape[1], w.shape[0])
        self.linear.weight._reset(mge.tensor(np.asarray(w, np.float32)))
        self.linear.bias._reset(mge.tensor(np.zeros(w.shape[0], np.float32)))
        self.factor = factor

    def forward(self, x):
        return self.linear(x) * self.factor


class _PinNet(M.Module):
    """fc1 -> block (Linear, then a factor) -> head; ``seen`` records each output's dtype."""

    def __init__(self, w_fc1, w_block, factor, w_head):
        super().__init__()
        self.fc1 = M.Linear(4, 4)
        self.block = _Scaled(np.asarray(w_block, np.float32), factor)
        self.head = M.Linear(4, 1)
        for layer, w in ((self.fc1, w_fc1), (self.head, w_head)):
            w = np.asarray(w, np.float32)
            layer.weight._reset(mge.tensor(w))
            layer.bias._reset(mge.tensor(np.zeros(w.shape[0], np.float32)))
        self.seen = {}

    def forward(self, x):
        for name in ("fc1", "block", "head"):
            x = getattr(self, name)(x)
            self.seen[name] = np.dtype(x.dtype).name
        return x


class Kit(KitBase):
    name = "megengine"

    def has_cuda(self):
        return bool(mge.is_cuda_available())

    def on_device(self, dev):
        return _on(dev)

    def tensor(self, a, dev, dtype="float32"):
        a = np.asarray(a)
        if dtype == "bfloat16":
            return mge.tensor(a.astype(np.float32), device=_DEV[dev]).astype(bfloat16)
        return mge.tensor(a.astype(dtype), device=_DEV[dev])

    def param(self, a, dev, dtype="float32"):
        return mge.Parameter(np.asarray(a, dtype=dtype), device=_DEV[dev])

    def numpy(self, t):
        return t.astype("float32").numpy() if self.dtype(t) in ("float16", "bfloat16") \
            else t.numpy()

    def dtype(self, t):
        return "bfloat16" if "bfloat16" in str(t.dtype) else np.dtype(t.dtype).name

    def set_grad(self, p, a):
        p.grad = mge.tensor(np.asarray(a, dtype=np.float32), device=p.device)

    def grad(self, p):
        return None if p.grad is None else p.grad.numpy()

    def assign(self, p, a):
        p._reset(mge.tensor(np.asarray(a, dtype=np.float32), device=p.device))

    def synchronize(self):
        mge._full_sync()  # raises MegEngine's AsyncError if any kernel failed

    def dtype_object(self, name):
        return bfloat16 if name == "bfloat16" else np.dtype(name)

    # -- optimizers ------------------------------------------------------------------
    def sgd(self, params, lr, momentum=0.0, weight_decay=0.0):
        return O.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    def adam(self, params, lr):
        return O.Adam(params, lr=lr)

    def multistep_lr(self, opt, milestones, gamma):
        return O.MultiStepLR(opt, milestones, gamma)

    def opt_state(self, opt):
        out = []
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in sorted(opt._state.get(p, {}).items()):
                    out.append((key, value.numpy() if isinstance(value, mge.Tensor) else value))
        return out

    def opt_step(self, opt):
        opt.step()

    # -- model pieces ----------------------------------------------------------------
    def linear(self, x, w, b):
        return F.nn.linear(x, w, b)

    def relu(self, x):
        return F.relu(x)

    def cross_entropy(self, logits, labels):
        return F.nn.cross_entropy(logits, labels)

    def mse(self, pred, target):
        return F.nn.square_loss(pred, target)

    def mul(self, a, b):
        return a * b

    def total(self, t):
        return t.sum()

    def linear_model(self, layers, dev):
        """``megengine.module.Sequential`` of ``Linear`` layers with the given (W, b)."""
        modules = []
        with _on(dev):
            for w, b in layers:
                linear = M.Linear(w.shape[1], w.shape[0])
                linear.weight = self.param(w, dev)
                linear.bias = self.param(b, dev)
                modules.append(linear)
            return M.Sequential(*modules)

    def pin_model(self, dev, w_fc1, w_block, factor, w_head):
        """``fc1 -> block.linear * factor -> head`` (Linear(4, 4), Linear(4, 4),
        Linear(4, 1), biases 0); ``model.seen`` holds each stage's output dtype."""
        with _on(dev):
            return _PinNet(w_fc1, w_block, factor, w_head)

    def compile_forward(self, fn):
        """``fn`` traced as a MegEngine user would (``megengine.jit.trace``)."""
        from megengine.jit import trace

        return trace(fn, symbolic=True)

    def sigmoid(self, x):
        return F.sigmoid(x)

    def registry_namespace(self, op):
        """Where ``linear``/``sigmoid`` of this kit look the function up at call time:
        (the namespace object, its dotted name)."""
        return {"linear": (F.nn, "megengine.functional.nn"),
                "sigmoid": (F, "megengine.functional")}[op]

    def module_class_in_namespace(self):
        """(a namespace, the name of a module class in it)."""
        return M, "Linear"

    def host_reads(self):
        """The tensor methods that read values back to the host."""
        return mge.Tensor, ("item", "tolist", "numpy")

    # -- apex-style models (amp.initialize) --------------------------------------------
    def apex_model(self, dev, seed=0, sizes=(4, 8, 3), batch_norm=True):
        """A small float32 module with batch norm; the same weights on both frameworks."""
        with _on(dev):
            return _ApexNet(self.apex_weights(sizes, seed), batch_norm)

    def batch_norm_weight(self, model):
        return model.bn.weight

    def zero_grad(self, opt):
        opt.clear_grad()

    # -- the dtype table ---------------------------------------------------------------
    def run_op(self, row, inp, dev, low, kind):
        def x_(a):
            return self.tensor(a, dev, low if kind == "low" else "float32")

        def w_(a):
            return self.tensor(a, dev, "float32")

        c4 = lambda a: w_(np.asarray(a).reshape(1, -1, 1, 1))  # MegEngine's (1, C, 1, 1)
        ops = {
            "matmul": lambda: F.matmul(x_(inp["x"]), w_(inp["w"]), transpose_b=True),
            "linear": lambda: F.nn.linear(x_(inp["x"]), w_(inp["w"]), w_(inp["b"])),
            "conv2d": lambda: F.conv2d(x_(inp["img"]), w_(inp["cw"]), c4(inp["cb"])),
            "batched matmul": lambda: F.matmul(x_(inp["a3"]), w_(inp["b3"])),
            "softmax": lambda: F.softmax(x_(inp["x"]), axis=-1),
            "log-softmax": lambda: F.logsoftmax(x_(inp["x"]), axis=-1),
            "cross-entropy": lambda: F.nn.cross_entropy(
                x_(inp["x"]), self.tensor(inp["labels"], dev, "int32")),
            "binary cross-entropy with logits": lambda: F.nn.binary_cross_entropy(
                x_(inp["x"]), w_(inp["targets"]), with_logits=True),
            "MSE": lambda: F.nn.square_loss(x_(inp["x"]), w_(inp["x"])),
            "sum": lambda: x_(inp["x"]).sum(),
            "mean": lambda: x_(inp["x"]).mean(),
            "exp": lambda: F.exp(x_(inp["x"])),
            "log": lambda: F.log(x_(inp["pos"])),
            "batch norm": lambda: F.nn.batch_norm(
                x_(inp["img"]), c4(inp["bn_mean"]), c4(inp["bn_var"]), c4(inp["bn_w"]),
                c4(inp["bn_b"]), training=True),
            "max pool": lambda: F.max_pool2d(x_(inp["img"]), 2),
            "average pool": lambda: F.avg_pool2d(x_(inp["img"]), 2),
            "global average pool": lambda: F.adaptive_avg_pool2d(x_(inp["img"]), (1, 1)),
            "layer norm": lambda: F.nn.layer_norm(x_(inp["x"]), (8,), True, w_(inp["ln_w"]),
                                                  w_(inp["ln_b"])),
            "add low+float32": lambda: self.tensor(inp["x"], dev, low) + w_(inp["x"]),
        }
        return ops[row]()

    def run_module(self, row, inp, dev, low):
        x = self.tensor(inp["x"], dev, low)
        img = self.tensor(inp["img"], dev, low)
        with _on(dev):
            if row == "softmax":
                return M.Softmax(axis=-1)(x)
            if row == "batch norm":
                return M.BatchNorm2d(3)(img)
            if row == "layer norm":
                return M.LayerNorm(8)(x)
        raise KeyError(row)
