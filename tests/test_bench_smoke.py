"""The benchmark tool (``python -m benchmarks <name>``): one argument parser that refuses
what it does not know before a framework loads, every named benchmark run end to end on
this backend (tiny sizes) into the one result format, and the report that writes
docs/BENCHMARKS.md's tables from the results."""

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
from benchmarks import overhead as overhead_section
from benchmarks import report, results_format

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
    assert result["machine"]["cpus"] >= 1 and result["machine"]["threads"] >= 1
    # no path of this machine is saved (cifar's data went to a scratch folder)
    assert tempfile.gettempdir() + os.sep not in json.dumps(result["raw"])
    names = [r["name"] for r in result["rows"]]
    assert names and len(names) == len(set(names)), names
    for row in result["rows"]:
        value = row.get("median", row.get("value"))
        assert isinstance(value, (int, float)) and math.isfinite(value), row
        if "median" in row and "q1" in row:
            assert row["q1"] <= row["median"] <= row["q3"], row
    # what the run printed and the docs' tables show: each section names its rows
    assert report.shown(result), result["section"]


def run_benchmark(name, tmp_path, *args, backend=None):
    """``python -m benchmarks <name> --quick *args --out tmp_path``: its results by section
    (each checked for the format's shape); fails the test with stderr if it fails."""
    backend = backend or amp.get_backend().name
    proc = cli(name, "--quick", *args, "--out", tmp_path, backend=backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = [Path(line[len("== result: "):]) for line in proc.stdout.splitlines()
               if line.startswith("== result: ")]
    assert written, proc.stdout
    results = [json.loads(p.read_text()) for p in written]
    for result in results:
        check_shape(result, name, backend)
        assert (tmp_path / results_format.file_name(result)).exists()
        for label, row in report.shown(result):  # printed as the report shows them
            assert f"  {label}" in proc.stdout and report.cell(row) in proc.stdout
    return {r["section"]: r for r in results}


def per_round_ratio(ratio, num, den):
    """A ratio's figures are its per-round ratios of the two variants' times."""
    assert ratio["per_round"] == pytest.approx([a / b for a, b in zip(num, den)])
    assert ratio["median"] == pytest.approx(statistics.median(ratio["per_round"]))
    assert len(num) == len(den) == ratio["n"]


def test_no_name_lists_the_benchmarks():
    listed = cli()
    assert listed.returncode == 0
    for name in (*bench_cli.BENCHMARKS, "report"):
        assert f"  {name} " in listed.stdout, listed.stdout
    for section in ("eager", "step", "host", "mode", "forensics", "pinning"):
        assert f"{section}: " in listed.stdout


@pytest.mark.parametrize("args, says", [
    (["overheads"], "unknown benchmark 'overheads'; the benchmarks are: throughput,"
                    " overhead"),
    (["overhead", "--sections", "step,nope"], "benchmark 'overhead' has no section 'nope'"),
    (["overhead", "--rounds", "3", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["overhead", "--sections", "mode", "--tf32", "on"],
     "--tf32 does not apply to overhead (mode); it applies to: throughput/precisions"),
    (["compile", "--models", "resnet50"], "--models does not apply to compile"),
    (["overhead", "--workloads", "convnet,mlp"], "--workloads takes a comma-separated"
                                                 " subset of convnet,transformer"),
    (["overhead", "--rounds", "0"], "--rounds must be >= 1; got 0"),
    (["report", "--quick", "--out", "x"],
     "report takes --results, --doc and --check, not --quick, --out"),
    (["--rounds", "3"], "name a benchmark (or report) before its options"),
    (["overhead", "--check"], "--check: options of python -m benchmarks report"),
])
def test_what_the_tool_does_not_know_stops_it_before_a_framework_loads(args, says,
                                                                        tmp_path):
    """Exit status 2 naming the bad name, section or option, with nothing imported of
    either framework and nothing written (one parser for every section: nothing passes
    through)."""
    if args[0] != "report":  # were it to run after all, it writes there
        args = [*args, "--out", str(tmp_path)]
    code = ("import sys; from benchmarks.__main__ import main; rc = main(sys.argv[1:]);"
            " loaded = {'torch', 'megengine'} & set(sys.modules);"
            " assert not loaded, loaded; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, UNIFIED_AMP_BACKEND=amp.get_backend().name))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_quick_throughput_benchmark(tmp_path):
    results = run_benchmark("throughput", tmp_path)
    assert set(results) == {"precisions", "opt-levels"}
    for name in ("convnet", "transformer"):
        variants = results["precisions"]["raw"]["workloads"][name]["throughput"][0]["variants"]
        for dtype in ("float32", "float16"):  # both backends compute these on CPU
            assert variants[dtype]["samples_per_s"] > 0
            assert math.isfinite(variants[dtype]["final_loss"])
        assert variants["float16"]["scaler"]["steps"] > 0
        fp32, fp16 = (variants[d]["per_round_step_time_s"] for d in ("float32", "float16"))
        per_round_ratio(variants["float16"]["speedup_vs_fp32"], fp32, fp16)
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
    (all at once would outlast one test's time limit on a loaded 2-core machine)."""

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
    opts = bench_cli.parser().parse_args(["overhead"])
    assert bench_cli.plan("overhead", bench_cli.choose(opts), backend) == [
        "eager", "step", "rules", "host", *(("mode",) if backend == "torch" else ()), "forensics",
        "pinning"]


def test_overhead_eager_section_times_the_native_step_beside_both_autocasts(overhead):
    """The eager step (issue 40): the native AMP step, a control, and the native loop
    with amp.autocast() or amp.autocast(contract=False) and amp.GradScaler, each ratio
    taken within a round; the calls a forward makes counted exactly."""
    backend = amp.get_backend().name
    result = overhead["eager"]["raw"]
    assert set(result["workloads"]) == {"convnet", "transformer"}
    for name, w in result["workloads"].items():
        times = w["per_round_s"]
        assert list(times) == list(overhead_section.EAGER)
        assert all(len(t) == result["schedule"]["rounds"] and min(t) > 0
                   for t in times.values())
        assert list(w["ratios"]) == list(overhead_section.EAGER[1:])
        for variant, ratio in w["ratios"].items():
            per_round_ratio(ratio, times[variant], times["native"])
        assert all(math.isfinite(loss) for loss in w["final_loss"].values())
        calls = {v: c["unified_amp_calls_per_forward"] for v, c in w["variants"].items()}
        assert set(calls) == {"native", "amp.autocast()", "amp.autocast(contract=False)"}
        if backend == "torch":
            # plain torch.autocast never reaches unified_amp, nor does contract=False
            assert calls["native"] == calls["amp.autocast(contract=False)"] == 0, calls
            assert w["torch_calls_per_forward"] > 10
        assert all(isinstance(c, int) and c >= 0 for c in calls.values())


def test_the_call_counter_counts_calls_into_unified_amp_inside_the_block_only():
    """The eager section's count of Python calls into unified_amp: the block's own entry
    and exit are not the forward's; a call made inside it is."""
    import types

    quiet = types.SimpleNamespace(loss=lambda: None)
    assert overhead_section._count_unified_calls(quiet, amp.autocast) == 0
    asks = types.SimpleNamespace(loss=lambda: [amp.is_autocast_enabled() for _ in range(3)])
    counted = overhead_section._count_unified_calls(asks, amp.autocast)
    assert counted >= 3
    assert overhead_section._count_unified_calls(asks, lambda: amp.autocast(False)) == counted


def test_overhead_step_section_times_each_swap_beside_a_control(overhead):
    backend = amp.get_backend().name
    result = overhead["step"]["raw"]
    mlp = result["mlp"]
    assert list(mlp["ratios"]) == [
        "control", "the scaler only", "amp.autocast(contract=False) only",
        "amp.autocast() only", "both, contract off", "both, the defaults"]
    for name, ratio in mlp["ratios"].items():
        per_round_ratio(ratio, mlp["per_round"][name], mlp["per_round"]["native"])
    if backend == "torch":  # the mode's floor: a table of its own
        assert list(result["mode_floor"]["ratios"]) == [
            "control", "amp.autocast() only", "torch.autocast + an empty function mode"]
    else:
        assert "mode_floor" not in result
    assert mlp["dtype"] == {"torch": "bfloat16", "megengine": "float16"}[backend]


def test_overhead_host_section_times_each_point_beside_a_control(overhead):
    backend = amp.get_backend().name
    result = overhead["host"]["raw"]
    forms = {"torch": ["sgd-foreach", "adam-fused"],
             "megengine": ["sgd", "adam", "sgd-manual"]}[backend]
    assert list(result["loops"]) == forms
    for by_n in result["loops"].values():
        assert list(by_n) == ["10", "100"]
        for v in by_n.values():
            assert list(v["per_round"]) == ["native", "unified", "control"]
            per_round_ratio(v["ratio"], v["per_round"]["unified"], v["per_round"]["native"])
            per_round_ratio(v["control_ratio"], v["per_round"]["control"],
                            v["per_round"]["native"])
    work = result["bytecodes_per_iteration"]["by_tensors"]
    # from CPython 3.12 on the bytecode count is skipped (see benchmarks/host.py)
    assert list(work) == (["10", "100"] if sys.version_info < (3, 12) else [])
    for v in work.values():
        assert v["native_bytecodes"] > 100 and v["unified_bytecodes"] > 100


def test_overhead_mode_section_times_each_variant_per_call(overhead):
    if amp.get_backend().name != "torch":
        pytest.skip("the contract's function mode is torch's")
    result = overhead["mode"]["raw"]
    assert set(result["us_per_call"]) == {"torch.autocast", "+ empty mode", "amp.autocast",
                                          "amp.autocast(contract=False)"}
    assert all(v["median"] > 0 and v["n"] == 3 for v in result["us_per_call"].values())
    assert result["ratio_to_torch_autocast"]["torch.autocast"]["median"] == 1.0


def test_overhead_forensics_section_traces_on_and_off(overhead):
    result = overhead["forensics"]["raw"]
    for w in result["workloads"].values():
        times = w["per_round_s"]
        assert set(times) == {"unified", "control", "traced", "watched"}
        for ratio, variant in (("control", "control"), ("trace_on", "traced"),
                               ("trace_off", "watched")):
            per_round_ratio(w["ratios"][ratio], times[variant], times["unified"])


def test_overhead_pinning_section(overhead):
    result = overhead["pinning"]["raw"]
    assert set(result["ratios"]) == {"keep_float32/by_hand", "keep_float32/unpinned"}
    assert set(result["registered_call_us"]) == {"plain", "registered_float"}


def test_quick_compile_benchmark_runs_every_variant(tmp_path):
    if amp.get_backend().name != "torch":
        pytest.skip("torch.compile is torch's; MegEngine's trace: the test below")
    results = run_benchmark("compile", tmp_path, "--workloads", "transformer",
                            backend="torch")
    workload = results["compile"]["raw"]["workloads"]["transformer"]
    steps = workload["step_s"]
    assert len(steps) == 8 and all(v["median"] > 0 for v in steps.values()), steps
    assert set(workload["first_call_s (compiles)"]) == {
        name for name in steps if name.endswith(", compiled")}
    times = workload["per_round_s"]
    per_round_ratio(workload["ratios"]["unified / native, compiled"],
                    times["unified, compiled"], times["native, compiled"])
    whole = results["whole-step"]["raw"]["whole_step_compiled"]["transformer"]
    assert set(whole["step_s"]) == {"native", "control (native again)",
                                    "unified, contract off", "unified"}
    assert set(whole["ratios"]) == {f"{side} / native" for side in whole["step_s"]
                                    if side != "native"}


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
    result = run_benchmark("trace", tmp_path)["trace"]["raw"]
    assert set(result["workloads"]["convnet"]["ratios_cpu"]) == {
        f"{a}/{b}" for a, b in (("native_fwd_traced", "native"), ("unified_fwd_traced", "unified"),
                                ("unified", "native"), ("unified_fwd_traced", "native_fwd_traced"),
                                ("unified_step_traced", "unified_step"),
                                ("unified_step_traced", "native"))}


def test_quick_cifar_benchmark_trains_fp32_unified_and_native_in_turn(tmp_path):
    result = run_benchmark("cifar", tmp_path)["native"]
    raw = result["raw"]
    assert set(raw["runs"]) == {"fp32", "AMP", "native"}
    assert raw["epochs_run"] == 2
    assert (tmp_path / results_format.file_name(result)).with_suffix(".png").stat(
    ).st_size > 10_000
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["throughput_vs_native"]["median"] == raw["throughput_vs_native"]["median"]
    assert isinstance(raw["weights_identical_to_native"], bool)


def test_real_models_benchmark_times_each_variant_beside_a_control(tmp_path):
    """torchvision's ResNet-50 and transformers' GPT-2, every variant and the control
    timed in every round. It needs torchvision and transformers, which only
    .venv-integrations-models holds: `make test-integrations` runs this test there."""
    if amp.get_backend().name != "torch":
        pytest.skip("the real models are torch's (torchvision, transformers)")
    for package in ("torchvision", "transformers"):
        pytest.importorskip(package, reason="runs in .venv-integrations-models"
                                            " (make test-integrations)")
    result = run_benchmark("real-models", tmp_path, backend="torch")["models"]["raw"]
    assert set(result["models"]) == {"resnet50", "gpt2"}
    for name, r in result["models"].items():
        times = r["per_round_s"]
        assert set(times) == {"native", "control", "unified", "unified, contract off",
                              "scaler only"}, name
        for variant, ratio in r["ratio_to_native"].items():
            per_round_ratio(ratio, times[variant], times["native"])
            assert math.isfinite(r["final_loss"][variant]), (name, variant)


DOC = """# Benchmarks

Prose before the tables stays.

{begin}
old tables
{end}

Prose after them stays too.
"""


def _result(section, backend, date, rows, quick=False, benchmark="overhead"):
    return {"format": results_format.FORMAT, "benchmark": benchmark, "section": section,
            "backend": backend, "device": "cpu", "quick": quick, "date": date,
            "versions": {"python": "3.11.7", "unified_amp": "9.9", backend: "1.2"},
            "command": f"python -m benchmarks {benchmark}", "rows": rows,
            "machine": {"cpus": 2, "cpu": "a CPU", "load_average": [1.5, 1, 1]}}


def _ratio(name, median, n=21):
    return {"name": name, "median": median, "q1": median - 0.01, "q3": median + 0.01, "n": n}


def test_report_writes_the_latest_full_results_between_the_markers(tmp_path):
    """One table per section with a column per backend, the rows the section shows under
    their labels; the newest full result wins; quick results, other formats and the
    sections the page does not show are left out."""
    folder = tmp_path / "results"
    folder.mkdir()
    rows = [_ratio("mlp / ratios / the scaler only", 1.5), _ratio("mlp / native_step_s", 0.1)]
    files = {
        "older": _result("step", "torch", "2026-01-01T00:00:00Z", rows),
        "newer": _result("step", "torch", "2026-02-01T00:00:00Z",
                         [_ratio("mlp / ratios / the scaler only", 1.25)]),
        "megengine": dict(_result("step", "megengine", "2026-01-05T00:00:00Z",
                                  [_ratio("mlp / ratios / the scaler only", 0.75, 15),
                                   _ratio("mlp / ratios / control", 1.0625, 15)]),
                          command="python -m benchmarks.defaults_cost (before 0.2.0;"
                                  " converted)"),
        "quick": _result("step", "torch", "2026-03-01T00:00:00Z",
                         [_ratio("mlp / ratios / the scaler only", 9.0)], quick=True),
        "unshown": _result("host", "torch", "2026-02-01T00:00:00Z",
                           [_ratio("loops / sgd / 10 / ratio", 1.0)]),
        "old-format": {"schema": 1}}
    for stem, data in files.items():
        (folder / f"{stem}.json").write_text(json.dumps(data))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(DOC.format(begin=report.BEGIN, end=report.END))
    proc = cli("report", "--results", folder, "--doc", doc)
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nProse before the tables stays.\n\n" + report.BEGIN)
    assert text.endswith(report.END + "\n\nProse after them stays too.\n")
    assert "old tables" not in text and text.count("### overhead / step") == 1
    assert "| | torch 1.2, cpu | MegEngine 1.2, cpu |" in text
    assert "| the scaler only | 1.25 [1.24–1.26] | 0.75 [0.74–0.76] |" in text
    assert "| control |  | 1.06 [1.05–1.07] |" in text
    assert "native_step_s" not in text and "9.0" not in text and "### overhead / host" not in text
    assert ("- torch 1.2, cpu: `python -m benchmarks overhead` on 2026-02-01 (unified_amp"
            " 9.9, CPython 3.11.7, a CPU, load average 1.5 on 2 CPUs, n = 21 rounds):"
            " [newer.json](results/newer.json)") in text
    # a run by a script the tool replaced: its command names a file that is gone
    assert ("- MegEngine 1.2, cpu: a run of 2026-01-05 by a script the tool replaced"
            " (unified_amp 9.9, CPython 3.11.7, a CPU, load average 1.5 on 2 CPUs,"
            " n = 15 rounds; its command: [megengine.json](results/megengine.json))") in text
    assert "2026-01-01" not in text
    assert cli("report", "--results", folder, "--doc", doc, "--check").returncode == 0
    assert doc.read_text() == text  # a second run changes nothing
    doc.write_text(text.replace("1.25 [", "1.26 ["))
    stale = cli("report", "--results", folder, "--doc", doc, "--check")
    assert stale.returncode == 1 and "out of date" in stale.stderr
    doc.write_text("# no markers\n")
    missing = cli("report", "--results", folder, "--doc", doc)
    assert missing.returncode == 2 and "no generated-table markers" in missing.stderr


def test_every_section_names_the_rows_it_shows():
    """Each section of the tool has its rows in the report (what a run prints), and each
    table the page shows is a section's."""
    sections = {(b, s) for b, bench in bench_cli.BENCHMARKS.items() for s in bench.sections}
    assert set(report.SHOWN) == sections
    assert set(report.ON_THE_PAGE) <= sections


def test_committed_tables_are_those_the_committed_results_give():
    """docs/BENCHMARKS.md's tables are what `python -m benchmarks report` writes from
    benchmarks/results/ (nobody edited a figure by hand, no result is missing)."""
    proc = cli("report", "--check")
    assert proc.returncode == 0, proc.stderr
