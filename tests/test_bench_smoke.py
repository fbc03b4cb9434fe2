"""The benchmark tool (``python -m benchmarks <name>``) runs every named benchmark end to
end on this backend (tiny sizes), writes each section's figures in the one result format,
and its report writes docs/BENCHMARKS.md's tables from them."""

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import pytest

import unified_amp as amp
from benchmarks import __main__ as bench_cli
from benchmarks import results_format, tables

ROOT = Path(__file__).resolve().parents[1]
# Each test runs a benchmark in a subprocess (which has its own 600 s limit); on a loaded
# 2-core machine a quick compile or step section took over the suite's 300 s.
pytestmark = pytest.mark.timeout(900)


def cli(*args, backend=None):
    env = dict(os.environ, UNIFIED_AMP_BACKEND=backend or amp.get_backend().name,
               MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "benchmarks", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def check_shape(result, name, backend):
    """What every result holds, whatever the benchmark: who, where, how, and its rows."""
    assert result["format"] == results_format.FORMAT
    assert result["benchmark"] == name and result["backend"] == backend
    assert result["device"] in ("cpu", "cuda") and result["quick"] is True
    assert result["command"].startswith(f"python -m benchmarks {name} --quick")
    datetime.strptime(result["date"], "%Y-%m-%dT%H:%M:%SZ")
    assert set(result["versions"]) == {"python", "unified_amp", backend}
    assert result["versions"][backend][0].isdigit(), result["versions"]
    # the scripts wrote into a scratch folder; no path of this machine is saved
    assert tempfile.gettempdir() + os.sep not in json.dumps(result["raw"])
    names = [r["name"] for r in result["rows"]]
    assert names and len(names) == len(set(names)), names
    for row in result["rows"]:
        value = row.get("median", row.get("value"))
        assert isinstance(value, (int, float)) and math.isfinite(value), row
        if "median" in row and "q1" in row:
            assert row["q1"] <= row["median"] <= row["q3"], row
        if "ratio" in row["name"] and "median" in row:
            assert 0.02 < row["median"] < 50, row  # a ratio of two timed steps, not 0 or inf


def run_benchmark(name, tmp_path, *args, backend=None):
    """``python -m benchmarks <name> --quick *args --out tmp_path``: its results by section
    (each checked for the format's shape); fails the test with stderr if it fails."""
    backend = backend or amp.get_backend().name
    proc = cli(name, "--quick", *args, "--out", tmp_path, backend=backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    for result in results:
        check_shape(result, name, backend)
        assert (tmp_path / results_format.file_name(result)).exists()
    return {r["section"]: r for r in results}


def test_no_name_lists_the_benchmarks_and_an_unknown_one_is_named():
    listed = cli()
    assert listed.returncode == 0
    for name in ("throughput", "overhead", "compile", "trace", "real-models", "cifar",
                 "report"):
        assert f"  {name} " in listed.stdout, listed.stdout
    bad = cli("overheads")
    assert bad.returncode == 2 and "unknown benchmark 'overheads'" in bad.stderr
    assert "the benchmarks are: throughput, overhead" in bad.stderr
    bad = cli("overhead", "--sections", "step,nope")
    assert bad.returncode == 2 and "no section 'nope'" in bad.stderr


def test_quick_throughput_benchmark(tmp_path):
    backend = amp.get_backend().name
    results = run_benchmark("throughput", tmp_path)
    assert set(results) == {"precisions", "opt-levels"}
    assert (tmp_path / f"throughput-precisions-{backend}-cpu-quick.png").stat().st_size > 10_000
    for name in ("convnet", "transformer"):
        variants = results["precisions"]["raw"]["workloads"][name]["throughput"][0]["variants"]
        for dtype in ("float32", "float16"):  # both backends compute these on CPU
            assert variants[dtype]["samples_per_s"] > 0
            assert math.isfinite(variants[dtype]["final_loss"])
        assert variants["float16"]["scaler"]["steps"] > 0
        levels = results["opt-levels"]["raw"]["workloads"][name]["opt_levels"]["levels"]
        assert list(levels) == ["O0", "O1", "O2", "O3"]
        for level, v in levels.items():
            assert v["properties"]["opt_level"] == level
            assert math.isfinite(v["final_loss"]) and v["step_time_s"]["median"] > 0
        assert levels["O1"]["bytes_vs_O0"] == 1.0
        # SGD with momentum: O0 holds weights + momentum in float32 (2 x 4 bytes a
        # weight); O2 2-byte weights + 4-byte masters + momentum. The transformer has no
        # batch norm, so every weight is cast.
        if name == "transformer":
            assert levels["O2"]["bytes_vs_O0"] == 1.25
            o3_masters = levels["O3"]["properties"]["master_weights"]
            assert levels["O3"]["bytes_vs_O0"] == (1.25 if o3_masters else 0.5)
    rows = {r["name"]: r for r in results["opt-levels"]["rows"]}
    assert rows["workloads / transformer / opt_levels / levels / O2 / bytes_vs_O0"][
        "value"] == 1.25


class Sections(dict):
    """The overhead benchmark's quick results by section, each section run on first use
    (one `python -m benchmarks overhead --quick --sections S` per section: all at once
    would outlast one test's time limit on a loaded 2-core machine)."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, section):
        self.update(run_benchmark("overhead", self.folder, "--sections", section))
        return self[section]


@pytest.fixture(scope="module")
def overhead(tmp_path_factory):
    return Sections(tmp_path_factory.mktemp("overhead"))


def test_overhead_sections_on_this_backend():
    backend = amp.get_backend().name
    wanted = bench_cli.sections_of("overhead", None)
    assert [name for name, _ in bench_cli.plan("overhead", wanted, backend)] == [
        "step", "workloads", "host", "parts", *(("mode",) if backend == "torch" else ()),
        "pinning"]


def test_overhead_pinning_section(overhead):
    pinning = {r["name"] for r in overhead["pinning"]["rows"]}
    assert {"ratios / keep_float32/by_hand", "ratios / keep_float32/unpinned"} <= pinning


def test_overhead_workloads_ratios_are_taken_within_a_round(overhead):
    for name in ("convnet", "transformer"):
        result = overhead["workloads"]["raw"]["workloads"][name]["overhead"]
        assert result["failed"] == {}
        # Each ratio is taken within a round, of the two variants it names. Not a bound on
        # its value: a quick run's three 2-step rounds on a shared CPU put one at 0.077
        # (torch 2.12.1, load average 5); the figures are the full run's (BENCHMARKS.md).
        for ratio in ("unified", "scaler_only", "trace_on", "trace_off"):
            r = result["ratios"][ratio]
            num, den = (result["variants"][r[k]]["per_round_step_time_s"]
                        for k in ("numerator", "denominator"))
            assert r["per_round"] == pytest.approx([a / b for a, b in zip(num, den)])
            assert len(r["per_round"]) == result["rounds"]
            assert r["median"] == pytest.approx(statistics.median(r["per_round"]))
            assert r["median"] > 0
        rows = {r["name"]: r for r in overhead["workloads"]["rows"]}
        assert rows[f"workloads / {name} / overhead / ratios / unified"]["median"] == \
            result["ratios"]["unified"]["median"]


def test_quick_compile_benchmark_runs_every_variant(tmp_path):
    """benchmarks/compile.py (torch only): every variant, eager and compiled (with
    fullgraph=True where dynamo traces autocast's switches), trains and is timed; the
    JSON holds each ratio the docs quote."""
    if amp.get_backend().name != "torch":
        pytest.skip("torch.compile is torch's; MegEngine's trace: test_quick_trace_benchmark")
    result = run_benchmark("compile", tmp_path, "--workloads", "transformer",
                           backend="torch")["compile"]["raw"]
    assert result["fullgraph"] is True
    workload = result["workloads"]["transformer"]
    steps = workload["step_ms_median"]
    assert len(steps) == 8 and all(math.isfinite(v) and v > 0 for v in steps.values()), steps
    assert set(workload["first_call_s (compiles)"]) == {
        name for name in steps if name.endswith(", compiled")}
    for name, ratio in workload["ratios"].items():
        assert 0.05 < ratio["median"] < 20, (name, ratio)
    whole = result["whole_step_compiled"]["transformer"]
    assert set(whole["step_ms_median"]) == {"native", "control (native again)",
                                            "unified, contract off", "unified"}
    assert set(whole["ratios"]) == {f"{side} / native" for side in whole["step_ms_median"]
                                    if side != "native"}
    assert all(0.05 < r["median"] < 20 for r in whole["ratios"].values()), whole["ratios"]


def test_overhead_mode_section_times_each_variant(overhead):
    """The overhead's mode section (torch only): the four variants timed, per call."""
    if amp.get_backend().name != "torch":
        pytest.skip("the contract's function mode is torch's")
    result = overhead["mode"]["raw"]
    assert set(result["us_per_call"]) == {"torch.autocast", "+ empty mode", "amp.autocast",
                                          "amp.autocast(contract=False)"}
    assert all(v["median"] > 0 and v["n"] == 3 for v in result["us_per_call"].values())


def test_overhead_host_section_times_each_variant_beside_a_control(overhead):
    """The overhead's host section on this backend: for every point, the native scaler,
    the unified one and a second native one (the control) timed in the same rounds, and
    both ratios saved with the plot."""
    backend = amp.get_backend().name
    result = overhead["host"]["raw"]
    png = overhead.folder / f"overhead-host-{backend}-cpu-quick.png"
    assert png.stat().st_size > 10_000
    points = [v for by_n in result["loops"].values() for v in by_n.values()]
    points += [result["mlp_6x256"]] if backend == "torch" else []
    assert len(points) == 4 + (backend == "torch")
    for v in points:
        assert set(v["per_round"]) == {"native", "unified", "control"}
        for name, times in v["per_round"].items():
            assert len(times) == v["rounds"] and all(t > 0 for t in times), name
        for ratio in (v["ratio"], v["control_ratio"]):
            assert 0.2 < ratio["median"] < 5.0


def test_overhead_parts_section_takes_each_part_out(overhead):
    """The overhead's parts section (benchmarks/host_cost_parts.py): unified_amp's step with each part
    taken out, beside the whole step and the control, and each part's share; on
    MegEngine also megengine.amp's steps written out, alone and with each part."""
    backend = amp.get_backend().name
    result = overhead["parts"]["raw"]
    (point,) = result["points"].values()
    parts = {"megengine": ["float32/device guard", "ledger", "forensics", "trace checks"],
             "torch": ["backward watch", "ledger", "forensics"]}[backend]
    floor = {"straight line", "straight line + all",
             *(f"straight line + {p}" for p in parts)} if backend == "megengine" else set()
    assert set(point["ratio"]) == {"unified", "control", "without all",
                                   *(f"without {p}" for p in parts), *floor}
    assert set(point["share"]) == {*parts, "all"}
    for name, times in point["per_round"].items():
        assert len(times) == 3 and all(t > 0 for t in times), name
    if backend == "megengine":
        assert result["python_call"]["idle_us"]["median"] > 0


def test_real_models_benchmark_times_each_variant_beside_a_control(tmp_path):
    """The real-models benchmark (benchmarks/real_models.py): torchvision's ResNet-50 and transformers' GPT-2, every
    variant and the control timed in every round, the ratios saved with the plot. It
    needs torchvision and transformers, which only .venv-integrations-models holds:
    `make test-integrations` runs this test there."""
    if amp.get_backend().name != "torch":
        pytest.skip("the real models are torch's (torchvision, transformers)")
    for package in ("torchvision", "transformers"):
        pytest.importorskip(package, reason="runs in .venv-integrations-models"
                                            " (make test-integrations)")
    result = run_benchmark("real-models", tmp_path, backend="torch")["models"]["raw"]
    assert (tmp_path / "real-models-models-torch-cpu-quick.png").stat().st_size > 10_000
    assert set(result["models"]) == {"resnet50", "gpt2"}
    for name, r in result["models"].items():
        assert set(r["per_round_s"]) == {"native", "control", "unified",
                                         "unified, contract off", "scaler only"}, name
        for variant, times in r["per_round_s"].items():
            assert len(times) == 2 and all(t > 0 for t in times), (name, variant)
            assert math.isfinite(r["final_loss"][variant]), (name, variant)
        assert set(r["ratio_to_native"]) == set(r["per_round_s"]) - {"native"}
        for ratio in r["ratio_to_native"].values():
            assert 0.2 < ratio["median"] < 5.0


def test_overhead_step_section_times_each_swap_beside_a_control(overhead):
    """The overhead's step section (benchmarks/defaults_cost.py): the MLP step with each piece of
    unified_amp swapped in (and a control), MegEngine's automatic and manual steps by
    tensor count, and the bench's two workloads, each as ratios to the native step."""
    backend = amp.get_backend().name
    result = overhead["step"]["raw"]
    mlp = result["mlp"]
    assert list(mlp["ratios"]) == [
        "control", "the scaler only", "amp.autocast(contract=False) only",
        "amp.autocast() only", "both, contract off", "both, the defaults"]
    if backend == "torch":  # the mode's floor: a table of its own
        assert list(result["mode_floor"]["ratios"]) == [
            "control", "amp.autocast() only", "torch.autocast + an empty function mode"]
    else:
        assert "mode_floor" not in result
    assert mlp["dtype"] == {"torch": "bfloat16", "megengine": "float16"}[backend]
    for name, times in mlp["per_round"].items():
        assert len(times) == 3 and all(t > 0 for t in times), name
    ratios = [*mlp["ratios"].values(),
              *(v[key] for v in result["workloads"].values()
                for key in ("ratio", "control_ratio"))]
    if backend == "megengine":
        steps = result["megengine_steps"]
        assert {form: list(by_n) for form, by_n in steps.items()} == {
            "automatic": ["10", "100"], "manual": ["10", "100"]}
        ratios += [v[key] for by_n in steps.values() for v in by_n.values()
                   for key in ("ratio", "control_ratio")]
    assert set(result["workloads"]) == {"convnet", "transformer"}
    for ratio in ratios:
        assert 0.2 < ratio["median"] < 5.0
    work = result["python_work"]
    counted = {"mlp", *(("automatic 10", "automatic 100") if backend == "megengine" else ())}
    # from CPython 3.12 on the bytecode count is skipped (see python_work's docstring)
    assert set(work) == (counted if sys.version_info < (3, 12) else set())
    assert all(v["native"] > 100 and v["unified scaler"] > 100 for v in work.values())


def test_quick_trace_benchmark_and_each_backends_refusal(tmp_path):
    """trace runs on MegEngine (eager vs jit.trace, both scalers); compile and trace each
    refuse the other backend by name, before anything runs."""
    backend = amp.get_backend().name
    other = {"torch": "trace", "megengine": "compile"}[backend]
    proc = cli(other, "--quick", "--out", tmp_path)
    assert proc.returncode == 2 and f"does not run on {backend!r}" in proc.stderr
    assert not list(tmp_path.iterdir())
    if backend != "megengine":
        return
    result = run_benchmark("trace", tmp_path)["trace"]
    assert any("ratio" in r["name"] for r in result["rows"]), result["rows"]


def test_quick_cifar_benchmark_trains_fp32_unified_and_native_in_turn(tmp_path):
    result = run_benchmark("cifar", tmp_path)["native"]
    raw = result["raw"]
    assert set(raw["runs"]) == {"fp32", "AMP", "native"}
    assert raw["epochs_run"] == 2
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["throughput_vs_native"]["median"] == raw["throughput_vs_native"]["median"]
    assert rows["runs / native / samples_per_s"]["value"] > 0
    assert isinstance(raw["weights_identical_to_native"], bool)


DOC = """# Benchmarks

Prose before the tables stays.

{begin}
old tables
{end}

Prose after them stays too.
"""


def test_report_writes_the_latest_full_results_between_the_markers(overhead, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    older, newer = (dict(overhead["step"], quick=False, date=d)
                    for d in ("2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"))
    newer["rows"] = [dict(r, median=r["median"] * 2) if "median" in r else r
                     for r in newer["rows"]]
    (folder / "a.json").write_text(json.dumps(older))
    (folder / "b.json").write_text(json.dumps(newer))
    (folder / "quick.json").write_text(json.dumps(overhead["workloads"]))  # quick: left out
    (folder / "old-format.json").write_text(json.dumps({"schema": 1}))  # not the format
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(DOC.format(begin=tables.BEGIN, end=tables.END))
    proc = cli("report", "--results", folder, "--doc", doc)
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nProse before the tables stays.\n\n" + tables.BEGIN)
    assert text.endswith(tables.END + "\n\nProse after them stays too.\n")
    assert "old tables" not in text and text.count("### overhead / step") == 1
    assert "2026-02-01" in text and "2026-01-01" not in text
    assert "### overhead / workloads" not in text
    shown = [r for r in newer["rows"] if "ratio" in r["name"]]
    assert shown
    for row in shown:
        assert f"| {row['name']} | {tables._number(row['median'])} |" in text
    assert cli("report", "--results", folder, "--doc", doc, "--check").returncode == 0
    assert doc.read_text() == text  # a second run changes nothing
    doc.write_text(text.replace(shown[0]["name"], "edited by hand"))
    stale = cli("report", "--results", folder, "--doc", doc, "--check")
    assert stale.returncode == 1 and "out of date" in stale.stderr
    doc.write_text("# no markers\n")
    missing = cli("report", "--results", folder, "--doc", doc)
    assert missing.returncode == 2 and "no generated-table markers" in missing.stderr


def test_committed_tables_are_those_the_committed_results_give():
    """docs/BENCHMARKS.md's tables are what `python -m benchmarks report` writes from
    benchmarks/results/ (nobody edited a figure by hand, no result is missing)."""
    proc = cli("report", "--check")
    assert proc.returncode == 0, proc.stderr
