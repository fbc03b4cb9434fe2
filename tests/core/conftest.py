import pytest

import unified_amp as amp
from unified_amp import _registry

from .fake_backend import FakeBackend


@pytest.fixture
def fake():
    """A fresh fake backend, selected for the test and forgotten afterwards."""
    backend = FakeBackend()
    amp.register_backend("fake", lambda: backend)
    amp.set_backend("fake")
    yield backend
    _registry._reset_for_tests()
