"""A framework-free reference model of dynamic loss scaling, written independently of
unified_amp's implementation (numpy float32 arithmetic, as torch._amp_update_scale_ does),
so that tests compare the library against it rather than against itself."""

from __future__ import annotations

import numpy as np


def trajectory(init_scale, growth_factor, backoff_factor, growth_interval, overflows):
    """[(scale, growth_tracker)] after each update() for a sequence of overflow flags."""
    scale = np.float32(init_scale)
    tracker = 0
    out = []
    with np.errstate(over="ignore"):
        for found in overflows:
            if found:
                scale = np.float32(np.float64(scale) * backoff_factor)
                tracker = 0
            else:
                tracker += 1
                if tracker == growth_interval:
                    grown = np.float32(np.float64(scale) * growth_factor)
                    if np.isfinite(grown):
                        scale = grown
                    tracker = 0
            out.append((float(scale), tracker))
    return out
