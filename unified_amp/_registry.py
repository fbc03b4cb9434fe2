"""Which framework adapter is active: chosen lazily, cached, never imported early.

Order of precedence: ``set_backend()`` > ``UNIFIED_AMP_BACKEND`` > the first installed
of torch, megengine. Adapters are found through the ``unified_amp.backends`` entry-point
group (so a third party can add one without touching the core), with the two built-in
ones also listed here so a source checkout works without being installed.

The built-in adapters live in the repository's top-level ``backends/``, which an install
(wheel or editable) maps to ``unified_amp.backends``. A checkout that is only on
``sys.path`` has no such mapping: the first adapter lookup binds ``backends/`` under
that name itself (:func:`_bind_checkout_backends`), so the same names import either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, cast

from .errors import BackendUnavailableError, MissingCapabilityError, UnknownBackendError
from .interface import Backend, missing

ENV_VAR = "UNIFIED_AMP_BACKEND"

# name -> (adapter "module:attr", framework module that must be importable, pip extra)
_BUILTIN: dict[str, tuple[str, str, str]] = {
    "torch": ("unified_amp.backends.torch_backend:TorchBackend", "torch", "torch"),
    "megengine": ("unified_amp.backends.megengine_backend:MegEngineBackend", "megengine",
                  "megengine"),
}
# What each extra in pyproject.toml installs: the framework versions the test suite has
# passed on (README, "Supported versions"). The install hints quote them, because no
# package index serves unified_amp itself; tests/test_packaging.py keeps the two equal.
REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "torch": ("torch>=2.7,<2.15",),
    "megengine": ("megengine==1.13.*", "numpy<2", "opencv-python<4.11", "setuptools<80.9"),
}
_AUTO_ORDER = ("torch", "megengine")

_lock = threading.Lock()
_chosen: str | None = None  # set by set_backend()
# The adapter instance in use, or _NONE. A sentinel object rather than None: dynamo
# guards on an object by identity, and None by value, which fails once the first use
# (see _activate) has replaced it during tracing.
_NONE: Any = object()
_active: Any = _NONE  # a Backend once chosen
_instances: "dict[str, Backend]" = {}
_factories: dict[str, Callable[[], Any]] = {}  # register_backend()


def _entry_points() -> dict[str, str]:
    """Adapters registered by installed packages, name -> "module:attr"."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group="unified_amp.backends")}


def _known() -> dict[str, Any]:
    known: dict[str, Any] = {name: target for name, (target, _, _) in _BUILTIN.items()}
    known.update(_entry_points())
    known.update(_factories)
    return known


def register_backend(name: str, factory: Callable[[], Any]) -> None:
    """Adds a backend without packaging it: ``factory()`` returns the adapter.

    Installed packages can instead declare an entry point in the
    ``unified_amp.backends`` group (``name = "module:Class"``).
    """
    if not isinstance(name, str) or not name.strip() or not callable(factory):
        raise TypeError("register_backend(name, factory) takes a non-empty str and a callable.")
    with _lock:
        _factories[name.strip().lower()] = factory
        _instances.pop(name.strip().lower(), None)


def _framework_installed(name: str) -> bool:
    module = _BUILTIN[name][1] if name in _BUILTIN else None
    return module is None or importlib.util.find_spec(module) is not None


def install_command(name: str) -> str:
    """The pip command that installs the framework of built-in backend ``name``, in the
    versions unified_amp supports."""
    return "pip install " + " ".join(f"'{req}'" for req in REQUIREMENTS[name])


def _unavailable(name: str) -> BackendUnavailableError:
    framework = _BUILTIN[name][1]
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    hint = f"Install it with: {install_command(name)}"
    if name == "torch":
        hint += " (for a CUDA build, use the command pytorch.org gives for your CUDA)."
    else:
        hint += (
            f" into a CPython 3.10 environment: MegEngine 1.13, its last release, has"
            f" wheels for CPython 3.8-3.10 only and unified_amp needs CPython >= 3.10"
            f" (this is CPython {py}). `make test` keeps one such environment per backend."
        )
    return BackendUnavailableError(
        f"The {name!r} backend needs the {framework!r} package, which is not installed in"
        f" this interpreter ({sys.executable}). {hint}"
    )


def available_backends() -> list[str]:
    """Names of the backends whose framework is installed here, in auto-selection order.

    Finding them imports no framework.
    """
    known = _known()
    ordered = [n for n in _AUTO_ORDER if n in known] + sorted(set(known) - set(_AUTO_ORDER))
    return [n for n in ordered if _framework_installed(n)]


def _validate(name: object, source: str) -> str:
    known = _known()
    if not isinstance(name, str) or name.strip().lower() not in known:
        raise UnknownBackendError(name, sorted(known), source)
    name = name.strip().lower()
    if not _framework_installed(name):
        raise _unavailable(name)
    return name


def set_backend(name: str) -> None:
    """Selects the backend by name ("torch" or "megengine"); overrides the env var.

    Raises:
        UnknownBackendError: ``name`` is not a known backend.
        BackendUnavailableError: its framework is not installed here.
    """
    global _chosen, _active
    name = _validate(name, "set_backend()")
    with _lock:
        _chosen = name
        _active = _NONE


def _resolve_name() -> str:
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return _validate(env, f"the {ENV_VAR} environment variable")
    for name in available_backends():
        return name
    raise BackendUnavailableError(
        f"No unified_amp backend is installed in this interpreter ({sys.executable}):"
        f" install a framework with {install_command('torch')}, or, in a CPython 3.10"
        f" environment (MegEngine has no wheels past 3.10), {install_command('megengine')}."
    )


_ADAPTERS = "unified_amp.backends"


def _bind_checkout_backends() -> None:
    """In a plain checkout (no install, so no package-dir mapping), imports the
    repository's ``backends/`` as ``unified_amp.backends``; otherwise does nothing."""
    if _ADAPTERS in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(_ADAPTERS)
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.has_location:
        return  # installed: the mapping finds the package
    # Not found, or found only as a namespace portion: a directory named
    # unified_amp/backends without an __init__.py, such as the __pycache__ folders git
    # leaves behind (ignored files) in a checkout made before the adapters moved to the
    # top-level backends/. It holds no adapter; importing through it would fail.
    package = Path(__file__).resolve().parent.parent / "backends"
    init = package / "__init__.py"
    if not init.is_file():
        return  # nothing to bind: the import below names what is missing
    spec = importlib.util.spec_from_file_location(
        _ADAPTERS, init, submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None  # a file location always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[_ADAPTERS] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_ADAPTERS]
        raise


def _load(name: str) -> "Backend":
    target = _known()[name]
    if callable(target):
        return _checked(name, target())
    module_name, _, attr = target.partition(":")
    if module_name.startswith(_ADAPTERS + "."):
        _bind_checkout_backends()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if name in _BUILTIN and not _framework_installed(name):
            raise _unavailable(name) from exc
        raise
    return _checked(name, getattr(module, attr)())


def _checked(name: str, adapter: Any) -> "Backend":
    """``adapter``, once it is seen to provide the required core (interface.Backend)."""
    lacks = missing(adapter, Backend)
    if lacks:
        raise MissingCapabilityError(
            f"The {name!r} backend's adapter {type(adapter).__name__} does not provide the"
            f" required core (unified_amp.interface.Backend): it has no {', '.join(lacks)}."
            f" Every backend implements all of it (docs/DESIGN.md, 'The adapter"
            f" interface'); what it may leave out is in unified_amp.capabilities."
        )
    return cast("Backend", adapter)


def get_backend() -> "Backend":
    """The active adapter (``.name`` is "torch" or "megengine"), made on first use."""
    global _active
    active = _active
    if active is not _NONE:
        return active
    # The name is looked up after the call that fills _instances (dynamo, where the
    # first use is traced, reads a global when the name is loaded), and _active is set
    # here rather than inside _activate, which dynamo runs for real while tracing: as a
    # store it traces, the change takes effect when the compiled code runs, not under
    # the guard dynamo has just made on reading _active (torch <= 2.10 checks that guard
    # at once, and raised).
    name = _activate()
    active = _active = _instances[name]
    return active


def loaded_backend() -> "Backend | None":
    """The active adapter if one has been made already, else None (loads nothing)."""
    active = _active
    return None if active is _NONE else active


def _framework_already_imported() -> bool:
    """Whether the backend ``get_backend()`` would pick now is a built-in one whose
    framework this process has imported already, so that making its adapter imports no
    framework. Never raises: a bad choice is reported where the backend is used."""
    try:
        name = _resolve_name()
    except (UnknownBackendError, BackendUnavailableError):
        return False
    return name in _BUILTIN and _BUILTIN[name][1] in sys.modules


def ready_backend() -> "Backend | None":
    """The active adapter, made now if its framework is imported already; else None.

    What an object that may outlive the current code asks when it is made: an
    ``amp.autocast`` made at module level, after ``import torch`` and before any
    compiled function runs, gets the adapter loaded, which tells torch.compile how to
    trace such an object (backends/torch_backend/autocast_dynamo.py). Before its
    framework is imported, it loads nothing."""
    active = _active
    if active is not _NONE:
        return active
    if not _framework_already_imported():
        return None
    return get_backend()


def _activate() -> str:
    """Picks and loads the adapter, once per process (or after ``set_backend``); returns
    its key in ``_instances``."""
    with _lock:
        name = _resolve_name()
        if name not in _instances:
            _instances[name] = _load(name)
        return name


# Where the first use happens inside a function that torch.compile traces, dynamo cannot
# follow the lock and the import above. This attribute (what
# torch._dynamo.assume_constant_result sets; set by name, as the core imports no
# framework) makes dynamo run the function as it is, once, while tracing.
_activate._dynamo_marked_constant = True  # type: ignore[attr-defined]
_framework_already_imported._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _reset_for_tests() -> None:
    """Forgets the choice, the cached adapter and registered factories (adapter instances
    of the built-in backends are kept: their frameworks stay loaded anyway)."""
    global _chosen, _active
    with _lock:
        _chosen = None
        _active = _NONE
        for name in list(_factories):
            _factories.pop(name)
            _instances.pop(name, None)
