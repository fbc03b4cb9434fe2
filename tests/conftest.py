"""Suite-wide settings. Each backend runs this suite in its own interpreter (`make test`)."""

from hypothesis import settings

# Derandomized so CI sees the same examples every run; no example database on disk;
# no deadline because MegEngine's eager CPU kernels are slow and uneven.
settings.register_profile("unified_amp", derandomize=True, database=None, deadline=None,
                          max_examples=40)
settings.load_profile("unified_amp")


def pytest_configure(config):
    # Many tests plant long runs of overflows on purpose; the tests of the warning
    # itself (test_forensics_*.py) record it with their own filters.
    config.addinivalue_line("filterwarnings",
                            "ignore::unified_amp.errors.OverflowWarning")
    # The suite holds no contract function where MegEngine's wrappers cannot reach it:
    # a ContractWarning here is a binding the adapter missed, which must fail the run.
    # (The test of the warning runs its own interpreter and records it there.)
    config.addinivalue_line("filterwarnings", "error::unified_amp.ContractWarning")
