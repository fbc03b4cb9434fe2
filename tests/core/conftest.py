import pytest

import unified_amp as amp
from unified_amp import _registry

from .fake_backend import CapableFakeBackend, FakeBackend


def _selected(backend):
    amp.register_backend("fake", lambda: backend)
    amp.set_backend("fake")
    yield backend
    _registry._reset_for_tests()


@pytest.fixture
def fake():
    """A fresh fake backend with the required core only, selected for the test and
    forgotten afterwards."""
    yield from _selected(FakeBackend())


@pytest.fixture
def capable_fake():
    """The same with the optional capabilities of opt levels and overflow forensics."""
    yield from _selected(CapableFakeBackend())
