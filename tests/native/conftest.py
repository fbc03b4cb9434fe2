"""Tests of one framework's native API (drop-in fidelity against its own GradScaler,
torch's fused optimizers and CUDA syncs). Each file needs its framework: `make test` runs
test_torch_* in .venv-torch and test_megengine_* in .venv-megengine. Files whose
framework is absent from this interpreter are not collected here; they run in the other
environment."""

import importlib.util

collect_ignore_glob = [
    f"test_{name}_*.py"
    for name in ("torch", "megengine")
    if importlib.util.find_spec(name) is None
]
