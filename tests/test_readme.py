"""The README's example runs as printed, on the active backend, and trains."""

import math
import pathlib
import re

import unified_amp as amp
from unified_amp import _registry

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_trains_on_this_backend():
    _registry._reset_for_tests()  # the backend named by UNIFIED_AMP_BACKEND
    text = README.read_text()
    section = text.split("## The same step on both frameworks", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    losses = namespace["losses"]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]
    assert namespace["scaler"].stats()["steps"] == 20
    assert not amp.is_autocast_enabled()
