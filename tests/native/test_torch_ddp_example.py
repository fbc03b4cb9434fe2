"""examples/ddp_train.py, launched as its docstring says: torchrun with 2 processes (gloo
on this CPU machine), with an inf planted in rank 1's data at one step."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_ddp_example_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", "-m", "examples.ddp_train", "--steps", "12",
           "--overflow-at", "3", "--out", str(tmp_path)]
    # The timeout only turns a hang into a failure; a run takes a few seconds.
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "weights identical on all ranks: True" in run.stdout
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # nccl only with a GPU per process; on a 1-GPU machine the ranks share the CPU
    want = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert (r0["world"], r0["backend"]) == (2, want)
    assert r0["scales"] == r1["scales"]
    assert r0["stepped"] == r1["stepped"]
    assert [i for i, s in enumerate(r0["stepped"]) if not s] == [3]
    assert r0["scales"][3] == r0["scales"][2] / 2
    assert r0["weights_identical"] and r1["weights_identical"]
    assert r0["stats"]["skipped_steps"] == 1 and r0["stats"]["steps"] == 12
    assert np.isfinite(r0["losses"]).all() and not np.isfinite(r1["losses"][3])
    assert np.mean(r0["losses"][-3:]) < r0["losses"][0]
