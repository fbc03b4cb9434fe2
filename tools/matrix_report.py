"""docs/VERSIONS.md's table, written from docs/versions.json
(tools/version_matrix.py). Only the text between each file's matrix markers is
generated; the prose around it is written by hand (the failures' explanations there).
README links to the page instead of repeating the table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "VERSIONS.md"
MARKERS = {
    DOC: ("<!-- matrix:begin: written by tools/version_matrix.py from docs/versions.json -->",
          "<!-- matrix:end -->"),
}
STANDARD_TESTS = "UNIFIED_AMP_BACKEND=torch python -m pytest tests -q -p no:cacheprovider"
NOT_RUN = {"no-wheel": "no torch wheel", "no-python": "no CPython here",
           "install-failed": "**install failed**", "timeout": "**timed out**",
           "pytest-crashed": "**pytest crashed**"}


def summary(cell: dict | None) -> str:
    """One cell in a few words: its counts, failures first and in bold."""
    if cell is None:
        return "not run"
    if cell["status"] != "ran":
        return NOT_RUN.get(cell["status"], cell["status"])
    labels = {"failed": "failed", "errors": "errors" if cell["errors"] != 1 else "error"}
    words = [f"**{cell[k]} {label}**" for k, label in labels.items() if cell[k]]
    words += [f"{cell['passed']} passed"] + ([f"{cell['skipped']} skipped"] if cell["skipped"] else [])
    subset = cell["test_command"].removeprefix(STANDARD_TESTS).strip()
    return ", ".join(words) + (f" (only `{subset}`)" if subset else "")


def grid(results: dict, torches: tuple[str, ...], pythons: tuple[str, ...]) -> str:
    cells = results["cells"]
    rows = ["| torch \\ CPython | " + " | ".join(pythons) + " |",
            "|---" * (len(pythons) + 1) + "|"]
    for t in torches:
        rows.append(f"| {t} | " + " | ".join(
            summary(cells.get(f"torch {t} / CPython {p}")) for p in pythons) + " |")
    return "\n".join(rows)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _totals(cells: list[dict]) -> str:
    ran = [c for c in cells if "install_s" in c]
    if not ran:
        return "No cell recorded yet."
    install = [c["install_s"] for c in ran]
    tests = [c["test_s"] for c in ran if "test_s" in c]
    disk = max((c.get("disk_bytes", 0) for c in ran), default=0)
    dates = sorted(c["date"] for c in ran)
    return (f"{len(ran)} cells recorded, {dates[0]} to {dates[-1]}. Wall time, all of them "
            f"together: {_minutes(sum(install))} installing (per cell "
            f"{_minutes(min(install))}-{_minutes(max(install))}) and "
            f"{_minutes(sum(tests))} in the suite (per cell "
            f"{_minutes(min(tests, default=0))}-{_minutes(max(tests, default=0))}). "
            f"The most disk one cell held (the matrix's uv cache and the cell's venv, "
            f"after its install): {disk / 1e9:.1f} GB.")


def details(results: dict, torches: tuple[str, ...], pythons: tuple[str, ...]) -> str:
    order = {(t, p): i for i, (t, p) in enumerate((t, p) for t in torches for p in pythons)}
    cells = sorted(results["cells"].values(),
                   key=lambda c: order.get((c["torch"], c["python"]), len(order)))
    out = [_totals(cells), "",
           "| torch | CPython | torch build | numpy | passed | failed | skipped | errors "
           "| install | suite | date |", "|---" * 11 + "|"]
    for c in cells:
        if c["status"] == "ran":
            counts = " | ".join(str(c[k]) for k in ("passed", "failed", "skipped", "errors"))
        else:
            counts = " | ".join([summary(c), "", "", ""])
        out.append(f"| {c['torch']} | {c.get('python_full', c['python'])} "
                   f"| {c.get('torch_build', '')} | {c.get('numpy', '')} | {counts} "
                   f"| {_minutes(c['install_s']) if 'install_s' in c else ''} "
                   f"| {_minutes(c['test_s']) if 'test_s' in c else ''} | {c['date']} |")
    out += ["", "#### Failures, per cell", ""]
    failing = [c for c in cells if c["status"] != "ran" or c["failures"]]
    if not failing:
        out.append("None in the recorded cells.")
    for c in failing:
        head = f"torch {c.get('torch_build', c['torch'])} / CPython {c.get('python_full', c['python'])}"
        if c["status"] != "ran":
            out.append(f"- {head}: {summary(c)}: {c.get('note', '')}")
            continue
        out.append(f"- {head}: {summary(c)}")
        out += [f"  - `{f['id']}`{' (error)' if f['outcome'] == 'error' else ''}: "
                f"{f['reason'].replace('|', '/')}" for f in c["failures"]]
    out += ["", "#### Commands and what each cell installed", ""]
    for c in cells:
        if "install_command" not in c:
            continue
        name = f"torch-{c['torch']}-py{c['python']}.txt"
        run = f", then `{c['test_command']}`" if "test_command" in c else ""
        frozen = (f"; installed: [constraints/matrix/{name}](../constraints/matrix/{name})"
                  if (ROOT / "constraints" / "matrix" / name).is_file() else "")
        out.append(f"- torch {c['torch']} / CPython {c['python']}: `{c['install_command']}`"
                   f"{run}{frozen}")
    return "\n".join(out)


def _replace_between(path: Path, text: str) -> None:
    begin, end = MARKERS[path]
    old = path.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(old):
        raise SystemExit(f"{path.relative_to(ROOT)} has no {begin} ... {end} region; "
                         "put the two markers where the generated table goes")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", old, count=1))


def render(results: dict, torches: tuple[str, ...], pythons: tuple[str, ...]) -> dict[Path, str]:
    """The generated text of each file's region."""
    table = grid(results, torches, pythons)
    return {DOC: table + "\n\n" + details(results, torches, pythons)}


def write_docs(results: dict, torches: tuple[str, ...], pythons: tuple[str, ...]) -> None:
    for path, text in render(results, torches, pythons).items():
        _replace_between(path, text)
