"""GradScaler: the public class, and the state machine it holds.

Read in this order:

- ``_grad_scaler.py``  ``GradScaler``: the call forms of torch.amp and megengine.amp,
  argument checks, checkpoints; every operation goes to the machine it holds, and its
  overflow forensics (unified_amp/forensics.py, subscribed by unified_amp/__init__)
  listens to that machine.
- ``_machine.py``      ``ScalerMachine``: the state machine -- every transition
  (``scale``, ``backward(gm, loss)``, ``unscale``, ``step``, ``update``), each written
  top to bottom, and what it announces to listeners.
- the parts the machine holds: ``_iteration.py`` (what one iteration records: each
  optimizer's stage, every check, how the scale went out), ``_state.py`` (the scale
  and its telemetry),
  ``_ledger.py`` (which gradient generations were unscaled, by which check) and
  ``_targets.py`` (the parameters of an optimizer, module or list); the scale rule is
  ``unified_amp/_scale_rule.py``, below both the scaler and the trace policy;
- beside the class: ``_call_forms.py`` (torch.amp's and megengine.amp's signatures) and
  ``_adapter_view.py`` (what an adapter's subclass may read).
"""

from ._adapter_view import AdapterView
from ._grad_scaler import GradScaler

__all__ = ["AdapterView", "GradScaler"]
