"""Drop-in tests compare unified_amp against one framework's native scaler, so each file
needs that framework: `make test` runs the torch file in .venv-torch and the MegEngine
file in .venv-megengine. A file whose framework is absent from this interpreter is not
collected here; it runs in the other environment."""

import importlib.util

collect_ignore = [
    f"test_{name}_dropin.py"
    for name in ("torch", "megengine")
    if importlib.util.find_spec(name) is None
]
