"""The MegEngine contract-test kit: the shared construction kit plus the dtype-table rows
that MegEngine spells its own way. Tests run with the default device set to the test's
device (``Kit.on_device``), as a MegEngine user targeting it would: ops only combine
tensors on one comp node, and MegEngine's own code (optimizers, modules) makes tensors on
the default device."""

import numpy as np

import megengine as mge
import megengine.functional as F
import megengine.module as M

from examples.frameworks import MegEngineKit

from .base import ContractKit


class Kit(ContractKit, MegEngineKit):
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

    def own_ops(self, x_, w_, inp, dev):
        """The dtype table's rows in MegEngine's spelling (see ``ContractKit.run_op``)."""
        c4 = lambda a: w_(np.asarray(a).reshape(1, -1, 1, 1))  # MegEngine's (1, C, 1, 1)
        return {
            "conv2d": lambda: F.conv2d(x_(inp["img"]), w_(inp["cw"]), c4(inp["cb"])),
            "log-softmax": lambda: F.logsoftmax(x_(inp["x"]), axis=-1),
            "binary cross-entropy with logits": lambda: F.nn.binary_cross_entropy(
                x_(inp["x"]), w_(inp["targets"]), with_logits=True),
            "exp": lambda: F.exp(x_(inp["x"])),
            "log": lambda: F.log(x_(inp["pos"])),
            "batch norm": lambda: F.nn.batch_norm(
                x_(inp["img"]), c4(inp["bn_mean"]), c4(inp["bn_var"]), c4(inp["bn_w"]),
                c4(inp["bn_b"]), training=True),
            "global average pool": lambda: F.adaptive_avg_pool2d(x_(inp["img"]), (1, 1)),
            "layer norm": lambda: F.nn.layer_norm(x_(inp["x"]), (8,), True, w_(inp["ln_w"]),
                                                  w_(inp["ln_b"])),
        }
