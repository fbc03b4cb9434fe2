"""The benchmark CLI runs end to end on this backend (tiny sizes) and writes its figures."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import unified_amp as amp

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_json_and_plot(tmp_path):
    backend = amp.get_backend().name
    env = dict(os.environ, UNIFIED_AMP_BACKEND=backend, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
        for ratio in ("unified", "scaler_only", "trace_on", "trace_off"):
            assert 0.2 < overhead["ratios"][ratio]["median"] < 5.0
