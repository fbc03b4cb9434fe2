"""Differential fuzzing: seeded random programs run on unified_amp and on the natives
(torch.amp / megengine.amp / torch.autocast) side by side, compared byte for byte.

`make test` runs the fast tier (a few programs per test, the same every run); `make fuzz
PROGRAMS=N SEED=S` runs a long one through the same tests. Each program is rebuilt from
(seed, index) alone, so a failure names the seed and index that reproduce it.
"""

import importlib.util
import os

import pytest

# The scaler fuzz against each native needs that framework: each runs in its own
# backend's interpreter (make test / make fuzz run both). The cross-backend fuzz runs in
# torch's, and starts MegEngine's (test_portable_fuzz.py).
collect_ignore_glob = [
    f"test_scaler_fuzz_{name}*.py"
    for name in ("torch", "megengine")
    if importlib.util.find_spec(name) is None
] + (["test_portable_fuzz.py"] if importlib.util.find_spec("torch") is None else [])


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise pytest.UsageError(f"{name}={raw!r} is not an integer; set it to a count, "
                                f"e.g. {name}=200") from None
    if value < 0:
        raise pytest.UsageError(f"{name}={value} is negative; give a count >= 0")
    return value


class Budget:
    """How many programs a fuzz test runs, and from which seed."""

    def __init__(self) -> None:
        self.long = os.environ.get("UNIFIED_AMP_FUZZ_PROGRAMS") not in (None, "")
        self._programs = _env_int("UNIFIED_AMP_FUZZ_PROGRAMS", 0)
        self.seed = _env_int("UNIFIED_AMP_FUZZ_SEED", 0)

    def programs(self, fast: int) -> range:
        """Indices of the programs to run: ``fast`` of them in the fast tier, the
        requested count in a long run."""
        return range(self._programs if self.long else fast)


@pytest.fixture(scope="session")
def fuzz() -> Budget:
    return Budget()
