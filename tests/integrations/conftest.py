"""The runners people train with, each run twice in its own loop: once with its
framework's scaler, once with unified_amp's. `make test-integrations` runs this folder in
its own environments (.venv-integrations-torch, .venv-integrations-megengine), which hold
the runners at the versions in constraints/integrations-*.txt; `make test`'s
environments hold no runner, so there each file whose runner (or framework) is absent
is not collected. Under `make test-integrations` (UNIFIED_AMP_REQUIRE_RUNNERS=1) an absent
runner is an error instead: that run must not pass by collecting nothing. The real models'
file (torchvision, timm, transformers) runs in .venv-integrations-models, which needs a
torch of its own, with UNIFIED_AMP_REQUIRE_MODELS=1 making an absent package an error."""

import importlib.util
import os

# file -> the modules it needs
NEEDS = {
    "test_torch_lightning.py": ("torch", "pytorch_lightning"),
    "test_torch_fabric.py": ("torch", "lightning_fabric"),
    "test_torch_ignite.py": ("torch", "ignite"),
    "test_torch_enchanter.py": ("torch", "enchanter"),
    "test_torch_accelerate.py": ("torch", "accelerate"),
    "test_megengine_basecore.py": ("megengine", "basecore"),
}
MODEL_NEEDS = {"test_torch_models.py": ("torch", "torchvision", "timm", "transformers")}
REQUIRED_BY = {"UNIFIED_AMP_REQUIRE_RUNNERS": NEEDS, "UNIFIED_AMP_REQUIRE_MODELS": MODEL_NEEDS}


def _missing(modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


collect_ignore = []
for _variable, _needs in REQUIRED_BY.items():
    for _file, _modules in _needs.items():
        _absent = _missing(_modules)
        if not _absent:
            continue
        _framework_here = importlib.util.find_spec(_modules[0]) is not None
        if os.environ.get(_variable) == "1" and _framework_here:
            raise RuntimeError(
                f"tests/integrations/{_file} needs {', '.join(_absent)}, which this"
                " environment lacks: `make test-integrations` installs them"
                " (constraints/integrations-*.txt)")
        collect_ignore.append(_file)


def pytest_configure(config):
    # ignite's own modules, as it imports: nothing a test here can act on.
    for message in ("`torch.jit.script` is deprecated", "`torch.jit.interface` is deprecated"):
        config.addinivalue_line("filterwarnings", f"ignore:{message}:DeprecationWarning")
