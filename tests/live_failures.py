"""A pytest plugin for short GPU leases (tests/run_gpu_half.sh): each failing or erroring
test's report goes to $LIVE_FAILURES the moment it arrives, so a run cut off by its time
cap still says what failed and why. Load with ``-p tests.live_failures``."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("LIVE_FAILURES")
    if not path or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.when} {report.nodeid}\n{report.longreprtext[-3000:]}\n")
