import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from .base import KitBase

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
       "int32": torch.int64}


class _ApexNet(torch.nn.Module):
    """Linear - BatchNorm1d - ReLU - Linear; ``seen`` records the dtypes inside forward."""

    def __init__(self, weights, batch_norm):
        super().__init__()
        w1, b1, w2, b2 = (torch.tensor(np.asarray(a, np.float32)) for a in weights)
        self.fc1 = torch.nn.Linear(w1.shape[1], w1.shape[0])
        self.bn = torch.nn.BatchNorm1d(w1.shape[0]) if batch_norm else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(w2.shape[1], w2.shape[0])
        with torch.no_grad():
            for p, a in zip((self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias),
                            (w1, b1, w2, b2)):
                p.copy_(a)
        self.seen = {}

    def forward(self, x):
        name = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
        self.seen["inputs in the model"] = name(x)
        h = self.fc1(x)
        self.seen["activations"] = name(h)
        h = self.bn(h)
        self.seen["batch norm output"] = name(h)
        return self.fc2(F.relu(h))


class _Scaled(torch.nn.Module):
    """``linear(x) * factor``: a block whose inner Linear may overflow float16 while the
    block's own output fits it."""

    def __init__(self, w, factor):
        super().__init__()
        self.linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor(np.asarray(w, np.float32)))
            self.linear.bias.zero_()
        self.factor = factor

    def forward(self, x):
        return self.linear(x) * self.factor


class _PinNet(torch.nn.Module):
    """fc1 -> block (Linear, then a factor) -> head; ``seen`` records each output's dtype."""

    def __init__(self, w_fc1, w_block, factor, w_head):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.block = _Scaled(w_block, factor)
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            for layer, w in ((self.fc1, w_fc1), (self.head, w_head)):
                layer.weight.copy_(torch.tensor(np.asarray(w, np.float32)))
                layer.bias.zero_()
        self.seen = {}

    def forward(self, x):
        for name in ("fc1", "block", "head"):
            x = getattr(self, name)(x)
            self.seen[name] = str(x.dtype).removeprefix("torch.")
        return x


class Kit(KitBase):
    name = "torch"

    def has_cuda(self):
        return torch.cuda.is_available()

    def on_device(self, dev):
        return contextlib.nullcontext()  # torch tensors carry their device

    def tensor(self, a, dev, dtype="float32"):
        return torch.tensor(np.asarray(a), device=dev).to(_DT[dtype])

    def param(self, a, dev, dtype="float32"):
        return torch.nn.Parameter(self.tensor(np.asarray(a, dtype=np.float32), dev, dtype))

    def numpy(self, t):
        t = t.detach()
        return (t.float() if t.is_floating_point() else t).cpu().numpy().copy()

    def dtype(self, t):
        return str(t.dtype).removeprefix("torch.")

    def set_grad(self, p, a):
        p.grad = self.tensor(np.asarray(a, dtype=np.float32), p.device)

    def grad(self, p):
        return None if p.grad is None else self.numpy(p.grad)

    def assign(self, p, a):
        with torch.no_grad():
            p.copy_(self.tensor(np.asarray(a, dtype=np.float32), p.device))

    def synchronize(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def dtype_object(self, name):
        return _DT[name]

    # -- optimizers ------------------------------------------------------------------
    def sgd(self, params, lr, momentum=0.0, weight_decay=0.0):
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    def adam(self, params, lr):
        return torch.optim.Adam(params, lr=lr)

    def multistep_lr(self, opt, milestones, gamma):
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma)

    def opt_state(self, opt):
        out = []
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in sorted(opt.state.get(p, {}).items()):
                    out.append((key, self.numpy(value) if torch.is_tensor(value) else value))
        return out

    def opt_step(self, opt):
        opt.step()

    # -- model pieces ----------------------------------------------------------------
    def linear(self, x, w, b):
        return F.linear(x, w, b)

    def relu(self, x):
        return F.relu(x)

    def cross_entropy(self, logits, labels):
        return F.cross_entropy(logits, labels)

    def mse(self, pred, target):
        return F.mse_loss(pred, target)

    def mul(self, a, b):
        return a * b

    def total(self, t):
        return t.sum()

    def linear_model(self, layers, dev):
        """``torch.nn.Sequential`` of ``Linear`` layers with the given (W, b) arrays."""
        modules = []
        for w, b in layers:
            linear = torch.nn.Linear(w.shape[1], w.shape[0])
            with torch.no_grad():
                linear.weight.copy_(self.tensor(w, "cpu"))
                linear.bias.copy_(self.tensor(b, "cpu"))
            modules.append(linear)
        return torch.nn.Sequential(*modules).to(dev)

    def pin_model(self, dev, w_fc1, w_block, factor, w_head):
        """``fc1 -> block.linear * factor -> head`` (Linear(4, 4), Linear(4, 4),
        Linear(4, 1), biases 0); ``model.seen`` holds each stage's output dtype."""
        return _PinNet(w_fc1, w_block, factor, w_head).to(dev)

    def compile_forward(self, fn):
        """``fn`` compiled as a torch user would (aot_eager: the graphs without
        inductor's compile time)."""
        return torch.compile(fn, backend="aot_eager")

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def registry_namespace(self, op):
        """Where ``linear``/``sigmoid`` of this kit look the function up at call time:
        (the namespace object, its dotted name)."""
        return {"linear": (F, "torch.nn.functional"), "sigmoid": (torch, "torch")}[op]

    def module_class_in_namespace(self):
        """(a namespace, the name of a module class in it)."""
        return torch.nn, "Linear"

    def host_reads(self):
        """The tensor methods that read values back to the host."""
        return torch.Tensor, ("item", "tolist", "numpy")

    # -- apex-style models (amp.initialize) --------------------------------------------
    def apex_model(self, dev, seed=0, sizes=(4, 8, 3), batch_norm=True):
        """A small float32 module with batch norm; the same weights on both frameworks."""
        return _ApexNet(self.apex_weights(sizes, seed), batch_norm).to(dev)

    def batch_norm_weight(self, model):
        return model.bn.weight

    def zero_grad(self, opt):
        opt.zero_grad()

    # -- the dtype table ---------------------------------------------------------------
    def run_op(self, row, inp, dev, low, kind):
        def x_(a):  # the op's data input: float32, or the autocast dtype
            return self.tensor(a, dev, low if kind == "low" else "float32")

        def w_(a):  # weights stay float32, as parameters do
            return self.tensor(a, dev, "float32")

        ops = {
            "matmul": lambda: x_(inp["x"]) @ w_(inp["w"]).t(),
            "linear": lambda: F.linear(x_(inp["x"]), w_(inp["w"]), w_(inp["b"])),
            "conv2d": lambda: F.conv2d(x_(inp["img"]), w_(inp["cw"]), w_(inp["cb"])),
            "batched matmul": lambda: torch.matmul(x_(inp["a3"]), w_(inp["b3"])),
            "softmax": lambda: F.softmax(x_(inp["x"]), dim=-1),
            "log-softmax": lambda: F.log_softmax(x_(inp["x"]), dim=-1),
            "cross-entropy": lambda: F.cross_entropy(
                x_(inp["x"]), self.tensor(inp["labels"], dev, "int32")),
            "binary cross-entropy with logits": lambda: F.binary_cross_entropy_with_logits(
                x_(inp["x"]), w_(inp["targets"])),
            "MSE": lambda: F.mse_loss(x_(inp["x"]), w_(inp["x"])),
            "sum": lambda: x_(inp["x"]).sum(),
            "mean": lambda: x_(inp["x"]).mean(),
            "exp": lambda: x_(inp["x"]).exp(),
            "log": lambda: x_(inp["pos"]).log(),
            "batch norm": lambda: F.batch_norm(
                x_(inp["img"]), w_(inp["bn_mean"]), w_(inp["bn_var"]), w_(inp["bn_w"]),
                w_(inp["bn_b"]), training=True),
            "max pool": lambda: F.max_pool2d(x_(inp["img"]), 2),
            "average pool": lambda: F.avg_pool2d(x_(inp["img"]), 2),
            "global average pool": lambda: F.adaptive_avg_pool2d(x_(inp["img"]), 1),
            "layer norm": lambda: F.layer_norm(x_(inp["x"]), (8,), w_(inp["ln_w"]),
                                               w_(inp["ln_b"])),
            "add low+float32": lambda: self.tensor(inp["x"], dev, low) + w_(inp["x"]),
        }
        return ops[row]()

    def run_module(self, row, inp, dev, low):
        """The module spelling of a row, on a low-precision input."""
        x = self.tensor(inp["x"], dev, low)
        img = self.tensor(inp["img"], dev, low)
        if row == "softmax":
            return torch.nn.Softmax(dim=-1)(x)
        if row == "batch norm":
            return torch.nn.BatchNorm2d(3).to(dev)(img)
        if row == "layer norm":
            return torch.nn.LayerNorm(8).to(dev)(x)
        raise KeyError(row)
