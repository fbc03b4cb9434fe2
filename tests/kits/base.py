"""What only the contract tests build, written once for both frameworks on top of the
shared construction kit (``examples.frameworks``)."""

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
            return self.place(self._apex_net()(self.apex_weights(sizes, seed), batch_norm),
                              dev)

    def batch_norm_weight(self, model):
        return model.bn.weight

    def _apex_net(self):
        """The ``ApexNet`` class on this kit's framework (made once per kit)."""
        if "_apex_net_class" in vars(self):
            return self._apex_net_class
        kit = self

        class ApexNet(kit.nn.Module):
            """Linear - BatchNorm1d - ReLU - Linear; ``seen`` records the dtypes inside
            forward."""

            def __init__(self, weights, batch_norm):
                super().__init__()
                w1, b1, w2, b2 = (np.asarray(a, np.float32) for a in weights)
                self.fc1 = kit.nn.Linear(w1.shape[1], w1.shape[0])
                self.bn = kit.nn.BatchNorm1d(w1.shape[0]) if batch_norm else kit.nn.Identity()
                self.fc2 = kit.nn.Linear(w2.shape[1], w2.shape[0])
                for p, a in zip((self.fc1.weight, self.fc1.bias, self.fc2.weight,
                                 self.fc2.bias), (w1, b1, w2, b2)):
                    kit.assign(p, a)
                self.seen = {}

            def forward(self, x):
                self.seen["inputs in the model"] = kit.dtype_name(x)
                h = self.fc1(x)
                self.seen["activations"] = kit.dtype_name(h)
                h = self.bn(h)
                self.seen["batch norm output"] = kit.dtype_name(h)
                return self.fc2(kit.relu(h))

        self._apex_net_class = ApexNet
        return ApexNet
