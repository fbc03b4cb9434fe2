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

    def own_ops(self, x_, w_, inp, dev):
        """The dtype table's rows in torch's spelling (see ``ContractKit.run_op``)."""
        return {
            "conv2d": lambda: F.conv2d(x_(inp["img"]), w_(inp["cw"]), w_(inp["cb"])),
            "log-softmax": lambda: F.log_softmax(x_(inp["x"]), dim=-1),
            "binary cross-entropy with logits": lambda: F.binary_cross_entropy_with_logits(
                x_(inp["x"]), w_(inp["targets"])),
            "exp": lambda: x_(inp["x"]).exp(),
            "log": lambda: x_(inp["pos"]).log(),
            "batch norm": lambda: F.batch_norm(
                x_(inp["img"]), w_(inp["bn_mean"]), w_(inp["bn_var"]), w_(inp["bn_w"]),
                w_(inp["bn_b"]), training=True),
            "global average pool": lambda: F.adaptive_avg_pool2d(x_(inp["img"]), 1),
            "layer norm": lambda: F.layer_norm(x_(inp["x"]), (8,), w_(inp["ln_w"]),
                                               w_(inp["ln_b"])),
        }
