"""Runs cross-backend fuzz programs on the active backend and writes their traces as
JSON: the other interpreter's half of ``test_portable_fuzz.py``.

    UNIFIED_AMP_BACKEND=megengine .venv-megengine/bin/python -m tests.fuzz.portable_runner OUT

reads ``{"seed": S, "programs": [[index, states], ...]}`` from stdin (``states``: the
state dicts the other backend's run saved, by call position, or null) and writes
``{"traces": [trace, ...]}`` to the file OUT (stdout is left to the frameworks' chatter).
"""

from __future__ import annotations

import json
import sys

from .portable_programs import run_program


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    job = json.load(sys.stdin)
    traces = [run_program(job["seed"], index, states) for index, states in job["programs"]]
    with open(argv[0], "w") as out:
        json.dump({"traces": traces}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
