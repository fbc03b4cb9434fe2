"""A tiny framework-free backend: tensors are lists of floats. It lets the core (registry,
autocast, GradManager, GradScaler, forensics, opt levels) be tested without torch or
MegEngine, and counts the device-to-host syncs the core asks for: ``syncs`` for the
scaler's flag reads, ``forensic_reads`` and ``flags_made`` for the overflow forensics.

``FakeBackend`` implements the required core (``unified_amp.interface.Backend``) and
nothing more: the scaler, autocast and GradManager tests run on it, which proves that
core enough for them. ``CapableFakeBackend`` adds the optional capabilities that opt
levels and overflow forensics need (``unified_amp.capabilities``), for their tests."""

from __future__ import annotations

import collections
import math
import struct
import threading
from typing import TYPE_CHECKING

from unified_amp import capabilities, interface
from unified_amp.errors import UnsupportedPrecisionError


def round_to(values, dtype):
    """``values`` rounded to ``dtype`` (float16 overflows to inf, as a real cast does)."""
    if dtype == "float16":
        out = []
        for v in values:
            try:
                out.append(struct.unpack("e", struct.pack("e", v))[0])
            except OverflowError:
                out.append(math.copysign(math.inf, v))
        return out
    if dtype == "bfloat16":  # the top 16 bits of the float32 pattern, round to nearest even
        out = []
        for v in values:
            if not math.isfinite(v):
                out.append(v)
                continue
            bits = struct.unpack("I", struct.pack("f", v))[0]
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            out.append(struct.unpack("f", struct.pack("I", bits))[0])
        return out
    return [float(v) for v in values]


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


class NamedModule:
    """A module with named children and parameters, calling forward hooks as torch's and
    MegEngine's modules do (for the forensics tests).

    ``NamedModule(scale=w)`` multiplies its input by a parameter ``weight`` = [w]; its
    output is in the fake autocast dtype, and a float16 value past 65504 becomes inf.
    ``NamedModule(**children)`` runs its children in order.
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
        NamedModule._next_key += 1
        hooks[NamedModule._next_key] = hook
        return _Handle(hooks, NamedModule._next_key)

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
    """Plain SGD that records each step, with a per-parameter step count as its state."""

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state = {}
        self.steps = 0

    def step(self, *args, **kwargs):
        self.steps += 1
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p.values = round_to([v - self.param_groups[0]["lr"] * g
                                     for v, g in zip(p.values, p.grad.values)], p.dtype)
                self.state[p] = self.state.get(p, 0) + 1
        return "stepped"

    def state_dict(self):
        params = self.param_groups[0]["params"]
        return {"state": {i: self.state[p] for i, p in enumerate(params) if p in self.state},
                "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state_dict):
        params = self.param_groups[0]["params"]
        self.state = {params[i]: n for i, n in state_dict["state"].items()}
        self.param_groups[0]["lr"] = state_dict["lr"]


class FakeModule:
    """A 'model': out = sum over its parameters p of p . x (each p as long as x), in the
    autocast dtype when autocast is on, else in the input's dtype. Records what its
    forward saw."""

    def __init__(self, params, children=(), batch_norm=False, backend=None):
        self._params = list(params)
        self._children = list(children)
        self.batch_norm = batch_norm
        self.backend = backend
        self.seen = []  # (input dtype, autocast dtype or None) per call

    def parameters(self):
        yield from self._params
        for child in self._children:
            yield from child.parameters()

    def modules(self):
        yield self
        for child in self._children:
            yield from child.modules()

    def named_modules(self, prefix=""):
        yield prefix, self
        for i, child in enumerate(self._children):
            yield from child.named_modules(f"{prefix}.{i}" if prefix else str(i))

    def forward(self, x):
        enabled, dtype = self.backend.autocast_state[-1]
        self.seen.append((x.dtype, dtype if enabled else None))
        params = list(self.parameters())
        total = sum(w * v for p in params for w, v in zip(p.values, x.values))
        out_dtype = (dtype or "float16") if enabled else x.dtype
        return FakeTensor(round_to([total], out_dtype), out_dtype,
                          deps=[(p, list(x.values)) for p in params])

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class _Tape:
    def __init__(self):
        self.params = []
        self.callbacks = {}
        self.recording = False

    def attach(self, params, callbacks=()):
        known = {id(p) for p in self.params}
        self.params.extend(p for p in params if id(p) not in known)
        for p in params:
            self.callbacks.setdefault(id(p), []).extend(callbacks)

    def record(self):
        self.recording = True

    def release(self):
        self.recording = False

    def backward(self, ys, dys):
        attached = {id(p) for p in self.params}
        new = {}  # id(param) -> (param, this backward's gradient values)
        for i, y in enumerate(ys):
            dy = 1.0 if dys is None else dys[i].values[0]
            for p, coeffs in y.deps:
                if id(p) not in attached:
                    continue
                g = [dy * c for c in coeffs]
                if id(p) in new:
                    g = [a + b for a, b in zip(new[id(p)][1], g)]
                new[id(p)] = (p, g)
        for p, g in new.values():
            grad = FakeTensor(round_to(g, p.dtype), p.dtype)
            if hasattr(p, "kind"):  # a DTensor's gradient is a DTensor
                grad.kind = p.kind
            for callback in self.callbacks.get(id(p), ()):
                grad = callback(p, grad)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.values = round_to([a + b for a, b in zip(p.grad.values, grad.values)],
                                         p.dtype)


class FakeBackend(interface.Backend):
    """The required core, and nothing more."""

    name = "fake"

    def __init__(self):
        self.syncs = 0
        self.autocast_state = [(False, None)]  # (enabled, dtype), innermost last
        # (enabled, dtype, device, contract) -> a stand-in object amp.autocast(...) returns
        self.native_blocks = {}
        self.refuse = {"bfloat16"}

    def cuda_available(self):
        return False

    def dtype_name(self, dtype):
        return dtype if dtype in ("float16", "bfloat16", "float32") else None

    def device_type(self, tensor):
        return "cpu"

    def is_tensor(self, obj):
        return isinstance(obj, FakeTensor)

    def is_module(self, obj):
        return isinstance(obj, (FakeModule, NamedModule))

    def named_modules(self, model):
        return list(model.named_modules())

    def cast(self, tensor, dtype):
        if tensor.dtype == dtype:
            return tensor
        return FakeTensor(round_to(tensor.values, dtype), dtype, deps=tensor.deps)

    def check_precision(self, dtype, device):
        if dtype in self.refuse:
            raise UnsupportedPrecisionError(f"fake backend cannot compute {dtype}")

    def native_autocast(self, enabled, dtype, device, contract):
        return self.native_blocks.get((enabled, dtype, device, contract))

    def prepare_rules(self, rules):
        pass

    def enter_autocast(self, enabled, dtype, device, contract=True, rules=()):
        self.autocast_state.append((enabled, dtype))
        return len(self.autocast_state) - 1

    def exit_autocast(self, token):
        assert token == len(self.autocast_state) - 1, "autocast exits out of order"
        self.autocast_state.pop()

    def is_autocast_enabled(self):
        return self.autocast_state[-1][0]

    def autocast_low_dtype(self, device):
        enabled, dtype = self.autocast_state[-1]
        return (dtype or "float16") if enabled else None

    def new_tape(self):
        return _Tape()

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

    def unscale_and_check(self, grads, inv_scale, allow_float16=False):
        if not allow_float16 and any(g.dtype == "float16" for g in grads):
            raise ValueError("the fake check refuses float16 unless allowed")
        found = False
        for g in grads:
            g.values = [v * inv_scale for v in g.values]
            found = found or not all(math.isfinite(v) for v in g.values)
        return {"found": found}

    def flag_is_set(self, flag):
        self.syncs += 1
        return flag["found"]


class CapableFakeBackend(FakeBackend, capabilities.OptLevelCasting,
                         capabilities.ForensicsProbes):
    """The fake with the optional capabilities of opt levels and overflow forensics."""

    def __init__(self):
        super().__init__()
        self.forensic_reads = 0
        self.flags_made = 0
        self.low_bn = True  # batch norm may hold low-precision weights
        self.low_steps = True  # optimizers may step low-precision parameters

    def default_low_dtype(self, device):
        return "float16"

    def cast_module(self, module, dtype, keep_batchnorm_fp32, skip=()):
        skipped = set()
        for sub in module.modules():
            if id(sub) in skipped or any(sub is m for m in skip):
                skipped.update(id(m) for m in sub.modules())
                continue
            if keep_batchnorm_fp32 and sub.batch_norm:
                continue
            for p in sub._params:
                p.dtype, p.values = dtype, round_to(p.values, dtype)

    def low_precision_batch_norm(self, dtype):
        return self.low_bn

    def steps_low_precision(self, optimizer):
        return self.low_steps

    def master_copy(self, param):
        return FakeTensor(list(param.values), "float32")

    def optimizer_state(self, optimizer):
        return optimizer.state

    def take_grads(self, params):
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    def restore_grads(self, params, grads):
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.values = [a + b for a, b in zip(p.grad.values, g.values)]

    def grads_to_masters(self, params, masters):
        for p, m in zip(params, masters):
            if p.grad is not None:
                m.grad = FakeTensor(list(p.grad.values), "float32")
                p.grad = None

    def copy_params(self, dst, src):
        for d, s in zip(dst, src):
            d.values = round_to(s.values, d.dtype)

    def skipped_step_result(self, optimizer):
        return None

    # -- overflow forensics ----------------------------------------------------------
    def finite_flag(self, tensor, per_row=False):
        self.flags_made += 1
        if per_row:  # a FakeTensor is one row per value
            return [math.isfinite(v) for v in tensor.values]
        return [all(math.isfinite(v) for v in tensor.values)]

    def read_overflow(self, grads, losses, flags):
        self.forensic_reads += 1
        counts = [(sum(math.isinf(v) for v in t.values), sum(math.isnan(v) for v in t.values))
                  for t in grads]
        return counts, [float(loss.item()) for loss in losses], [list(f) for f in flags]

    def named_parameters(self, model):
        return list(model.named_parameters())

    def add_forward_hook(self, module, hook, pre=False):
        return module._hook(module._forward_pre_hooks if pre else module._forward_hooks, hook)


class FakeGroup:
    """A process group for ranks simulated by threads: an all-reduce is a barrier
    exchange. Each rank's collectives are logged, to compare their sequences."""

    def __init__(self, world=2):
        self.world = world
        # The timeout only turns a hang (a rank that skipped a collective) into a
        # failure; no result depends on it.
        self._barrier = threading.Barrier(world, timeout=30)
        self._slots = [None] * world
        self.log = {r: [] for r in range(world)}

    def exchange(self, rank, value, what):
        self.log[rank].append(what)
        self._slots[rank] = value
        self._barrier.wait()
        out = max(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before all have read
        return out


class _FakeWork:
    def __init__(self, group, rank, local, out):
        self.group, self.rank, self.local, self.out = group, rank, local, out
        self.waited = False

    def wait(self):
        self.out["found"] = bool(self.group.exchange(self.rank, self.local, "all_reduce"))
        self.waited = True


class DistributedFakeBackend(CapableFakeBackend, capabilities.Collectives,
                             capabilities.DataParallelHooks):
    """The fake backend with the distributed primitives, for ranks run as threads.

    A tensor's ``kind`` attribute says what grad_kind() reports ("local", "sharded",
    "dtensor"); the fused check over "dtensor" gradients agrees by itself, as torch's
    DTensor dispatch does, so a rank that skips the kernel leaves the others waiting.
    """

    def __init__(self, group=None, world=True):
        super().__init__()
        self.group = group
        self.world = world  # whether world_group() reports the group (an initialised job)
        self._local = threading.local()
        self.syncs_by_rank = collections.Counter()
        self.paused_modules = set()

    @property
    def rank(self):
        return self._local.rank

    @rank.setter
    def rank(self, value):
        self._local.rank = value

    def unscale_and_check(self, grads, inv_scale, allow_float16=False):
        flag = super().unscale_and_check(grads, inv_scale, allow_float16)
        if any(getattr(g, "kind", "local") == "dtensor" for g in grads):
            flag = {"found": bool(self.group.exchange(self.rank, flag["found"], "dtensor"))}
        return flag

    def flag_is_set(self, flag):
        assert flag["found"] is not None, "read a flag before its all-reduce completed"
        self.syncs_by_rank[self.rank] += 1
        return super().flag_is_set(flag)

    def world_group(self):
        return self.group if self.world else None

    def check_group(self, group):
        if not isinstance(group, FakeGroup):
            raise TypeError(f"GradScaler process_group must be a FakeGroup; got {group!r}")

    def grad_kind(self, param):
        return getattr(param, "kind", "local")

    def zero_grad_like(self, param):
        t = FakeTensor([0.0] * len(param.values), param.dtype)
        t.kind = self.grad_kind(param)
        return t

    def clean_flag(self, params, group):
        return {"found": False}

    def all_reduce_max_async(self, flag, group):
        out = {"found": None}
        return out, _FakeWork(group, self.rank, flag["found"], out)

    def grad_sync_paused(self, module):
        return getattr(module, "require_backward_grad_sync", True) is False

    def module_clip_grad_norm(self, module, max_norm, norm_type):
        own = getattr(module, "clip_grad_norm_", None)
        return None if own is None else own(max_norm, norm_type)


if TYPE_CHECKING:  # mypy holds the fake to the same interface as the adapters
    _backend: interface.Backend = FakeBackend()
    _opt_levels: capabilities.OptLevelCasting = CapableFakeBackend()
    _forensics: capabilities.ForensicsProbes = CapableFakeBackend()
    _distributed: interface.Backend = DistributedFakeBackend()
    _collectives: capabilities.Collectives = DistributedFakeBackend()
    _data_parallel: capabilities.DataParallelHooks = DistributedFakeBackend()
