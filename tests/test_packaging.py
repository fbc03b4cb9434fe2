"""Packaging: what the extras promise, and a real install of the wheel into a fresh
environment next to the frameworks this interpreter already has."""

import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

import unified_amp as amp
from unified_amp import _registry

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ModuleNotFoundError:  # CPython 3.10, MegEngine's environment; pytest needs tomli
    import tomli as tomllib


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_install_hints_quote_the_extras():
    """The error messages tell users to pip install the framework in the versions of the
    extra; the two must not drift apart."""
    extras = pyproject()["project"]["optional-dependencies"]
    for name, requirements in _registry.REQUIREMENTS.items():
        assert extras[name] == list(requirements), name


def test_extras_are_ranges_and_the_pins_live_in_constraints():
    project = pyproject()["project"]
    torch_req = project["optional-dependencies"]["torch"]
    assert [r for r in torch_req if "==" in r] == [], "pins belong in constraints/"
    assert "numpy" in " ".join(project["dependencies"])
    for name in ("torch", "megengine"):
        pins = (ROOT / "constraints" / f"{name}.txt").read_text()
        assert re.search(rf"^{name}==\d", pins, re.M | re.I), name


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The same step on both frameworks")[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _visible_site_packages(tmp: Path) -> Path:
    """A directory of links to everything in this interpreter's site-packages except
    unified_amp itself (an editable install here) and .pth files, so that a fresh venv
    can see the installed frameworks without seeing this checkout."""
    view = tmp / "site-view"
    view.mkdir()
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        name = entry.name.lower()
        if (name.startswith(("unified_amp", "__editable__", "_unified_amp"))
                or name.endswith(".pth")):
            continue
        (view / entry.name).symlink_to(entry)
    return view


@pytest.mark.slow
def test_wheel_installs_beside_the_framework_already_here_and_runs_the_readme(tmp_path):
    backend = amp.get_backend().name
    framework = _registry._BUILTIN[backend][1]
    # Build from a copy of what the wheel is declared to contain, so that nothing else in
    # the checkout can leak in and the checkout gets no build/ or egg-info.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(["cp", "-r", str(ROOT / "unified_amp"), str(src)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("unified_amp-*.whl")
    top_level = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"unified_amp"}
    assert "unified_amp/py.typed" in zipfile.ZipFile(wheel).namelist()

    # A fresh venv that sees this interpreter's packages (the framework, numpy), not
    # this checkout; the wheel goes in with its dependencies but no index: pip must find
    # every requirement of the extra satisfied by what is there, and leave it alone.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig;"
                           " print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "outer.pth").write_text(f"{_visible_site_packages(tmp_path)}\n")
    version = f"import {framework}; print({framework}.__version__)"
    before = subprocess.run([str(python), "-c", version], capture_output=True, text=True,
                            check=True).stdout
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         f"{wheel}[{backend}]"], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    installed = re.search(r"Successfully installed (.*)", install.stdout).group(1).split()
    assert [p for p in installed if not re.match(r"unified[-_]amp-", p)] == []
    after = subprocess.run([str(python), "-c", version], capture_output=True, text=True,
                           check=True).stdout
    assert after == before

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["UNIFIED_AMP_BACKEND"] = backend
    # A project of the user's with a package of its own called `backends`.
    project = tmp_path / "project"
    (project / "backends").mkdir(parents=True)
    (project / "backends" / "__init__.py").write_text("OWNER = 'the project'\n")
    (project / "readme_example.py").write_text(_readme_example())
    check = textwrap.dedent("""
        import runpy, sys
        import backends
        namespace = runpy.run_path("readme_example.py")   # the README's code, verbatim
        import unified_amp
        losses = namespace["losses"]
        print(unified_amp.__file__)
        print(backends.OWNER, losses[-1] < 0.8 * losses[0])
    """)
    run = subprocess.run([str(python), "-c", check], cwd=project, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    module_file, verdict = run.stdout.strip().splitlines()[-2:]
    assert Path(module_file).is_relative_to(Path(site))  # the installed copy, not ROOT
    assert verdict == "the project True"

    # The adapters are unified_amp.backends now: no top-level `backends` was installed.
    bare = subprocess.run([str(python), "-c", "import backends"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert bare.returncode != 0
    assert "No module named 'backends'" in bare.stderr
