"""The contract suite's two dimensions: the backend (UNIFIED_AMP_BACKEND, one per pytest
process) and the device (CPU always; CUDA when the framework sees a GPU)."""

import pytest

import unified_amp as amp
from unified_amp import _registry

from ..kits import load_kit

NO_CUDA = {
    "torch": "torch sees no CUDA device here; these run on a GPU machine",
    "megengine": "MegEngine sees no CUDA device (a CPU build or no GPU); these run where a"
                 " CUDA build of MegEngine is installed",
}


@pytest.fixture(scope="session")
def backend():
    return amp.get_backend()


@pytest.fixture(scope="session")
def kit(backend):
    return load_kit(backend.name)


@pytest.fixture(params=["cpu", "cuda"])
def device(request, kit):
    if request.param == "cuda" and not kit.has_cuda():
        pytest.skip(NO_CUDA[kit.name])
    with kit.on_device(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _real_backend(backend):
    """Core tests may have selected the fake backend; contract tests use the real one."""
    _registry._reset_for_tests()
    assert amp.get_backend() is backend
    yield
    assert not amp.is_autocast_enabled(), "a test leaked an enabled autocast block"


@pytest.fixture(scope="session", autouse=True)
def _no_pending_device_errors(kit):
    """Fails the run if a kernel failed asynchronously and would only surface at exit."""
    yield
    kit.synchronize()
