"""The MegEngine contract-test kit: the shared construction kit plus the dtype table's
ops. Tests run with the default device set to the test's device (``Kit.on_device``), as a
MegEngine user targeting it would: ops only combine tensors on one comp node, and
MegEngine's own code (optimizers, modules) makes tensors on the default device."""

import numpy as np

import megengine as mge
import megengine.functional as F
import megengine.module as M

from examples.frameworks import MegEngineKit

from .base import ContractKit


class Kit(ContractKit, MegEngineKit):
    def host_reads(self):
        """The tensor methods that read values back to the host."""
        return mge.Tensor, ("item", "tolist", "numpy")

    # -- the dtype table ---------------------------------------------------------------
    def run_op(self, row, inp, dev, low, kind):
        def x_(a):
            return self.tensor(a, dev, low if kind == "low" else "float32")

        def w_(a):
            return self.tensor(a, dev, "float32")

        c4 = lambda a: w_(np.asarray(a).reshape(1, -1, 1, 1))  # MegEngine's (1, C, 1, 1)
        ops = {
            "matmul": lambda: F.matmul(x_(inp["x"]), w_(inp["w"]), transpose_b=True),
            "linear": lambda: F.nn.linear(x_(inp["x"]), w_(inp["w"]), w_(inp["b"])),
            "conv2d": lambda: F.conv2d(x_(inp["img"]), w_(inp["cw"]), c4(inp["cb"])),
            "batched matmul": lambda: F.matmul(x_(inp["a3"]), w_(inp["b3"])),
            "softmax": lambda: F.softmax(x_(inp["x"]), axis=-1),
            "log-softmax": lambda: F.logsoftmax(x_(inp["x"]), axis=-1),
            "cross-entropy": lambda: F.nn.cross_entropy(
                x_(inp["x"]), self.labels(inp["labels"], dev)),
            "binary cross-entropy with logits": lambda: F.nn.binary_cross_entropy(
                x_(inp["x"]), w_(inp["targets"]), with_logits=True),
            "MSE": lambda: F.nn.square_loss(x_(inp["x"]), w_(inp["x"])),
            "sum": lambda: x_(inp["x"]).sum(),
            "mean": lambda: x_(inp["x"]).mean(),
            "exp": lambda: F.exp(x_(inp["x"])),
            "log": lambda: F.log(x_(inp["pos"])),
            "batch norm": lambda: F.nn.batch_norm(
                x_(inp["img"]), c4(inp["bn_mean"]), c4(inp["bn_var"]), c4(inp["bn_w"]),
                c4(inp["bn_b"]), training=True),
            "max pool": lambda: F.max_pool2d(x_(inp["img"]), 2),
            "average pool": lambda: F.avg_pool2d(x_(inp["img"]), 2),
            "global average pool": lambda: F.adaptive_avg_pool2d(x_(inp["img"]), (1, 1)),
            "layer norm": lambda: F.nn.layer_norm(x_(inp["x"]), (8,), True, w_(inp["ln_w"]),
                                                  w_(inp["ln_b"])),
            "add low+float32": lambda: self.tensor(inp["x"], dev, low) + w_(inp["x"]),
        }
        return ops[row]()

    def run_module(self, row, inp, dev, low):
        x = self.tensor(inp["x"], dev, low)
        img = self.tensor(inp["img"], dev, low)
        with self.on_device(dev):
            if row == "softmax":
                return M.Softmax(axis=-1)(x)
            if row == "batch norm":
                return M.BatchNorm2d(3)(img)
            if row == "layer norm":
                return M.LayerNorm(8)(x)
        raise KeyError(row)
