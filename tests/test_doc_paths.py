"""Every file README.md and docs/*.md name exists (issue 39): the repository paths in their
inline code, the modules they name as ``benchmarks.x`` (and those they run with
``python -m``: a ``__main__`` there), the tests they name as ``path::test``, and their
relative links.

What counts as a path in inline code (each word of a span, trailing punctuation off):
a word with a ``/`` whose first part is a top-level entry of the repository
(``tests/fake_cuda.py``, ``benchmarks/results/``) must exist there; another word with a
``/`` that ends in a file extension or ``/`` (``scaler/_machine.py``, written relative to
a package) must be the end of some file's or folder's path; a bare ``name.py``, ``.md``
or ``.sh`` must be some file's name. ``*`` is a glob that must match. Not paths: words
with ``<``, ``{``, ``$``, ``=`` or ``...`` (templates, variables), absolute paths, URLs,
what ``.gitignore`` anchors at the top (what the tools write: ``.matrix/venv``,
``data/cifar-10-batches-py``), and another project's file written as its
(``torch's `amp/grad_scaler.py```).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTENSIONS = ("py", "md", "sh", "json", "png", "txt", "toml", "yml", "yaml", "cfg", "ini",
              "csv", "pth")
SOURCE_EXTENSIONS = ("py", "md", "sh")  # a bare name with one of these must be a file's
PACKAGES = ("benchmarks", "examples", "tests", "tools")  # named as modules in the docs
FENCE = re.compile(r"^\s*(```|~~~)")
# a code span: a run of backticks, what follows up to a run as long; within a paragraph
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:[^`\n]|`+(?!\1(?!`))|\n(?!\s*\n))+?)(?<!`)\1(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+$")
# "torch's `amp/grad_scaler.py`": a file of another project, not of this one
OTHERS = re.compile(r"\b(torch|PyTorch|megengine|MegEngine|Keras|keras|einops|apex|"
                    r"accelerate|Lightning|timm|transformers|torchvision|numpy|pytest|"
                    r"setuptools|pip|CPython|Python)(\.\w+)*'s\s*$")
SKIP_DIRS = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".hypothesis"}


def _ignored_at_top() -> set[str]:
    """What .gitignore anchors at the repository's top: folders the tools write."""
    out = set()
    for line in (ROOT / ".gitignore").read_text().splitlines():
        line = line.strip()
        if line.startswith("/"):
            out.add(line.strip("/"))
    return out


IGNORED = _ignored_at_top()


def _repository_paths() -> list[str]:
    """Every file and folder of the checkout, as paths relative to its root (the
    environments and what .gitignore anchors at the top left out)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")
                   and (rel / d).as_posix() not in IGNORED]
        out += [(rel / name).as_posix() for name in dirs + files]
    return out


PATHS = _repository_paths()


def _prose(text: str) -> str:
    """The text outside fenced code blocks (their lines blanked, so numbers stay)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def references(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, reference) for each path, module or link ``text`` names."""
    prose, found = _prose(text), []
    for m in SPAN.finditer(prose):
        line = prose.count("\n", 0, m.start()) + 1
        if OTHERS.search(prose[max(0, m.start() - 40):m.start()]):
            continue
        words = m.group(2).split()
        for i, word in enumerate(words):
            word = word.lstrip("('\"").rstrip(",;:.)'\"")
            if i and words[i - 1] == "-m":
                if word.split(".")[0] in PACKAGES:
                    found.append((line, "runs", word))
            elif MODULE.match(word):
                found.append((line, "module", word))
            elif _is_path(word):
                found.append((line, "path", word))
    for m in LINK.finditer(prose):
        target = m.group(1).split("#")[0]
        if target and not re.match(r"^[a-z]+:", target):
            found.append((prose.count("\n", 0, m.start()) + 1, "link", target))
    return found


def _is_path(word: str) -> bool:
    if (not word or any(c in word for c in "<>{}$=") or "..." in word or "://" in word
            or word.startswith(("/", "~", "-", "./", ".."))):
        return False
    name = word.split("::")[0]
    if name.startswith("unified_amp/backends/"):  # the installed name of backends/
        name = name[len("unified_amp/"):]
    if name.split("/")[0] in IGNORED or name.rstrip("/") in IGNORED:
        return False
    has_ext = re.search(rf"[\w*]\.({'|'.join(EXTENSIONS)})$", name) is not None
    if "/" not in name:
        return re.search(rf"[\w*]\.({'|'.join(SOURCE_EXTENSIONS)})$", name) is not None
    return has_ext or name.endswith("/") or (ROOT / name.split("/")[0]).exists()


def _exists(word: str) -> bool:
    name = word.split("::")[0].rstrip("/")
    if name.startswith("unified_amp/backends"):  # installed as unified_amp.backends
        name = name[len("unified_amp/"):]
    pattern = re.escape(name).replace(r"\*", "[^/]*")
    if (ROOT / name.split("/")[0]).exists() and "/" in name:
        found = [p for p in PATHS if re.fullmatch(pattern, p)]
    else:  # relative to some package, or a bare file name
        found = [p for p in PATHS if re.fullmatch(rf"(.*/)?{pattern}", p)]
    if not found:
        return False
    if "::" in word:  # tests/x.py::test_name[case]: that test is defined there
        test = word.split("::")[1].split("[")[0]
        return any(re.search(rf"^\s*(async )?def {re.escape(test)}\(",
                             (ROOT / p).read_text(), re.M) for p in found)
    return True


def _module_exists(name: str) -> bool:
    parts = name.split(".")
    # the longest prefix that is a module; of a dotted name, at least its first two parts
    for end in range(len(parts), min(2, len(parts)) - 1, -1):
        base = ROOT.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def _runs(name: str) -> bool:
    """``python -m name`` runs something: a package's ``__main__.py``, or a module with a
    main block."""
    base = ROOT.joinpath(*name.split("."))
    if (base / "__main__.py").is_file():
        return True
    return base.with_suffix(".py").is_file() and "__name__ == \"__main__\"" in \
        base.with_suffix(".py").read_text()


def dead(doc: Path) -> list[str]:
    out = []
    for line, kind, ref in references(doc.read_text()):
        ok = {"path": lambda: _exists(ref), "module": lambda: _module_exists(ref),
              "runs": lambda: _runs(ref), "link": lambda: (doc.parent / ref).exists()}[kind]()
        if not ok:
            out.append(f"{doc.relative_to(ROOT)}:{line}: {kind} {ref}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_names_exists(doc):
    assert dead(doc) == []


def test_the_check_finds_each_kind_of_dead_reference():
    """The rules on a page of their own: what they must catch and what they must pass."""
    page = "\n".join([
        "Live: `tests/fake_cuda.py`, `scaler/_machine.py`, `autocast.py`, `benchmarks/`,",
        "`python -m benchmarks report`, `benchmarks.workloads.Workload`, [DESIGN](DESIGN.md),",
        "`tests/native/test_torch_fake_cuda_*.py`, `tests/test_doc_paths.py::test_every_"
        "file_a_doc_names_exists[README.md]`, `make bench NAME=overhead`, `x/y ratios`,",
        "`.matrix/venv`, `data/cifar-10-batches-py`, `<backend>-cpu.json`, `$OUT/env.txt`,",
        "torch's `amp/grad_scaler.py`, MegEngine's `grad_scaler.py`.",
        "```sh", "bash tests/nowhere.sh `unified_amp/fenced_away.py`", "```",
        "Dead: `unified_amp/_scaler_step.py`, `_scaler_machine.py`, `scaler/_gone.py`,",
        "`python -m benchmarks.host_cost`, `benchmarks.defaults_cost`, [gone](GONE.md),",
        "`python -m benchmarks.workloads` (a module that runs nothing),",
        "`tests/native/test_nothing_*.py`, `tests/test_doc_paths.py::test_nothing`,",
        "`docs/`", "(`benchmarks/results/nothing.json`), the core's `_gone.py`."])
    doc = ROOT / "docs" / "PAGE.md"
    found = {ref: kind for _, kind, ref in references(page)}
    assert "tests/nowhere.sh" not in found and "unified_amp/fenced_away.py" not in found
    for skipped in (".matrix/venv", "data/cifar-10-batches-py", "<backend>-cpu.json",
                    "$OUT/env.txt", "x/y", "NAME=overhead", "make", "amp/grad_scaler.py",
                    "grad_scaler.py"):
        assert skipped not in found
    checks = {"path": _exists, "module": _module_exists, "runs": _runs,
              "link": lambda ref: (doc.parent / ref).exists()}
    verdicts = {ref: checks[kind](ref) for ref, kind in found.items()}
    assert verdicts == {
        "tests/fake_cuda.py": True, "scaler/_machine.py": True, "autocast.py": True,
        "benchmarks/": True, "benchmarks": True, "benchmarks.workloads.Workload": True,
        "DESIGN.md": True, "tests/native/test_torch_fake_cuda_*.py": True,
        "tests/test_doc_paths.py::test_every_file_a_doc_names_exists[README.md]": True,
        "docs/": True,
        "unified_amp/_scaler_step.py": False, "_scaler_machine.py": False,
        "scaler/_gone.py": False, "benchmarks.host_cost": False,
        "benchmarks.defaults_cost": False, "GONE.md": False, "benchmarks.workloads": False,
        "tests/native/test_nothing_*.py": False,
        "tests/test_doc_paths.py::test_nothing": False,
        "benchmarks/results/nothing.json": False, "_gone.py": False}
