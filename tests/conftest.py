"""Suite-wide settings. Each backend runs this suite in its own interpreter (`make test`)."""

from hypothesis import settings

# Derandomized so CI sees the same examples every run; no example database on disk;
# no deadline because MegEngine's eager CPU kernels are slow and uneven.
settings.register_profile("unified_amp", derandomize=True, database=None, deadline=None,
                          max_examples=40)
settings.load_profile("unified_amp")
