"""No device-resident scale on MegEngine.

torch keeps the scale in a device tensor for optimizers that skip a step on the device
by themselves (its ``fused=True`` Adam, AdamW and SGD read ``grad_scale`` and
``found_inf``; backends/torch_backend/device_scale.py). No MegEngine 1.13 optimizer
does: every step is decided on the host, with the one flag read per step. So
``MegEngineBackend`` provides no ``DeviceResident`` capability and the scaler keeps its
scale as a Python float. The module is here so that both adapter packages have the same
module names.
"""
