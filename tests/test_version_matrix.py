"""The version matrix (`make test-matrix`, tools/version_matrix.py): its torch list
follows the extra's range, a subset run keeps the other cells, pytest's report becomes
counts and one-line reasons, and the docs show what docs/versions.json holds, every
failure in it explained. Nothing here installs a torch."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import matrix_report  # noqa: E402
import version_matrix as vm  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # CPython 3.10; pytest needs tomli there
    import tomli as tomllib


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_the_matrix_has_every_torch_minor_of_the_extra_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = project["optional-dependencies"]["torch"]
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", spec).groups()
    minors = [_minor(v) for v in vm.TORCH]
    assert minors == sorted(set(minors)), "one patch per minor, in order"
    assert minors[0] == _minor(low) and minors[-1] == (_minor(high)[0], _minor(high)[1] - 1)
    assert len(minors) == minors[-1][1] - minors[0][1] + 1, "no minor left out"
    assert vm.PYTHON[0] == project["requires-python"].removeprefix(">=")


def test_make_test_oldest_pins_the_matrix_oldest_torch_and_the_lower_bounds():
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)$",
                           (ROOT / "constraints" / "torch-oldest.txt").read_text(), re.M))
    assert pins["torch"] == vm.TORCH[0]  # the oldest minor at its latest patch
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (numpy,) = project["dependencies"]
    assert _minor(pins["numpy"]) == _minor(numpy.removeprefix("numpy>="))


def test_a_selection_names_versions_by_minor_and_refuses_unknown_ones():
    assert vm.select("2.12 2.8", vm.TORCH, "MATRIX_TORCH") == ["2.8.0", "2.12.1"]
    assert vm.select("2.12.1,3.11", vm.TORCH + vm.PYTHON, "X") == ["2.12.1", "3.11"]
    assert vm.select(" ", vm.PYTHON, "MATRIX_PYTHON") == list(vm.PYTHON)
    with pytest.raises(vm.MatrixError, match=r"MATRIX_TORCH='2\.6 2\.8': '2\.6' is not in the "
                                             r"matrix, which has 2\.7\.1 .* 2\.14\.1"):
        vm.select("2.6 2.8", vm.TORCH, "MATRIX_TORCH")
    with pytest.raises(vm.MatrixError, match="'2.1' is not"):
        vm.select("2.1", vm.TORCH, "MATRIX_TORCH")  # not a prefix of 2.10.0 or 2.11.0


def test_an_unknown_version_stops_make_test_matrix_before_anything_is_installed():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "version_matrix.py"),
                           "--torch", "2.6"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "'2.6' is not in the matrix" in proc.stderr
    assert "========" not in proc.stdout  # no cell started


def test_pytests_report_becomes_counts_and_one_line_reasons(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture could not start")

        def test_passes():
            pass

        @pytest.mark.parametrize("x", [1, 2])
        def test_fails(x):
            assert x == 1, "two is not one\\nsecond line"

        def test_skips():
            pytest.skip("needs a GPU")

        def test_errors(broken):
            pass

        def test_a_subprocess_fails():
            assert False, "          ^^^^^^^^\\n  File x.py, line 3\\nRuntimeError: the cause"

        class TestGroup:
            def test_in_a_class(self):
                pytest.skip("needs a GPU")
    """))
    junit = tmp_path / "report.xml"
    # --rootdir: ids relative to tmp_path even where it lies inside this checkout
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--rootdir={tmp_path}", f"--junitxml={junit}", "test_sample.py"],
                   cwd=tmp_path, capture_output=True)
    report = vm.parse_junit(junit, root=tmp_path)
    assert {k: report[k] for k in ("passed", "failed", "skipped", "errors")} == {
        "passed": 2, "failed": 2, "skipped": 2, "errors": 1}
    assert report["failures"] == [
        {"id": "test_sample.py::test_fails[2]", "outcome": "failure",
         "reason": "AssertionError: two is not one"},
        {"id": "test_sample.py::test_errors", "outcome": "error",
         "reason": 'failed on setup with "RuntimeError: fixture could not start"'},
        {"id": "test_sample.py::test_a_subprocess_fails", "outcome": "failure",
         "reason": "RuntimeError: the cause"},
    ]
    assert report["skips"] == [{"reason": "needs a GPU", "count": 2}]


def _cell(torch: str, python: str, failed: int = 0) -> dict:
    return {"torch": torch, "python": python, "status": "ran", "date": "2026-12-01 10:00 UTC",
            "passed": 100 - failed, "failed": failed, "skipped": 3, "errors": 0,
            "failures": [{"id": f"tests/test_x.py::test_{i}", "outcome": "failure",
                          "reason": "AssertionError"} for i in range(failed)],
            "skips": [], "install_s": 60.0, "test_s": 300.0, "disk_bytes": 5e9,
            "install_command": f"uv pip install torch=={torch}",
            "test_command": matrix_report.STANDARD_TESTS}


def test_a_subset_run_replaces_its_cells_and_keeps_the_others(tmp_path, monkeypatch):
    results = tmp_path / "versions.json"
    kept = _cell("2.7.1", "3.10", failed=2)
    results.write_text(json.dumps({"cells": {
        vm.cell_key("2.7.1", "3.10"): kept, vm.cell_key("2.8.0", "3.11"): _cell("2.8.0", "3.11", 5)}}))
    docs = {}
    for path, (begin, end) in matrix_report.MARKERS.items():
        docs[path] = tmp_path / path.name
        docs[path].write_text(f"prose\n{begin}\nold\n{end}\nmore prose\n")
    monkeypatch.setattr(vm, "RESULTS", results)
    # main() removes WORK/venv when it ends: the real one is the venv a matrix cell's
    # suite runs in (this test among them), so it must not be the checkout's
    monkeypatch.setattr(vm, "WORK", tmp_path / "matrix")
    monkeypatch.setattr(matrix_report, "MARKERS",
                        {docs[p]: m for p, m in matrix_report.MARKERS.items()})
    monkeypatch.setattr(matrix_report, "DOC", docs[matrix_report.DOC])
    monkeypatch.setattr(vm.shutil, "which", lambda name: f"/usr/bin/{name}")  # no uv needed
    ran, pruned = [], []
    monkeypatch.setattr(vm, "run_cell", lambda t, p, *a: ran.append((t, p)) or _cell(t, p))
    monkeypatch.setattr(vm, "prune", lambda cache, everything: pruned.append(everything))
    assert vm.main(["--torch", "2.8 2.12", "--python", "3.11 3.12"]) == 0
    assert ran == [("2.8.0", "3.11"), ("2.8.0", "3.12"), ("2.12.1", "3.11"), ("2.12.1", "3.12")]
    assert pruned == [False, True, False, True]  # whole cache only after a torch's last cell
    cells = json.loads(results.read_text())["cells"]
    assert cells[vm.cell_key("2.7.1", "3.10")] == kept
    assert cells[vm.cell_key("2.8.0", "3.11")]["failed"] == 0  # replaced
    assert list(cells)[:2] == [vm.cell_key("2.7.1", "3.10"), vm.cell_key("2.8.0", "3.11")]
    page = docs[ROOT / "docs" / "VERSIONS.md"].read_text()
    assert page.startswith("prose\n") and page.endswith("\nmore prose\n")
    assert "| 2.7.1 | **2 failed**, 98 passed, 3 skipped | not run | not run | not run |" in page
    assert "| 2.12.1 | not run | 100 passed, 3 skipped | 100 passed, 3 skipped | not run |" in page
    assert "- `tests/test_x.py::test_1`: AssertionError" in page


def _between(text: str, begin: str, end: str) -> tuple[str, str]:
    """The text inside the markers, and the text around them."""
    head, rest = text.split(begin + "\n", 1)
    inside, tail = rest.split("\n" + end, 1)
    return inside, head + tail


def test_the_docs_show_what_versions_json_holds():
    results = vm.load()
    for path, text in matrix_report.render(results, vm.TORCH, vm.PYTHON).items():
        inside, _ = _between(path.read_text(), *matrix_report.MARKERS[path])
        assert inside == text, f"{path.name}: run python tools/version_matrix.py --render"


def test_every_cell_recorded_has_its_installs_and_every_failure_an_explanation():
    results = vm.load()
    _, prose = _between(matrix_report.DOC.read_text(), *matrix_report.MARKERS[matrix_report.DOC])
    for cell in results["cells"].values():
        if cell["status"] == "ran":
            pins = vm.freeze_path(cell["torch"], cell["python"]).read_text()
            assert re.search(rf"^torch=={re.escape(cell['torch'])}\b", pins, re.M), cell
        for failure in cell.get("failures", []):
            name = failure["id"].split("::")[-1].split("[")[0]
            assert name in prose, f"docs/VERSIONS.md explains no failure of {name}"
        if cell["status"] != "ran":
            assert f"{cell['torch']} / CPython {cell['python']}" in prose, cell["status"]
