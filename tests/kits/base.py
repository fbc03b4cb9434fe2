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
