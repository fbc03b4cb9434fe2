"""The torch contract-test kit: the shared construction kit plus the dtype-table rows
that torch spells its own way."""

import torch
import torch.nn.functional as F

from examples.frameworks import TorchKit

from .base import ContractKit


class Kit(ContractKit, TorchKit):
    def compile_forward(self, fn):
        """``fn`` compiled as a torch user would (aot_eager: the graphs without
        inductor's compile time), in one graph: a graph break fails the test."""
        return torch.compile(fn, backend="aot_eager", fullgraph=True)

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

    def grads_of(self, fn, leaves, block):
        """The dtypes of ``leaves``' gradients from a backward pass through ``fn()`` run
        inside ``block()`` (None where a leaf gets none)."""
        with block():
            out = fn()
        if not out.requires_grad:
            return [None] * len(leaves)
        grads = torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)
        return [None if g is None else self.dtype_name(g) for g in grads]

    def call_scope(self):
        """The names the dtype table's torch sample calls use besides its tensors."""
        return {"torch": torch, "F": F}
