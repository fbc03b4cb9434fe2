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

    def grads_of(self, fn, leaves, block):
        """The dtypes of ``leaves``' gradients from a backward pass through ``fn()`` run
        inside ``block()`` (None where a leaf gets none)."""
        from megengine.autodiff import GradManager

        gm = GradManager().attach(leaves)
        with gm:
            with block():
                out = fn()
            gm.backward(out.astype("float32").sum())
        self.synchronize()  # an asynchronous failure is this call's
        return [None if t.grad is None else self.dtype_name(t.grad) for t in leaves]

    def call_scope(self):
        """The names the dtype table's MegEngine sample calls use besides its tensors."""
        return {"F": F, "mge": mge}
