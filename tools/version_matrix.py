"""The version matrix behind `make test-matrix`: the whole torch suite on every torch minor
of the `[torch]` extra's range, each at its latest patch, on every CPython 3.10-3.13 that
torch has wheels for (docs/VERSIONS.md).

One cell (a torch and a CPython) at a time: a fresh uv venv gets that torch and the
extras' ranges resolved around it (so each cell holds what a user who installs
``unified_amp[torch]`` beside that torch gets), the suite runs, what pip would freeze
goes to constraints/matrix/, the counts and each failure go to docs/versions.json, and
the venv is removed. uv's cache hardlinks each file into the venv, so a venv costs
nearly nothing beside the cache; a torch's CPython-specific wheels (torch, triton) leave
the cache after each cell and the rest of it (the nvidia-* wheels all CPythons share)
after that torch's last cell, so the disk holds one torch at a time.

Usage: python tools/version_matrix.py [--torch "2.8 2.12"] [--python "3.11"]
       [--pytest-args "-k compile"] [--keep-cache] [--timeout 3600]
       python tools/version_matrix.py --render    (docs from docs/versions.json only)
Only the cells run are replaced in docs/versions.json; the others are kept.
Standard library only: it runs on any CPython >= 3.10, outside the venvs it makes.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import matrix_report  # noqa: E402  (beside this file; not a package)

# Every minor of pyproject's `torch>=2.7,<2.15`, at its latest patch on PyPI
# (tests/test_version_matrix.py holds this list to the extra's range).
TORCH = ("2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")
PYTHON = ("3.10", "3.11", "3.12", "3.13")
EXTRAS = "torch,test,examples,bench"
RESULTS = ROOT / "docs" / "versions.json"
FREEZE_DIR = ROOT / "constraints" / "matrix"
WORK = Path(os.environ.get("MATRIX_DIR") or ROOT / ".matrix")
# Wheels that exist once per CPython and torch version: the ones worth dropping from
# the cache between cells of the same torch.
PER_CELL_WHEELS = ("torch", "triton")


class MatrixError(Exception):
    """A selection or a setup the matrix cannot run with; its message names the fix."""


def select(spec: str, full: tuple[str, ...], what: str) -> list[str]:
    """The versions of ``full`` that the blank-separated ``spec`` names, in ``full``'s
    order ("2.8" names 2.8.0, "2.12.1" itself); all of them where ``spec`` is blank."""
    tokens = spec.replace(",", " ").split()
    if not tokens:
        return list(full)
    chosen = set()
    for token in tokens:
        parts = token.split(".")
        hits = [v for v in full if v.split(".")[:len(parts)] == parts]
        if not hits:
            raise MatrixError(f"{what}={spec!r}: {token!r} is not in the matrix, which has "
                              f"{' '.join(full)}; name one of those (or its minor, 2.8).")
        chosen.update(hits)
    return [v for v in full if v in chosen]


def cell_key(torch: str, python: str) -> str:
    return f"torch {torch} / CPython {python}"


def freeze_path(torch: str, python: str) -> Path:
    return FREEZE_DIR / f"torch-{torch}-py{python}.txt"


def find_python(minor: str) -> str | None:
    """CPython ``minor`` (3.11): on PATH as python3.11, else pyenv's newest 3.11.x."""
    found = shutil.which(f"python{minor}")
    if found and _runs(found):
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = sorted(glob.glob(str(pyenv / "versions" / f"{minor}.*" / "bin" / f"python{minor}")),
                        key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).parents[1].name)])
    return candidates[-1] if candidates else None


def _runs(python: str) -> bool:
    # A pyenv shim is on PATH for every version pyenv has, but runs only the selected one.
    return subprocess.run([python, "-c", ""], capture_output=True).returncode == 0


def parse_junit(path: Path, root: Path = ROOT) -> dict:
    """Counts, failures and skips from pytest's --junitxml report of a run in ``root``; each
    failure is the test id and the first line of pytest's message."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures, skips = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = _test_id(case.get("classname", ""), case.get("name", ""), root)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                failures.append({"id": test_id, "outcome": child.tag,
                                 "reason": _reason(child.get("message") or "", child.text or "")})
                break
            if child.tag == "skipped":
                outcome = "skipped"
                reason = _one_line(child.get("message") or "")
                skips[reason] = skips.get(reason, 0) + 1
        counts[outcome] += 1
    skipped = [{"reason": r, "count": n} for r, n in sorted(skips.items(), key=lambda kv: -kv[1])]
    return {**counts, "failures": failures, "skips": skipped}


def _test_id(classname: str, name: str, root: Path) -> str:
    """tests.native.test_x.TestY + test_z[a] -> tests/native/test_x.py::TestY::test_z[a]."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        if (root / Path(*parts[:cut])).with_suffix(".py").is_file():
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])
    return "::".join([classname, name])


# A line that names an exception: "RuntimeError: ...", "torch._dynamo.exc.Unsupported: ...".
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unsupported|Exit|Failed)\b")


def _reason(message: str, report: str) -> str:
    """The first line of pytest's message, unless that says nothing (an assertion whose
    message is the tail of a subprocess's traceback starts with a line of carets): then
    the last exception the report's "E" lines name, the one that ended that traceback."""
    first = _one_line(message or report)
    if len(re.findall(r"[A-Za-z0-9]", first.partition(": ")[2])) >= 3:
        return first
    said = [line[1:].strip() for line in report.splitlines() if line.startswith("E ")]
    named = [line for line in said if EXCEPTION_LINE.match(line)]
    return _one_line(named[-1]) if named else first


def _one_line(message: str, width: int = 240) -> str:
    line = next((l.strip() for l in message.splitlines() if l.strip()), "")
    return line if len(line) <= width else line[:width - 1] + "…"


def _disk_bytes(*paths: Path) -> int:
    """Bytes on disk under ``paths`` together, a file hardlinked twice counted once."""
    there = [str(p) for p in paths if p.exists()]
    if not there:
        return 0
    out = subprocess.run(["du", "-s", "-B1", "-c", *there], capture_output=True, text=True)
    return int(out.stdout.split()[-2]) if out.returncode == 0 else 0


def _run(cmd: list[str], env: dict, log, timeout: float | None = None) -> tuple[int, str]:
    """Runs ``cmd``, copying its output to ``log`` and to this terminal; returns the exit
    status (-9 when it ran past ``timeout`` seconds and was killed, with its children)
    and the output's last 4000 characters."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    expired = []

    def kill() -> None:
        expired.append(True)
        os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill) if timeout else None
    if watchdog:
        watchdog.start()
    tail = ""
    for line in proc.stdout:
        log.write(line)
        sys.stdout.write(line)
        tail = (tail + line)[-4000:]
    status = proc.wait()
    if watchdog:
        watchdog.cancel()
    return (-9 if expired else status), tail


def run_cell(torch: str, python: str, cache: Path, pytest_args: list[str],
             timeout: float) -> dict:
    """Makes the cell's venv, installs, freezes, runs the suite, removes the venv."""
    result = {"torch": torch, "python": python,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"}
    interpreter = find_python(python)
    if interpreter is None:
        return {**result, "status": "no-python",
                "note": f"no CPython {python} here (python{python} on PATH or pyenv)"}
    venv = WORK / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(UV_CACHE_DIR=str(cache), UV_PYTHON_DOWNLOADS="never")
    uv = shutil.which("uv")
    python_bin = str(venv / "bin" / "python")
    # pip too: the packaging tests drive pip; one resolution keeps it with torch's needs.
    install = [uv, "pip", "install", "--python", python_bin, f"torch=={torch}",
               "-e", f".[{EXTRAS}]", "pip"]
    result["install_command"] = f"uv venv -p python{python} VENV && " + shlex.join(
        ["uv", "pip", "install", "--python", "VENV/bin/python", *install[5:]])
    log_path = WORK / "logs" / f"torch-{torch}-py{python}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        subprocess.run([uv, "venv", "-q", "-p", interpreter, str(venv)], env=env, check=True)
        start = time.monotonic()
        status, tail = _run(install, env, log)
        result["install_s"] = round(time.monotonic() - start, 1)
        if status != 0:
            shutil.rmtree(venv, ignore_errors=True)
            wheels = re.search(r"we only found wheels for `torch`.*", tail)
            return {**result, "status": "no-wheel" if wheels else "install-failed",
                    "note": _one_line(wheels.group(0) if wheels else tail.strip().splitlines()[-1])}
        result["disk_bytes"] = _disk_bytes(cache, venv)
        freeze = subprocess.run([uv, "pip", "freeze", "--python", python_bin, "--exclude-editable"],
                                env=env, capture_output=True, text=True, check=True).stdout
        FREEZE_DIR.mkdir(parents=True, exist_ok=True)
        freeze_path(torch, python).write_text(
            f"# What `make test-matrix` installed for {cell_key(torch, python)} on "
            f"{result['date']}:\n# {result['install_command']}\n"
            f"# Reproduce it: uv pip install -r this file, then -e . --no-deps.\n{freeze}")
        probe = ("import json, platform, numpy, torch; print(json.dumps({'python_full': "
                 "platform.python_version(), 'torch_build': torch.__version__, 'cuda': "
                 "torch.version.cuda, 'numpy': numpy.__version__}))")
        result.update(json.loads(subprocess.run([python_bin, "-c", probe], env=env, check=True,
                                                capture_output=True, text=True).stdout))
        junit = WORK / "junit.xml"
        junit.unlink(missing_ok=True)
        tests = ["python", "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *pytest_args]
        result["test_command"] = "UNIFIED_AMP_BACKEND=torch " + shlex.join(tests)
        env["UNIFIED_AMP_BACKEND"] = "torch"
        start = time.monotonic()
        status, tail = _run([python_bin, *tests[1:], f"--junitxml={junit}"], env, log, timeout)
        result["test_s"] = round(time.monotonic() - start, 1)
    shutil.rmtree(venv, ignore_errors=True)
    if status == -9:
        return {**result, "status": "timeout", "note": f"the suite ran past {timeout:.0f} s"}
    if not junit.is_file():
        return {**result, "status": "pytest-crashed", "note": _one_line(tail.strip().splitlines()[-1])}
    return {**result, "status": "ran", "pytest_exit": status, **parse_junit(junit)}


def prune(cache: Path, everything: bool) -> None:
    """Drops the cell's CPython-specific wheels from the matrix's own cache, or all of it."""
    if everything:
        shutil.rmtree(cache, ignore_errors=True)
        return
    env = {**os.environ, "UV_CACHE_DIR": str(cache)}
    subprocess.run(["uv", "cache", "clean", "-q", *PER_CELL_WHEELS], env=env, check=False)


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"cells": {}}


def save(results: dict) -> None:
    results["cells"] = dict(sorted(results["cells"].items(), key=lambda kv: (
        TORCH.index(kv[1]["torch"]) if kv[1]["torch"] in TORCH else 99,
        PYTHON.index(kv[1]["python"]) if kv[1]["python"] in PYTHON else 99)))
    RESULTS.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    matrix_report.write_docs(results, TORCH, PYTHON)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", default=os.environ.get("MATRIX_TORCH", ""))
    parser.add_argument("--python", default=os.environ.get("MATRIX_PYTHON", ""))
    parser.add_argument("--pytest-args", default=os.environ.get("MATRIX_PYTEST_ARGS", ""))
    parser.add_argument("--timeout", type=float, default=3600, help="per cell's suite, seconds")
    parser.add_argument("--keep-cache", action="store_true",
                        help="keep every wheel in the matrix's uv cache (WORK/uv-cache)")
    parser.add_argument("--render", action="store_true", help="only rewrite the docs")
    args = parser.parse_args(argv)
    if args.render:
        save(load())
        return 0
    try:
        torches = select(args.torch, TORCH, "MATRIX_TORCH")
        pythons = select(args.python, PYTHON, "MATRIX_PYTHON")
        if shutil.which("uv") is None:
            raise MatrixError("make test-matrix needs uv (`pip install uv`, or "
                              "https://docs.astral.sh/uv/): its cache hardlinks each wheel "
                              "into the venvs, which keeps the matrix to one torch on disk.")
    except MatrixError as exc:
        print(f"make: *** {exc}", file=sys.stderr)
        return 2
    cache = WORK / "uv-cache"
    results, bad = load(), 0
    # The results and docs are written once, at the end (an interrupted run keeps the
    # cells it finished): the suite reads them (tests/test_version_matrix.py), and each
    # cell must see the checkout as it was, not the cells before it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for t in torches:
            for p in pythons:
                print(f"\n======== {cell_key(t, p)} ========", flush=True)
                cell = run_cell(t, p, cache, shlex.split(args.pytest_args), args.timeout)
                results["cells"][cell_key(t, p)] = cell
                bad += cell["status"] != "ran" or cell["failed"] + cell["errors"] > 0
                print(f"-------- {cell_key(t, p)}: {matrix_report.summary(cell)}", flush=True)
                if not args.keep_cache:
                    prune(cache, everything=p == pythons[-1])
    finally:
        shutil.rmtree(WORK / "venv", ignore_errors=True)
        save(results)
    print(f"\n{len(torches) * len(pythons)} cells run; {bad} not green; "
          f"{os.path.relpath(RESULTS, ROOT)} and docs/VERSIONS.md updated")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
