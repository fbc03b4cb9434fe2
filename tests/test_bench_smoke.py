"""The benchmark CLI runs end to end on this backend (tiny sizes) and writes its figures."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import unified_amp as amp

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(module, *args, backend=None):
    """``python -m benchmarks.<module> --quick *args`` from the checkout, on ``backend``
    (default: this run's); fails the test with its stderr if it fails."""
    env = dict(os.environ, UNIFIED_AMP_BACKEND=backend or amp.get_backend().name,
               MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--quick",
                           *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_quick_benchmark_writes_json_and_plot(tmp_path):
    backend = amp.get_backend().name
    run_benchmark("bench", "--out", tmp_path)
    (json_path,) = tmp_path.glob(f"{backend}-*-quick.json")
    assert json_path.with_suffix(".png").stat().st_size > 10_000
    result = json.loads(json_path.read_text())
    assert result["config"]["mode"] == "quick" and result["config"]["backend"] == backend
    for name in ("convnet", "transformer"):
        workload = result["workloads"][name]
        variants = workload["throughput"][0]["variants"]
        for dtype in ("float32", "float16"):  # both backends compute these on CPU
            assert variants[dtype]["samples_per_s"] > 0
            assert math.isfinite(variants[dtype]["final_loss"])
        assert variants["float16"]["scaler"]["steps"] > 0
        overhead = workload["overhead"]
        assert overhead["failed"] == {}
        # Each ratio is taken within a round, of the two variants it names. Not a bound on
        # its value: a quick run's three 2-step rounds on a shared CPU put one at 0.077
        # (torch 2.12.1, load average 5); the figures are the full run's (BENCHMARKS.md).
        for ratio in ("unified", "scaler_only", "trace_on", "trace_off"):
            r = overhead["ratios"][ratio]
            num, den = (overhead["variants"][r[k]]["per_round_step_time_s"]
                        for k in ("numerator", "denominator"))
            assert r["per_round"] == pytest.approx([a / b for a, b in zip(num, den)])
            assert len(r["per_round"]) == overhead["rounds"]
            assert r["median"] == pytest.approx(statistics.median(r["per_round"]))
            assert r["median"] > 0
        levels = workload["opt_levels"]["levels"]
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


def test_quick_compile_benchmark_runs_every_variant(tmp_path):
    """benchmarks/compile.py (torch only): every variant, eager and compiled (with
    fullgraph=True where dynamo traces autocast's switches), trains and is timed; the
    JSON holds each ratio the docs quote."""
    if amp.get_backend().name != "torch":
        pytest.skip("torch.compile is torch's; MegEngine's trace has benchmarks/trace_megengine.py")
    run_benchmark("compile", "--workloads", "transformer", "--out", tmp_path, backend="torch")
    result = json.loads((tmp_path / "torch-cpu-compile-quick.json").read_text())
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


def test_mode_cost_benchmark_times_each_variant(tmp_path):
    """benchmarks/mode_cost.py (torch only): the four variants timed, per call."""
    if amp.get_backend().name != "torch":
        pytest.skip("the contract's function mode is torch's")
    run_benchmark("mode_cost", "--out", tmp_path, backend="torch")
    result = json.loads((tmp_path / "mode-cost-torch.json").read_text())
    assert set(result["us_per_call"]) == {"torch.autocast", "+ empty mode", "amp.autocast",
                                          "amp.autocast(contract=False)"}
    assert all(v["median"] > 0 and v["n"] == 3 for v in result["us_per_call"].values())


def test_host_cost_benchmark_times_each_variant_beside_a_control(tmp_path):
    """benchmarks/host_cost.py on this backend: for every point, the native scaler, the
    unified one and a second native one (the control) timed in the same rounds, and
    both ratios saved with the plot."""
    backend = amp.get_backend().name
    run_benchmark("host_cost", "--out", tmp_path)
    stem = tmp_path / f"host-cost-{backend}-quick"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".png").stat().st_size > 10_000
    points = [v for by_n in result["loops"].values() for v in by_n.values()]
    points += [result["mlp_6x256"]] if backend == "torch" else []
    assert len(points) == 4 + (backend == "torch")
    for v in points:
        assert set(v["per_round"]) == {"native", "unified", "control"}
        for name, times in v["per_round"].items():
            assert len(times) == v["rounds"] and all(t > 0 for t in times), name
        for ratio in (v["ratio"], v["control_ratio"]):
            assert 0.2 < ratio["median"] < 5.0


def test_host_cost_parts_benchmark_takes_each_part_out(tmp_path):
    """benchmarks/host_cost_parts.py on this backend: unified_amp's step with each part
    taken out, beside the whole step and the control, and each part's share; on
    MegEngine also megengine.amp's steps written out, alone and with each part."""
    backend = amp.get_backend().name
    run_benchmark("host_cost_parts", "--out", tmp_path)
    result = json.loads((tmp_path / f"host-cost-parts-{backend}-quick.json").read_text())
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
    """benchmarks/real_models.py: torchvision's ResNet-50 and transformers' GPT-2, every
    variant and the control timed in every round, the ratios saved with the plot. It
    needs torchvision and transformers, which only .venv-integrations-models holds:
    `make test-integrations` runs this test there."""
    if amp.get_backend().name != "torch":
        pytest.skip("the real models are torch's (torchvision, transformers)")
    for package in ("torchvision", "transformers"):
        pytest.importorskip(package, reason="runs in .venv-integrations-models"
                                            " (make test-integrations)")
    run_benchmark("real_models", "--out", tmp_path, backend="torch")
    stem = tmp_path / "real-models-cpu-quick"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".png").stat().st_size > 10_000
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


def test_defaults_cost_benchmark_times_each_swap_beside_a_control(tmp_path):
    """benchmarks/defaults_cost.py on this backend: the MLP step with each piece of
    unified_amp swapped in (and a control), MegEngine's automatic and manual steps by
    tensor count, and the bench's two workloads, each as ratios to the native step."""
    backend = amp.get_backend().name
    run_benchmark("defaults_cost", "--out", tmp_path)
    result = json.loads((tmp_path / f"defaults-cost-{backend}-quick.json").read_text())
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
