"""apex's amp API on the same core: ``initialize``/``scale_loss`` and the opt levels
(``opt_levels.py``, with ``_presets.py``, ``_patch.py`` and ``_stale.py``; which
``initialize()`` call is the latest is ``unified_amp/_latest_initialize.py``, below
apex/ and pinning.py), and apex's cast registries (``cast_registry.py``). Reached as
``unified_amp.initialize`` and the other names ``unified_amp`` exports."""
