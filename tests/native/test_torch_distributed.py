"""GradScaler across 2 real gloo processes on CPU: DDP, DDP with no_sync() accumulation,
FSDP2 (fully_shard), FSDP1, hand-sharded parameters and GradManager callbacks.

One spawn for the module: both workers run every scenario of torch_dist_scenarios.py and
write their results to files; each test below asserts on one scenario. An inf is planted
on rank 1 only; every rank must skip the same steps, keep the same scale trajectory and
end with the same weights. The controls run the same scenario where nothing agrees (a
per-rank check) and show that the ranks do split there, so the tests can fail.
"""

import pickle
import socket

import numpy as np
import pytest
import torch.multiprocessing as mp

from ..reference import trajectory
from . import torch_dist_scenarios as sc

pytestmark = pytest.mark.slow
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    crash = None
    try:
        mp.spawn(sc.run_all, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True)
    except Exception as exc:  # noqa: BLE001 - each test reports what it lacks
        crash = f"{type(exc).__name__}: {exc}"
    by_rank = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.pkl"
        by_rank.append(pickle.loads(path.read_bytes()) if path.exists() else {})
    return by_rank, crash


def scenario(results, name):
    """The scenario's result on each rank; fails with the worker's traceback if it
    raised, or says why it did not run (an earlier failure, or a crashed worker)."""
    by_rank, crash = results
    out = []
    for rank, res in enumerate(by_rank):
        if name not in res:
            why = f"the workers failed: {crash}" if crash else "an earlier scenario failed"
            pytest.fail(f"rank {rank} did not run {name!r}: {why}")
        if "traceback" in res[name]:
            pytest.fail(f"{name} raised on rank {rank}:\n{res[name]['traceback']}")
        out.append(res[name])
    return out


def expected_history():
    overflows = [s in sc.OVERFLOW_STEPS for s in range(sc.STEPS)]
    ref = trajectory(sc.INIT, 2.0, 0.5, sc.INTERVAL, overflows)
    return [(scale, skipped) for (scale, _), skipped in zip(ref, overflows)]


def assert_same_weights(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_ddp_every_rank_skips_and_equals_one_process_over_the_global_batch(results):
    r0, r1 = scenario(results, "ddp")
    assert r0["history"] == r1["history"] == expected_history()
    assert_same_weights(r0["weights"], r1["weights"])
    single = r0["single"]
    assert single["history"] == expected_history()
    for x, y in zip(r0["weights"], single["weights"]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_ddp_lr_scheduler_follows_the_optimizer_on_every_rank(results):
    r0, r1 = scenario(results, "ddp")
    assert r0["lrs"] == r1["lrs"]
    stepped = [not skipped for _, skipped in expected_history()]
    # the LR decays by 0.9 after each step the optimizer took, and only then
    expected = [0.05 * 0.9 ** sum(stepped[:i]) for i in range(sc.STEPS)]
    np.testing.assert_allclose(r0["lrs"], expected, rtol=1e-12)


def test_ddp_no_sync_accumulation_unscaled_after_the_sync(results):
    r0, r1 = scenario(results, "ddp_no_sync")
    assert r0["history"] == r1["history"] == expected_history()
    assert_same_weights(r0["weights"], r1["weights"])
    np.testing.assert_array_equal(r0["norms"], r1["norms"])
    assert r0["single"]["history"] == expected_history()
    for x, y in zip(r0["weights"], r0["single"]["weights"]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_unscaling_inside_no_sync_is_an_error_on_every_rank(results):
    r0, r1 = scenario(results, "ddp_no_sync_misuse")
    for r in (r0, r1):
        assert r["error"] is not None
        assert "inside DistributedDataParallel.no_sync()" in r["error"]
        assert "Unscale after the synchronising micro-batch" in r["error"]
    # The control, torch.amp's scaler: rank 1 saw its inf and skipped, rank 0 stepped.
    assert (r0["control_scale"], r1["control_scale"]) == (sc.INIT, sc.INIT / 2)
    assert any(not np.array_equal(a, b)
               for a, b in zip(r0["control_weights"], r1["control_weights"]))


def test_fsdp2_dtensor_gradients_agree_like_torch_amp(results):
    r0, r1 = scenario(results, "fsdp2")
    for name in ("ours", "native"):
        assert r0[name]["history"] == r1[name]["history"] == expected_history(), name
        assert_same_weights(r0[name]["weights"], r1[name]["weights"])
    assert_same_weights(r0["ours"]["weights"], r0["native"]["weights"])
    # clip_grad_norm on DTensor gradients is the global norm: the same on both ranks
    np.testing.assert_array_equal(r0["ours"]["norms"], r1["ours"]["norms"])
    assert all(np.isfinite(n) != (s in sc.OVERFLOW_STEPS)
               for s, n in enumerate(r0["ours"]["norms"]))


def test_fsdp2_rank_without_gradients_enters_the_check(results):
    r0, r1 = scenario(results, "fsdp2_gradless_rank")
    assert r0["history"] == r1["history"] == expected_history()
    assert_same_weights(r0["weights"], r1["weights"])


def test_fsdp1_agrees_like_sharded_grad_scaler_and_the_plain_check_splits(results):
    r0, r1 = scenario(results, "fsdp1")
    for name in ("ours", "sharded"):
        assert r0[name]["history"] == r1[name]["history"] == expected_history(), name
    assert_same_weights(r0["ours"]["weights"], r0["sharded"]["weights"])
    assert r0["ours"]["reads"] == r1["ours"]["reads"] == sc.STEPS  # one read per step
    # The control: a per-rank check sees rank 1's inf on rank 1 only.
    plain0, plain1 = r0["plain"]["history"], r1["plain"]["history"]
    assert [s for s, (_, skip) in enumerate(plain0) if skip] == []
    assert [s for s, (_, skip) in enumerate(plain1) if skip] == list(sc.OVERFLOW_STEPS)
    assert plain0[-1][0] != plain1[-1][0]


def test_fsdp1_clip_grad_norm_is_the_global_norm(results):
    r0, r1 = scenario(results, "fsdp1")
    np.testing.assert_array_equal(r0["ours"]["norms"], r1["ours"]["norms"])
    for r in (r0, r1):
        assert "pass the root FSDP module" in r["ours"]["local_clip_error"]


def test_fsdp1_use_orig_params_with_gradless_parameters(results):
    r0, r1 = scenario(results, "fsdp1_orig_params")
    assert r0["history"] == r1["history"] == expected_history()
    assert_same_weights(r0["weights"], r1["weights"])
    assert max(r0["gradless"] + r1["gradless"]) > 0  # some params had no local gradient


def test_hand_sharded_parameters_agree_with_a_process_group(results):
    r0, r1 = scenario(results, "hand_sharded")
    scales = [s for s, _ in expected_history()]
    assert r0["group"]["scales"] == r1["group"]["scales"] == scales
    # one read per step on each rank; rank 1's gradless checks read the agreed flag too
    assert r0["group"]["reads"] == r1["group"]["reads"] == sc.STEPS
    # The control, no group: rank 1 counted the overflow steps as clean and grew.
    assert r0["none"]["scales"] == scales
    assert r1["none"]["scales"][-1] > r0["none"]["scales"][-1]


def test_grad_manager_all_reduce_callbacks_on_torch(results):
    r0, r1 = scenario(results, "callbacks_all_reduce")
    assert r0["history"] == r1["history"] == expected_history()
    assert_same_weights(r0["weights"], r1["weights"])


def test_a_rank_without_a_loss_joins_the_agreement_and_skips_with_the_others(results):
    r0, r1 = scenario(results, "idle_rank")
    overflows = [s in sc.INF_ON_RANK1 for s in range(sc.IDLE_STEPS)]
    ref = trajectory(sc.INIT, 2.0, 0.5, sc.INTERVAL, overflows)
    expected = [(scale, skipped) for (scale, _), skipped in zip(ref, overflows)]
    assert r0["history"] == r1["history"] == expected
    # rank 1's weights move exactly at its clean steps; rank 0's at the steps where it
    # had a loss and nobody overflowed (idle steps have nothing, or zeros, to apply)
    assert r1["changed"] == [not o for o in overflows]
    assert r0["changed"] == [not o and s not in sc.IDLE_ON_RANK0
                             for s, o in enumerate(overflows)]
