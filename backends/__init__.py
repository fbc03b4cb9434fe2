"""Framework adapters for unified_amp, one package per framework, installed as
``unified_amp.backends`` (pyproject.toml's ``package-dir``).

Reach them through ``unified_amp.get_backend()`` (the registry imports the one in use, on
first use); importing this package imports no framework.

This directory is importable only under that name. From a checkout whose root is on
``sys.path``, a bare ``import backends`` would load every adapter a second time, as
other modules (``backends.torch_backend`` beside ``unified_amp.backends.torch_backend``)
with their own copies of the adapters' per-process state (MegEngine's patched
functions): so it refuses, and says what to import instead.
"""

if __name__ != "unified_amp.backends":
    raise ImportError(
        f"unified_amp's adapter directory was imported as {__name__!r}; it is the package"
        f" 'unified_amp.backends' (installed so by pyproject.toml's package-dir). Use"
        f" unified_amp.get_backend() for the active adapter, or import"
        f" unified_amp.backends.torch_backend / unified_amp.backends.megengine_backend.",
        name=__name__,
    )
