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


def test_version_agrees_in_pyproject_the_package_and_the_changelog():
    """One version, said three times: pyproject.toml's (what pip installs),
    unified_amp.__version__ (what a user's code reads) and CHANGELOG.md's latest entry
    (what a reader is told changed). A bump that misses one of them fails here."""
    declared = pyproject()["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    entries = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert entries, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' entry"
    latest, _date = entries[0]
    assert (declared, amp.__version__, latest) == (declared,) * 3, (
        f"pyproject.toml says {declared}, unified_amp.__version__ {amp.__version__},"
        f" CHANGELOG.md's latest entry {latest}")
    # Newest first, as Keep a Changelog orders them.
    versions = [tuple(map(int, v.split("."))) for v, _ in entries]
    assert versions == sorted(versions, reverse=True), versions


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The same step on both frameworks")[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _site_dirs() -> list[Path]:
    """This interpreter's site-packages directories in import order: its own, then any
    that a .pth file added (an overlay environment sees its base's that way, as
    `make test-integrations`' environments and tests/README's dev overlays do)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    added = [Path(p) for p in sys.path if Path(p).name == "site-packages"]
    return [purelib] + [p for p in added if p != purelib and p.is_dir()]


def _project(entry: Path) -> str:
    """The distribution a ``*.dist-info`` directory is the metadata of, normalized."""
    return re.sub(r"[-_.]+", "-", entry.name.split("-")[0]).lower()


def _visible_site_packages(tmp: Path) -> Path:
    """A directory of links to everything installed for this interpreter except
    unified_amp itself (an editable install here) and .pth files, so that a fresh venv
    can see the installed frameworks without seeing this checkout. Where two site
    directories hold the same package, the one this interpreter imports wins, and pip
    sees that one distribution only."""
    view = tmp / "site-view"
    view.mkdir()
    distributions = set()
    for site_dir in _site_dirs():
        for entry in sorted(site_dir.iterdir()):
            name = entry.name.lower()
            if (name.startswith(("unified_amp", "__editable__", "_unified_amp"))
                    or name.endswith(".pth") or (view / entry.name).exists()):
                continue
            if name.endswith(".dist-info"):
                if _project(entry) in distributions:
                    continue
                distributions.add(_project(entry))
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
    for name in ("unified_amp", "backends"):  # backends/ installs as unified_amp.backends
        subprocess.run(["cp", "-r", str(ROOT / name), str(src)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("unified_amp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"unified_amp"}
    assert "unified_amp/py.typed" in names
    # Both adapters, every module of each, under unified_amp.backends.
    for adapter in ("torch_backend", "megengine_backend"):
        shipped = {n.rsplit("/", 1)[1] for n in names
                   if n.startswith(f"unified_amp/backends/{adapter}/")}
        on_disk = {p.name for p in (ROOT / "backends" / adapter).glob("*.py")}
        assert shipped == on_disk and "__init__.py" in shipped, adapter

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
    # --isolated: not this machine's pip configuration either, whose find-links or
    # extra indexes may offer another build of the framework (a local torch 2.13.0+cpu
    # once replaced a torch 2.12.1 here); with --no-index, pip can only take what is
    # installed, or fail.
    pip = [sys.executable, "-m", "pip", "--isolated", "--python", str(python)]
    install = subprocess.run([*pip, "install", "--no-index", f"{wheel}[{backend}]"],
                             capture_output=True, text=True)
    # pip leaves an installed framework alone only where its own requirements are met
    # here: torch 2.11 and 2.12 require setuptools<82, so an environment made with a
    # newer setuptools (constraints/torch.txt's, locked for torch 2.13) cannot keep them.
    broken = "" if install.returncode == 0 else subprocess.run(
        [*pip, "check"], capture_output=True, text=True).stdout
    assert install.returncode == 0, (
        f"pip could not install the wheel beside what is here; `pip check` says:\n{broken}"
        f"\n{install.stdout}{install.stderr}")
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


# -- the top-level backends/ directory ---------------------------------------------------
def _plain_checkout_run(code: str, cwd: Path, root: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs ``code`` in this interpreter as a plain checkout would: the checkout ``root``
    on sys.path and nothing of an editable install of it. setuptools installs one in one
    of three forms: a finder on sys.meta_path (with a path hook and a placeholder entry
    on sys.path for namespace packages) defined in its generated ``__editable___*``
    module; a link tree under ``build/__editable__.*`` on sys.path; or the project root
    itself on sys.path (``editable_mode=compat``), which is what a plain checkout has
    anyway. Exactly those are taken out; every other finder and hook stays (the path
    hook that reads directories above all)."""
    prelude = textwrap.dedent(f"""
        import sys

        def _editable(hook):
            owner = getattr(hook, "__self__", hook)  # a path hook is a bound classmethod
            return str(getattr(owner, "__module__", "")).startswith("__editable__")

        sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
        sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
        sys.path[:] = [p for p in sys.path if "__editable__" not in str(p)]
        sys.path_importer_cache.clear()
        sys.path.insert(0, {str(root)!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["UNIFIED_AMP_BACKEND"] = amp.get_backend().name
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_import_backends_refuses_instead_of_loading_a_second_copy_of_an_adapter():
    """From the repository root `backends` is importable by that name; importing it so
    would load the adapters again as other modules (a second set of torch's autocast
    kernels, of MegEngine's patched functions). It refuses, naming the right import."""
    adapter = f"{amp.get_backend().name}_backend"
    run = _plain_checkout_run(f"""
        import unified_amp as amp
        amp.get_backend()
        try:
            import backends.{adapter}
        except ImportError as exc:
            print("refused:", exc)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "backends"))
        print(sys.modules["unified_amp.backends.{adapter}"].__file__)
    """, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    refused, loaded, adapter_file = run.stdout.strip().splitlines()[-3:]
    assert refused.startswith("refused:") and "'unified_amp.backends'" in refused
    assert loaded == "[]"
    assert Path(adapter_file) == ROOT / "backends" / adapter / "__init__.py"


def test_a_plain_checkout_on_sys_path_imports_the_adapters_as_an_install_does(tmp_path):
    """No install, so no package-dir mapping: the registry binds backends/ as
    unified_amp.backends on first use, and the adapter modules import by their names."""
    adapter = f"{amp.get_backend().name}_backend"
    run = _plain_checkout_run(f"""
        import unified_amp as amp
        print("unified_amp.backends" in sys.modules)
        backend = amp.get_backend()
        import unified_amp.backends.{adapter}.scaling as scaling
        print(type(backend).__module__, scaling.__file__)
        print(amp.GradScaler(init_scale=8.0).get_scale())
    """, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    bound_early, where, scale = run.stdout.strip().splitlines()[-3:]
    assert bound_early == "False"  # nothing is bound before the first adapter lookup
    module, path = where.split()
    assert module == f"unified_amp.backends.{adapter}"
    assert Path(path) == ROOT / "backends" / adapter / "scaling.py"
    assert scale == "8.0"  # the adapter's scaler class made and ran


def test_a_checkout_keeps_working_beside_a_stale_adapters_directory(tmp_path):
    """Before the adapters moved to the top-level backends/, they lived in
    unified_amp/backends/; git leaves the ignored __pycache__ folders of a checkout made
    then, which Python takes for a namespace package unified_amp.backends without any
    adapter in it. The registry binds the real backends/ over it."""
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("unified_amp", "backends"):
        subprocess.run(["cp", "-r", str(ROOT / name), str(root)], check=True)
    adapter = f"{amp.get_backend().name}_backend"
    (root / "unified_amp" / "backends" / adapter / "__pycache__").mkdir(parents=True)
    run = _plain_checkout_run(f"""
        import importlib.util
        import unified_amp as amp
        print(importlib.util.find_spec("unified_amp.backends").origin)  # namespace: None
        backend = amp.get_backend()
        import unified_amp.backends.{adapter}.scaling as scaling
        print(scaling.__file__)
        print(amp.GradScaler(init_scale=8.0).get_scale())
    """, cwd=tmp_path, root=root)
    assert run.returncode == 0, run.stderr[-3000:]
    stale, path, scale = run.stdout.strip().splitlines()[-3:]
    assert stale == "None"  # the stale directory is there, as a namespace portion
    assert Path(path) == root / "backends" / adapter / "scaling.py"
    assert scale == "8.0"


def test_a_test_that_never_returns_fails_with_its_name_instead_of_stalling_the_suite(tmp_path):
    """pyproject.toml gives every test a time limit that ends even a hang inside a C call
    that never returns to Python (oneDNN's, docs/CIFAR.md): the watchdog thread names the
    test and ends the process. Here a test blocks in libc's sleep() under the suite's own
    settings, with the limit lowered to 2 s."""
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent("""
        import ctypes

        def test_stuck_in_c():
            ctypes.CDLL(None).sleep(60)
        """))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=2", str(tmp_path)],
        capture_output=True, text=True, timeout=50)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Timeout" in out and "test_stuck_in_c" in out, out
    assert "Stack of" in out, out  # the thread method's dump: the process was ended
