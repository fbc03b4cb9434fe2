"""The ledger's path before ``scaler/`` was a package: scalers pickled then name
``unified_amp._ledger.GradLedger`` (tests/test_structure.py loads one)."""

from .scaler._ledger import GradLedger
from .scaler._iteration import Check

__all__ = ["Check", "GradLedger"]
