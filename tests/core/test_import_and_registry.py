"""Backend selection: lazy, cached, validated, and importing the package loads no framework."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import unified_amp as amp
from unified_amp import _registry

FRAMEWORKS = ("torch", "megengine")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "UNIFIED_AMP_BACKEND"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_importing_the_package_imports_no_framework():
    proc = _run("""
        import sys
        import unified_amp, unified_amp.backends
        from unified_amp import autocast, GradScaler, GradManager, clip_grad_norm
        unified_amp.available_backends()   # listing what is installed imports nothing
        autocast(dtype="float16")          # nor does making (not entering) an autocast
        loaded = [m for m in ("torch", "megengine", "numpy") if m in sys.modules]
        print(loaded)
        sys.exit(1 if loaded else 0)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", [n for n in FRAMEWORKS if importlib.util.find_spec(n)])
def test_a_scaler_loads_only_the_selected_framework(name):
    """GradScaler() resolves the backend (on torch it must be a torch.amp.GradScaler
    from the start), and imports that framework alone."""
    other = [n for n in FRAMEWORKS if n != name][0]
    proc = _run(f"""
        import sys
        import unified_amp
        scaler = unified_amp.GradScaler()
        print({name!r} in sys.modules, {other!r} in sys.modules)
    """, UNIFIED_AMP_BACKEND=name)
    assert proc.stdout.split()[-2:] == ["True", "False"], proc.stdout + proc.stderr


def test_available_backends_lists_installed_frameworks_in_auto_order():
    installed = [n for n in FRAMEWORKS if importlib.util.find_spec(n) is not None]
    assert amp.available_backends() == installed


def test_unknown_name_raises_value_error_listing_valid_names():
    with pytest.raises(amp.UnknownBackendError) as info:
        amp.set_backend("tensorflow")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "'tensorflow'" in message and "'torch'" in message and "'megengine'" in message


def test_unknown_env_var_names_the_variable():
    proc = _run("""
        import unified_amp as amp
        try:
            amp.get_backend()
        except amp.UnknownBackendError as e:
            print("OK", e)
    """, UNIFIED_AMP_BACKEND="jax")
    assert proc.stdout.startswith("OK"), proc.stderr
    assert "UNIFIED_AMP_BACKEND" in proc.stdout and "'jax'" in proc.stdout


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_missing_framework_raises_import_error_with_install_hint(name, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(amp.BackendUnavailableError) as info:
        amp.set_backend(name)
    assert isinstance(info.value, ImportError)
    message = str(info.value)
    # No index serves unified_amp, so the hint installs the framework itself, in the
    # versions of the extra (tests/test_packaging.py checks that they are the extra's).
    assert f"Install it with: {_registry.install_command(name)}" in message
    assert f"pip install '{_registry.REQUIREMENTS[name][0]}'" in message
    assert "unified_amp[" not in message
    if name == "megengine":
        assert "CPython 3.8-3.10 only and unified_amp needs CPython >= 3.10" in message
        assert "'numpy<2'" in message


def test_no_backend_at_all_names_both_install_commands(monkeypatch):
    monkeypatch.delenv("UNIFIED_AMP_BACKEND", raising=False)
    monkeypatch.setattr(_registry, "available_backends", lambda: [])
    _registry._reset_for_tests()
    with pytest.raises(amp.BackendUnavailableError) as info:
        amp.get_backend()
    message = str(info.value)
    for name in FRAMEWORKS:
        assert _registry.install_command(name) in message


def test_set_backend_overrides_env_var_and_is_cached(fake):
    # `fake` was selected with set_backend() although UNIFIED_AMP_BACKEND names a real one.
    assert amp.get_backend() is fake
    assert amp.get_backend() is amp.get_backend()
    assert amp.get_backend().name == "fake"


def test_env_var_selects_backend_lazily():
    installed = [n for n in FRAMEWORKS if importlib.util.find_spec(n) is not None]
    name = installed[0]
    proc = _run(f"""
        import sys, unified_amp as amp
        assert {name!r} not in sys.modules
        print(amp.get_backend().name, {name!r} in sys.modules)
    """, UNIFIED_AMP_BACKEND=name.upper())
    assert proc.stdout.split() == [name, "True"], proc.stderr


def test_register_backend_rejects_bad_arguments():
    with pytest.raises(TypeError):
        amp.register_backend("", lambda: None)
    with pytest.raises(TypeError):
        amp.register_backend("x", "not callable")


def test_reset_forgets_registered_backends(fake):
    _registry._reset_for_tests()
    with pytest.raises(amp.UnknownBackendError):
        amp.set_backend("fake")
