"""The torch contract-test kit: the shared construction kit plus the dtype table's ops."""

import torch
import torch.nn.functional as F

from examples.frameworks import TorchKit

from .base import ContractKit


class Kit(ContractKit, TorchKit):
    def host_reads(self):
        """The tensor methods that read values back to the host."""
        return torch.Tensor, ("item", "tolist", "numpy")

    # -- the dtype table ---------------------------------------------------------------
    def run_op(self, row, inp, dev, low, kind):
        def x_(a):  # the op's data input: float32, or the autocast dtype
            return self.tensor(a, dev, low if kind == "low" else "float32")

        def w_(a):  # weights stay float32, as parameters do
            return self.tensor(a, dev, "float32")

        ops = {
            "matmul": lambda: x_(inp["x"]) @ w_(inp["w"]).t(),
            "linear": lambda: F.linear(x_(inp["x"]), w_(inp["w"]), w_(inp["b"])),
            "conv2d": lambda: F.conv2d(x_(inp["img"]), w_(inp["cw"]), w_(inp["cb"])),
            "batched matmul": lambda: torch.matmul(x_(inp["a3"]), w_(inp["b3"])),
            "softmax": lambda: F.softmax(x_(inp["x"]), dim=-1),
            "log-softmax": lambda: F.log_softmax(x_(inp["x"]), dim=-1),
            "cross-entropy": lambda: F.cross_entropy(
                x_(inp["x"]), self.labels(inp["labels"], dev)),
            "binary cross-entropy with logits": lambda: F.binary_cross_entropy_with_logits(
                x_(inp["x"]), w_(inp["targets"])),
            "MSE": lambda: F.mse_loss(x_(inp["x"]), w_(inp["x"])),
            "sum": lambda: x_(inp["x"]).sum(),
            "mean": lambda: x_(inp["x"]).mean(),
            "exp": lambda: x_(inp["x"]).exp(),
            "log": lambda: x_(inp["pos"]).log(),
            "batch norm": lambda: F.batch_norm(
                x_(inp["img"]), w_(inp["bn_mean"]), w_(inp["bn_var"]), w_(inp["bn_w"]),
                w_(inp["bn_b"]), training=True),
            "max pool": lambda: F.max_pool2d(x_(inp["img"]), 2),
            "average pool": lambda: F.avg_pool2d(x_(inp["img"]), 2),
            "global average pool": lambda: F.adaptive_avg_pool2d(x_(inp["img"]), 1),
            "layer norm": lambda: F.layer_norm(x_(inp["x"]), (8,), w_(inp["ln_w"]),
                                               w_(inp["ln_b"])),
            "add low+float32": lambda: self.tensor(inp["x"], dev, low) + w_(inp["x"]),
        }
        return ops[row]()

    def run_module(self, row, inp, dev, low):
        """The module spelling of a row, on a low-precision input."""
        x = self.tensor(inp["x"], dev, low)
        img = self.tensor(inp["img"], dev, low)
        if row == "softmax":
            return torch.nn.Softmax(dim=-1)(x)
        if row == "batch norm":
            return torch.nn.BatchNorm2d(3).to(dev)(img)
        if row == "layer norm":
            return torch.nn.LayerNorm(8).to(dev)(x)
        raise KeyError(row)
