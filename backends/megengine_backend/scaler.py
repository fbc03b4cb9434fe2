"""No native scaler subclass on MegEngine.

On torch, ``amp.GradScaler(...)`` makes a subclass that is also a
``torch.amp.GradScaler`` (backends/torch_backend/scaler.py), because runners check that
class with ``isinstance``. ``megengine.amp.GradScaler`` has no such callers to satisfy,
and inheriting from it would bring its ``__init__`` and attributes into the core's
state machine, so ``MegEngineBackend`` provides no ``NativeScaler`` capability and
``amp.GradScaler(...)`` is the core's own class (a drop-in by method names:
docs/DROP_IN.md). The module is here so that both adapter packages have the same module
names.
"""
