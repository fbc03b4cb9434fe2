"""A tiny framework-free backend: tensors are lists of floats. It lets the core (registry,
autocast, GradManager, GradScaler, forensics) be tested without torch or MegEngine, and
counts the device-to-host syncs the core asks for: ``syncs`` for the scaler's flag reads,
``forensic_reads`` and ``flags_made`` for the overflow forensics."""

from __future__ import annotations

import math

from unified_amp.errors import UnsupportedPrecisionError


class FakeTensor:
    def __init__(self, values, dtype="float32", deps=None):
        self.values = [float(v) for v in values]
        self.dtype = dtype
        self.grad = None
        self.shape = (len(self.values),)
        self.deps = deps or []  # (param, coefficients): d self / d param

    def item(self):
        return self.values[0]

    def __repr__(self):
        return f"FakeTensor({self.values}, {self.dtype})"


def linear_loss(params, coeffs):
    """A scalar 'loss' = sum_i coeffs[i] . params[i], with its derivative recorded."""
    total = sum(c * v for p, cs in zip(params, coeffs) for c, v in zip(cs, p.values))
    return FakeTensor([total], deps=list(zip(params, coeffs)))


class _Handle:
    def __init__(self, hooks, key):
        self.hooks, self.key = hooks, key

    def remove(self):
        self.hooks.pop(self.key, None)


class FakeModule:
    """A module with children, parameters and torch's/MegEngine's forward-hook calls.

    ``FakeModule(scale=w)`` multiplies its input by a parameter ``weight`` = [w]; its
    output is in the fake autocast dtype, and a float16 value past 65504 becomes inf.
    ``FakeModule(**children)`` runs its children in order.
    """

    _next_key = 0

    def __init__(self, scale=None, backend=None, **children):
        self.children = children
        self.weight = None if scale is None else FakeTensor([scale])
        self.backend = backend
        self._forward_hooks, self._forward_pre_hooks = {}, {}

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self.children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self):
        for name, module in self.named_modules():
            if module.weight is not None:
                yield (f"{name}.weight" if name else "weight"), module.weight

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def _hook(self, hooks, hook):
        FakeModule._next_key += 1
        hooks[FakeModule._next_key] = hook
        return _Handle(hooks, FakeModule._next_key)

    def forward(self, x):
        if self.weight is None:
            for child in self.children.values():
                x = child(x)
            return x
        enabled, dtype = self.backend.autocast_state[-1] if self.backend else (False, None)
        dtype = (dtype or "float16") if enabled else "float32"
        values = [v * self.weight.values[0] for v in x.values]
        if dtype == "float16":
            values = [math.copysign(math.inf, v) if abs(v) > 65504 else v for v in values]
        return FakeTensor(values, dtype)

    def __call__(self, x):
        for hook in list(self._forward_pre_hooks.values()):
            hook(self, (x,))
        out = self.forward(x)
        for hook in list(self._forward_hooks.values()):
            hook(self, (x,), out)
        return out


class FakeOptimizer:
    """Plain SGD that records each step."""

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.steps = 0

    def step(self, *args, **kwargs):
        self.steps += 1
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p.values = [v - self.param_groups[0]["lr"] * g
                            for v, g in zip(p.values, p.grad.values)]
        return "stepped"


class _Tape:
    def __init__(self):
        self.params = []
        self.recording = False

    def attach(self, params):
        self.params.extend(params)

    def record(self):
        self.recording = True

    def release(self):
        self.recording = False

    def backward(self, ys, dys):
        attached = {id(p) for p in self.params}
        for i, y in enumerate(ys):
            dy = 1.0 if dys is None else dys[i].values[0]
            for p, coeffs in y.deps:
                if id(p) not in attached:
                    continue
                g = [dy * c for c in coeffs]
                if p.grad is None:
                    p.grad = FakeTensor(g, p.dtype)
                else:
                    p.grad.values = [a + b for a, b in zip(p.grad.values, g)]


class FakeBackend:
    name = "fake"

    def __init__(self):
        self.syncs = 0
        self.forensic_reads = 0
        self.flags_made = 0
        self.autocast_state = [(False, None)]  # (enabled, dtype), innermost last
        self.refuse = {"bfloat16"}

    def cuda_available(self):
        return False

    def dtype_name(self, dtype):
        return dtype if dtype in ("float16", "bfloat16", "float32") else None

    def check_precision(self, dtype, device):
        if dtype in self.refuse:
            raise UnsupportedPrecisionError(f"fake backend cannot compute {dtype}")

    def enter_autocast(self, enabled, dtype, device, contract=True):
        self.autocast_state.append((enabled, dtype))
        return len(self.autocast_state) - 1

    def exit_autocast(self, token):
        assert token == len(self.autocast_state) - 1, "autocast exits out of order"
        self.autocast_state.pop()

    def is_autocast_enabled(self):
        return self.autocast_state[-1][0]

    def new_tape(self):
        return _Tape()

    def is_tensor(self, obj):
        return isinstance(obj, FakeTensor)

    def grads(self, params):
        return [p.grad for p in params if p.grad is not None]

    def drop_grads(self, params):
        for p in params:
            p.grad = None

    def clip_grad_norm(self, params, max_norm, norm_type):
        grads = self.grads(params)
        norm = math.sqrt(sum(v * v for g in grads for v in g.values))
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in grads:
            g.values = [v * coef for v in g.values]
        return norm

    def scale(self, y, scale):
        return FakeTensor([v * scale for v in y.values], y.dtype,
                          deps=[(p, [c * scale for c in cs]) for p, cs in y.deps])

    def scaled_cotangents(self, ys, dys, scale):
        if dys is None:
            return [FakeTensor([scale]) for _ in ys]
        return [FakeTensor([d.values[0] * scale]) for d in dys]

    def unscale_and_check(self, grads, inv_scale):
        found = False
        for g in grads:
            g.values = [v * inv_scale for v in g.values]
            found = found or not all(math.isfinite(v) for v in g.values)
        return {"found": found}

    def flag_is_set(self, flag):
        self.syncs += 1
        return flag["found"]

    # -- overflow forensics ----------------------------------------------------------
    def nonfinite_counts(self, tensors):
        self.forensic_reads += 1
        return [(sum(math.isinf(v) for v in t.values), sum(math.isnan(v) for v in t.values))
                for t in tensors]

    def finite_flag(self, tensor, per_row=False):
        self.flags_made += 1
        if per_row:  # a FakeTensor is one row per value
            return [math.isfinite(v) for v in tensor.values]
        return [all(math.isfinite(v) for v in tensor.values)]

    def read_finite_flags(self, flags):
        self.forensic_reads += 1
        return [list(f) for f in flags]

    def is_module(self, obj):
        return isinstance(obj, FakeModule)

    def named_modules(self, model):
        return list(model.named_modules())

    def named_parameters(self, model):
        return list(model.named_parameters())

    def add_forward_hook(self, module, hook, pre=False):
        return module._hook(module._forward_pre_hooks if pre else module._forward_hooks, hook)
