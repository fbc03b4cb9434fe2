"""The Makefile's handling of backend names, checked without building anything: an
unknown name fails with the library's own message before any environment is made, and
one backend can be tested without the other's environment."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make(*args: str, **env: str) -> subprocess.CompletedProcess:
    # Not the settings of a `make` that may be running this suite.
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES",
                          "UNIFIED_AMP_BACKEND", "BACKENDS")}
    clean.update(env)
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args],
                          env=clean, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("target", ["demo", "bench", "cifar"])
def test_unknown_backend_stops_with_the_librarys_message(target):
    proc = make(target, UNIFIED_AMP_BACKEND="tensorflow")
    assert proc.returncode != 0
    assert ("Unknown unified_amp backend 'tensorflow' (from the UNIFIED_AMP_BACKEND"
            " environment variable). Valid names: 'megengine', 'torch'.") in proc.stderr
    assert "No rule to make target" not in proc.stderr
    assert "setting up" not in proc.stdout  # nothing was installed


def test_unknown_name_in_backends_stops_make_test():
    proc = make("test", BACKENDS="torch jax")
    assert proc.returncode != 0
    assert "Unknown unified_amp backend 'jax' (from make test BACKENDS=...)" in proc.stderr
    assert "setting up" not in proc.stdout


def test_names_are_matched_without_case_as_the_library_does():
    proc = make("-n", "demo", UNIFIED_AMP_BACKEND=" TORCH ")
    assert proc.returncode == 0, proc.stderr
    assert "UNIFIED_AMP_BACKEND=torch " in proc.stdout
    assert ".venv-torch/bin/python -m examples.cnn_classifier --demo" in proc.stdout


def test_backends_torch_needs_nothing_of_megengine():
    proc = make("-n", "test", "BACKENDS=torch", "PY_MGE=/no/python3.10")
    assert proc.returncode == 0, proc.stderr
    assert "for b in torch;" in proc.stdout
    assert ".venv-megengine" not in proc.stdout and "/no/python3.10" not in proc.stdout


@pytest.mark.parametrize("target", ["test", "fuzz"])
def test_the_cross_backend_fuzz_gets_megengines_interpreter_when_both_run(target):
    """tests/fuzz/test_portable_fuzz.py runs in torch's run and starts MegEngine's
    interpreter: named with both backends (then a missing one fails the test), not
    with one (then the test says why it cannot run)."""
    both = make("-n", target)
    assert both.returncode == 0, both.stderr
    assert "UNIFIED_AMP_MEGENGINE_PYTHON=.venv-megengine/bin/python" in both.stdout
    alone = make("-n", target, "BACKENDS=torch", "PY_MGE=/no/python3.10")
    assert alone.returncode == 0, alone.stderr
    assert "UNIFIED_AMP_MEGENGINE_PYTHON" not in alone.stdout


def test_unknown_name_in_backends_stops_make_test_integrations():
    proc = make("test-integrations", BACKENDS="torch jax")
    assert proc.returncode != 0
    assert ("Unknown unified_amp backend 'jax' (from make test-integrations BACKENDS=...)"
            in proc.stderr)
    assert "setting up" not in proc.stdout


def test_integrations_torch_needs_nothing_of_megengine_and_requires_its_runners():
    proc = make("-n", "test-integrations", "BACKENDS=torch", "PY_MGE=/no/python3.10")
    assert proc.returncode == 0, proc.stderr
    assert "for b in torch;" in proc.stdout
    assert "megengine" not in proc.stdout and "/no/python3.10" not in proc.stdout
    # make test's environment is left alone; a runner missing there is an error
    assert "UNIFIED_AMP_REQUIRE_RUNNERS=1" in proc.stdout
    assert ".venv-integrations-$b/bin/python -m pytest tests/integrations" in proc.stdout


def test_integrations_run_the_real_models_in_their_own_environment_with_torch_only():
    # -B: every recipe, as on a clean clone, even where the environments exist already.
    proc = make("-n", "-B", "test-integrations", "BACKENDS=torch", "PY_MGE=/no/python3.10")
    assert proc.returncode == 0, proc.stderr
    assert "-c constraints/integrations-models.txt" in proc.stdout
    assert ("UNIFIED_AMP_REQUIRE_MODELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
            " .venv-integrations-models/bin/python -m pytest"
            " tests/integrations/test_torch_models.py"
            " tests/test_bench_smoke.py::test_real_models_benchmark") in proc.stdout
    assert "for b in torch models;" in proc.stdout  # in the summary
    proc = make("-n", "-B", "test-integrations", "BACKENDS=megengine")
    assert proc.returncode == 0, proc.stderr
    assert "models" not in proc.stdout


def test_cifar_runs_the_example_on_the_selected_backend():
    proc = make("-n", "cifar", "CIFAR_ARGS=--synthetic 100", UNIFIED_AMP_BACKEND="MegEngine")
    assert proc.returncode == 0, proc.stderr
    assert ("UNIFIED_AMP_BACKEND=megengine MEGENGINE_LOGGING_LEVEL=ERROR"
            " .venv-megengine/bin/python -m examples.cifar --synthetic 100") in proc.stdout


def test_test_matrix_passes_the_cells_asked_for_to_the_matrix_script():
    proc = make("-n", "test-matrix", "MATRIX_TORCH=2.8 2.12", "MATRIX_PYTHON=3.11",
                PYTEST_ARGS="-k compile")
    assert proc.returncode == 0, proc.stderr
    assert ('tools/version_matrix.py --torch "2.8 2.12" --python "3.11" --pytest-args '
            '"-k compile"') in proc.stdout


def test_test_oldest_makes_its_environment_with_the_oldest_cpython_and_its_pins():
    proc = make("-n", "-B", "test-oldest", "PY_OLDEST=/no/python3.10")
    assert proc.returncode == 0, proc.stderr
    assert "/no/python3.10 -m venv .venv-torch-oldest" in proc.stdout
    assert "-c constraints/torch-oldest.txt" in proc.stdout


def test_bench_runs_the_named_benchmark_of_the_one_tool():
    proc = make("-n", "bench", "NAME=overhead", "BENCH_ARGS=--quick --sections step")
    assert proc.returncode == 0, proc.stderr
    assert ".venv-torch/bin/python -m benchmarks overhead --quick --sections step" in proc.stdout
    listing = make("-n", "bench")  # no NAME: the tool lists its benchmarks
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"\.venv-torch/bin/python -m benchmarks\s*$", listing.stdout, re.M)


def test_make_test_runs_torchs_contract_tests_again_on_onednns_avx2_path():
    """CI's CPU has AVX-512 BF16; users' may not: the contract tests, eager and compiled,
    run a second time with oneDNN capped at AVX2 wherever torch is tested."""
    proc = make("-n", "test", "BACKENDS=torch megengine")
    assert proc.returncode == 0, proc.stderr
    avx2 = [ln for ln in proc.stdout.splitlines() if "ONEDNN_MAX_CPU_ISA=AVX2 UNIFIED_AMP_BACKEND=torch" in ln]
    assert len(avx2) == 1, proc.stdout
    for path in ("tests/contract", "tests/native/test_torch_compiled_dtype_table.py",
                 "tests/native/test_torch_recurrent_compiled.py"):
        assert path in avx2[0] and (ROOT / path).exists()
    assert ".venv-torch/bin/python -m pytest" in avx2[0]
    oldest = make("-n", "test-oldest")
    assert oldest.returncode == 0, oldest.stderr
    assert "ONEDNN_MAX_CPU_ISA=AVX2 UNIFIED_AMP_BACKEND=torch .venv-torch-oldest/bin/python" in oldest.stdout
    only_mge = make("-n", "test", "BACKENDS=megengine")
    assert "ONEDNN_MAX_CPU_ISA" not in only_mge.stdout
