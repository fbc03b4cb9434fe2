"""apex's amp API on the same core: ``initialize``/``scale_loss`` and the opt levels
(``opt_levels.py``, with ``_presets.py``, ``_patch.py``, ``_state.py`` and
``_stale.py``), and apex's cast registries (``cast_registry.py``). Reached as
``unified_amp.initialize`` and the other names ``unified_amp`` exports."""
