"""Test kits: the framework-specific half of the contract tests.

The contract suite is written once against unified_amp's public API; what it cannot
write generically -- making tensors, a small model, an optimizer, reading numbers back --
comes from the construction kit the examples and benchmarks use too
(``examples.frameworks``), plus the few test-only pieces here (``base.ContractKit`` and
each framework's dtype-table ops).
"""

import importlib


def load_kit(backend_name: str):
    module = importlib.import_module(f"tests.kits.{backend_name}_kit")
    return module.Kit()
