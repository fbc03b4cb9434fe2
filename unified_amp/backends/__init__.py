"""Framework adapters for unified_amp, one module per framework.

Reach them through ``unified_amp.get_backend()`` (the registry imports the one in use, on
first use); importing this package imports no framework.
"""
