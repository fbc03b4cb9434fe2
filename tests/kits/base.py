"""What only the contract tests build, written once for both frameworks on top of the
shared construction kit (``examples.frameworks``)."""

import sys

import numpy as np


class ContractKit:
    """Test-only models and readers; mixed into a framework kit (``TorchKit``,
    ``MegEngineKit``), whose tensors, modules and ops it uses."""

    def mlp_params(self, sizes, dev, seed):
        """Linear-ReLU-...-Linear as (params, forward), the same weights on every
        framework for a seed."""
        rng = np.random.RandomState(seed)
        params = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            params.append(self.param(rng.randn(fan_out, fan_in) / np.sqrt(fan_in), dev))
            params.append(self.param(np.zeros(fan_out), dev))

        def forward(x):
            for i in range(0, len(params), 2):
                x = self.linear(x, params[i], params[i + 1])
                if i + 2 < len(params):
                    x = self.relu(x)
            return x

        return params, forward

    def linear_model(self, layers, dev):
        """A ``Sequential`` of ``Linear`` layers with the given (W, b) arrays."""
        modules = []
        with self.on_device(dev):
            for w, b in layers:
                linear = self.nn.Linear(w.shape[1], w.shape[0])
                self.assign(linear.weight, w)
                self.assign(linear.bias, b)
                modules.append(linear)
            return self.place(self.nn.Sequential(*modules), dev)

    def opt_state(self, opt):
        """The optimizer's state as (key, value) with tensors read back to numpy."""
        return [(key, self.numpy(value) if self.is_tensor(value) else value)
                for key, value in self.optimizer_state(opt)]

    # -- the dtype table ---------------------------------------------------------------
    def run_call(self, call, dev, low, kind, inp, names=None):
        """A row's sample call (unified_amp/dtype_contract/) on ``inp``'s arrays: the
        data tensors in the dtypes of ``kind`` (float32, ``low``, or mixed), parameters
        float32, indices as the framework's index type. ``names``: more names the call
        may use (a module's globals)."""
        from ..contract.dtype_table import dtypes

        scope = {**(names or {}), **self.call_scope()}
        for name, dtype in dtypes(call, kind, low).items():
            scope[name] = (self.labels(inp[name], dev) if dtype == "int"
                           else self.tensor(inp[name], dev, dtype))
        return eval(call, scope)  # noqa: S307 -- the table's own sample calls

    def run_op(self, row, inp, dev, low, kind):
        """One row of the dtype table (by name) in this framework's spelling."""
        from ..contract.dtype_table import call_of
        from ..contract.dtype_table import row as find

        call = call_of(find(row), self.name)
        assert call is not None, f"{self.name} has no {row!r}"
        return self.run_call(call, dev, low, kind, inp)

    def run_module(self, row, inp, dev, low):
        """The module spelling of a row, on a low-precision input."""
        x = self.tensor(inp["x"], dev, low)
        img = self.tensor(inp["img"], dev, low)
        with self.on_device(dev):
            if row == "softmax":
                return self.nn.Softmax(-1)(x)
            if row == "batch norm":
                return self.place(self.nn.BatchNorm2d(2), dev)(img)
            if row == "layer norm":
                return self.place(self.nn.LayerNorm(8), dev)(x)
        raise KeyError(row)

    # -- apex-style models (amp.initialize) --------------------------------------------
    @staticmethod
    def apex_weights(sizes, seed):
        """(fc1 weight, fc1 bias, fc2 weight, fc2 bias) for ``apex_model``, from numpy."""
        rng = np.random.RandomState(seed)
        (n_in, hidden, n_out) = sizes
        return (rng.randn(hidden, n_in) / np.sqrt(n_in), rng.randn(hidden) * 0.1,
                rng.randn(n_out, hidden) / np.sqrt(hidden), np.zeros(n_out))

    def apex_model(self, dev, seed=0, sizes=(4, 8, 3), batch_norm=True):
        """A small float32 module with batch norm; the same weights on both frameworks."""
        with self.on_device(dev):
            net = self.define(_apex_net)(self.apex_weights(sizes, seed), batch_norm)
            return self.place(net, dev)

    def batch_norm_weight(self, model):
        return model.bn.weight

    # -- precision pinning (amp.keep_float32) ------------------------------------------
    def pin_model(self, dev, w_fc1, w_block, factor, w_head):
        """``fc1 -> block.linear * factor -> head`` (Linear(4, 4), Linear(4, 4),
        Linear(4, 1), biases 0); ``model.seen`` holds each stage's output dtype."""
        with self.on_device(dev):
            net = self.define(_pin_net)(w_fc1, w_block, factor, w_head)
            return self.place(net, dev)


def _apex_net(kit):
    """The ``ApexNet`` class on ``kit``'s framework."""

    class ApexNet(kit.nn.Module):
        """Linear - BatchNorm1d - ReLU - Linear; ``seen`` records the dtypes inside
        forward."""

        def __init__(self, weights, batch_norm):
            super().__init__()
            w1, b1, w2, b2 = (np.asarray(a, np.float32) for a in weights)
            self.fc1 = kit.nn.Linear(w1.shape[1], w1.shape[0])
            self.bn = kit.nn.BatchNorm1d(w1.shape[0]) if batch_norm else kit.nn.Identity()
            self.fc2 = kit.nn.Linear(w2.shape[1], w2.shape[0])
            for p, a in zip((self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias),
                            (w1, b1, w2, b2)):
                kit.assign(p, a)
            self.seen = {}
            self.gates = None  # a list: each forward's ReLU inputs are kept in it

        def forward(self, x):
            self.seen["inputs in the model"] = kit.dtype_name(x)
            h = self.fc1(x)
            self.seen["activations"] = kit.dtype_name(h)
            h = self.bn(h)
            self.seen["batch norm output"] = kit.dtype_name(h)
            if self.gates is not None:
                self.gates.append(kit.numpy(h))
            return self.fc2(kit.relu(h))

    return ApexNet


def _pin_net(kit):
    """The ``PinNet`` class on ``kit``'s framework."""

    class Scaled(kit.nn.Module):
        """``linear(x) * factor``: a block whose inner Linear may overflow float16 while
        the block's own output fits it."""

        def __init__(self, w, factor):
            super().__init__()
            w = np.asarray(w, np.float32)
            self.linear = kit.nn.Linear(w.shape[1], w.shape[0])
            kit.assign(self.linear.weight, w)
            kit.assign(self.linear.bias, np.zeros(w.shape[0], np.float32))
            self.factor = factor

        def forward(self, x):
            return self.linear(x) * self.factor

    class PinNet(kit.nn.Module):
        """fc1 -> block (Linear, then a factor) -> head; ``seen`` records each output's
        dtype."""

        def __init__(self, w_fc1, w_block, factor, w_head):
            super().__init__()
            self.fc1 = kit.nn.Linear(4, 4)
            self.block = Scaled(w_block, factor)
            self.head = kit.nn.Linear(4, 1)
            for layer, w in ((self.fc1, w_fc1), (self.head, w_head)):
                w = np.asarray(w, np.float32)
                kit.assign(layer.weight, w)
                kit.assign(layer.bias, np.zeros(w.shape[0], np.float32))
            self.seen = {}

        def forward(self, x):
            for name in ("fc1", "block", "head"):
                x = getattr(self, name)(x)
                # Rebound, not written into: dynamo breaks the graph on a dict written
                # while it holds a mappingproxy (the pinned forward's class dict), and a
                # graph break inside an amp.autocast block raises (docs/COMPILE.md).
                self.seen = {**self.seen, name: kit.dtype_name(x)}
            return x

    # Pickle finds a class by its module and name; the pinning tests pickle this model,
    # so both classes are published in the kit's module (once per framework).
    module = sys.modules[type(kit).__module__]
    for cls in (Scaled, PinNet):
        cls.__module__ = module.__name__
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, getattr(module, cls.__name__, cls))
    return module.PinNet
