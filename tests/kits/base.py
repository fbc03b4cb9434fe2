"""What the two test kits share; each subclass supplies the framework's ops."""

import numpy as np


class KitBase:
    def mlp(self, sizes, dev, seed):
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

    @staticmethod
    def apex_weights(sizes, seed):
        """(fc1 weight, fc1 bias, fc2 weight, fc2 bias) for ``apex_model``, from numpy."""
        rng = np.random.RandomState(seed)
        (n_in, hidden, n_out) = sizes
        return (rng.randn(hidden, n_in) / np.sqrt(n_in), rng.randn(hidden) * 0.1,
                rng.randn(n_out, hidden) / np.sqrt(hidden), np.zeros(n_out))
