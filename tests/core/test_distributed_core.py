"""Cross-rank agreement in the core, on the fake backend with ranks run as threads.

Each rank has its own scaler, parameters and optimizer; the fake group's all-reduce is
a barrier exchange and logs every collective, so the tests can check that every rank
takes the same decisions and issues the same collectives (a rank that issued fewer
would leave the others waiting). The real engines (DDP, FSDP1, FSDP2 on gloo) are in
tests/native/test_torch_distributed.py.
"""

import math
import threading

import pytest

import unified_amp as amp
from unified_amp import _registry

from ..reference import trajectory
from .fake_backend import (
    DistributedFakeBackend,
    FakeGroup,
    FakeModule,
    FakeOptimizer,
    FakeTensor,
    linear_loss,
)

STEPS = 6
INIT, INTERVAL = 2.0**10, 2


@pytest.fixture
def group():
    return FakeGroup(world=2)


@pytest.fixture
def backend(group):
    backend = DistributedFakeBackend(group)
    amp.register_backend("fake", lambda: backend)
    amp.set_backend("fake")
    yield backend
    _registry._reset_for_tests()


def run_ranks(backend, fn, world=2):
    """fn(rank) on each rank in its own thread; returns the results by rank."""
    results, errors = [None] * world, [None] * world

    def target(rank):
        backend.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc
            backend.group._barrier.abort()  # the other ranks fail instead of waiting

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and
                  not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def make_params(kind, n=2):
    params = [FakeTensor([1.0, 2.0]), FakeTensor([0.5])][:n]
    for p in params:
        p.kind = kind
    return params


def torch_form_run(backend, rank, kind, overflow=(), no_grads=(), **scaler_kwargs):
    """torch.amp's loop on one rank: ``overflow`` and ``no_grads`` are sets of
    (rank, step); at a no_grads step this rank's loss reaches none of its params."""
    params = make_params(kind)
    opt = FakeOptimizer(params)
    gm = amp.GradManager(params)
    scaler = amp.GradScaler(INIT, growth_interval=INTERVAL, **scaler_kwargs)
    history = []
    for step in range(STEPS):
        if (rank, step) in no_grads:
            loss = linear_loss([], [])
        else:
            bad = math.inf if (rank, step) in overflow else 1.0
            loss = linear_loss(params, [[bad, 0.5], [0.25]])
        with gm:
            gm.backward(scaler.scale(loss))
        scaler.step(opt)
        scaler.update()
        gm.zero_grad()
        stats = scaler.stats()
        history.append((stats["scale"], stats["growth_tracker"], stats["last_step_skipped"]))
    return {"history": history, "steps": opt.steps, "weights": [p.values for p in params],
            "syncs": backend.syncs_by_rank[rank]}


def skipped(history):
    return [i for i, (_, _, skip) in enumerate(history) if skip]


def expected(overflow_steps):
    ref = trajectory(INIT, 2.0, 0.5, INTERVAL, [s in overflow_steps for s in range(STEPS)])
    return [(scale, tracker, s in overflow_steps) for s, (scale, tracker) in enumerate(ref)]


def test_sharded_gradients_agree_over_the_world_group(backend, group):
    """FSDP1-like shards (different on every rank, no agreement of their own): an inf in
    rank 1's shard makes both ranks skip, with one all-reduce per step and one read."""
    r0, r1 = run_ranks(backend, lambda rank: torch_form_run(
        backend, rank, "sharded", overflow={(1, 2)}))
    assert r0["history"] == r1["history"] == expected({2})
    assert r0["steps"] == r1["steps"] == STEPS - 1  # both skipped step 2
    assert group.log[0] == group.log[1] == ["all_reduce"] * STEPS
    assert r0["syncs"] == r1["syncs"] == STEPS


def test_control_local_gradients_without_agreement_split_the_ranks(backend, group):
    """The same run on gradients marked "identical on every rank" (no collective): the
    planted inf is seen by rank 1 only, so the ranks split. This is what the agreement
    prevents, and shows the test above could fail."""
    r0, r1 = run_ranks(backend, lambda rank: torch_form_run(
        backend, rank, "local", overflow={(1, 2)}))
    assert skipped(r0["history"]) == [] and skipped(r1["history"]) == [2]
    assert r0["history"][-1][0] != r1["history"][-1][0]
    assert group.log[0] == group.log[1] == []


def test_explicit_group_and_a_rank_without_gradients(backend, group):
    """process_group=...: a rank whose params got no gradient at the overflow steps
    still takes part (no "No inf checks" error, no hang) and backs off with the other."""
    r0, r1 = run_ranks(backend, lambda rank: torch_form_run(
        backend, rank, "local", overflow={(0, 2), (0, 3)}, no_grads={(1, 2), (1, 3)},
        process_group=group))
    assert r0["history"] == r1["history"] == expected({2, 3})
    assert group.log[0] == group.log[1] == ["all_reduce"] * STEPS
    assert r0["syncs"] == r1["syncs"] == STEPS


def megengine_form_run(rank, overflow=(), no_grads=(), **scaler_kwargs):
    params = make_params("local")
    opt = FakeOptimizer(params)
    gm = amp.GradManager(params)
    scaler = amp.GradScaler(INIT, growth_interval=INTERVAL, **scaler_kwargs)
    scales = []
    for step in range(STEPS):
        if (rank, step) in no_grads:
            loss = linear_loss([], [])
        else:
            bad = math.inf if (rank, step) in overflow else 1.0
            loss = linear_loss(params, [[bad, 0.5], [0.25]])
        with gm:
            scaler.backward(gm, loss)
        opt.step()
        gm.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_control_without_agreement_the_gradless_rank_grows_its_scale(backend, group):
    """The issue's measurement, in small: without agreement the rank that had no
    gradients at the overflow steps counts them as clean, and the scales diverge; with
    a group they stay together."""
    overflow, no_grads = {(0, 2), (0, 3)}, {(1, 2), (1, 3)}
    backend.world = False  # as if each rank ran alone
    r0, r1 = run_ranks(backend, lambda rank: megengine_form_run(rank, overflow, no_grads))
    assert r0 != r1 and r0[-1] < r1[-1]
    backend.world = True
    r0, r1 = run_ranks(backend, lambda rank: megengine_form_run(
        rank, overflow, no_grads, process_group=group))
    assert r0 == r1 == [s for s, _, _ in expected({2, 3})]


def test_megengine_form_agrees_and_drops_on_every_rank(backend, group):
    """scaler.backward(gm, loss) + the optimizer's own step: the rank with finite
    gradients drops them too, so neither rank's weights move at the overflow step."""

    def run(rank):
        params = make_params("local")
        opt = FakeOptimizer(params)
        gm = amp.GradManager(params)
        scaler = amp.GradScaler(INIT, growth_interval=INTERVAL, process_group=group)
        out = []
        for step in range(4):
            bad = math.inf if (rank, step) == (1, 2) else 1.0
            before = [list(p.values) for p in params]
            with gm:
                scaler.backward(gm, linear_loss(params, [[bad, 0.5], [0.25]]))
            dropped = all(p.grad is None for p in params)
            opt.step()
            gm.zero_grad()
            out.append((scaler.get_scale(), dropped, before == [p.values for p in params]))
        return out

    r0, r1 = run_ranks(backend, run)
    assert r0 == r1
    assert [unchanged for _, _, unchanged in r0] == [False, False, True, False]
    assert [dropped for _, dropped, _ in r0] == [False, False, True, False]


def test_backward_then_step_on_a_gradless_rank_issues_no_extra_collective(backend, group):
    """backward(gm, loss) unscales and updates; a following scaler.step(opt) must not
    check again on the rank that had no gradients (the other has nothing left to check,
    so an extra all-reduce there would wait forever)."""

    def run(rank):
        params = make_params("local")
        opt = FakeOptimizer(params)
        gm = amp.GradManager(params)
        scaler = amp.GradScaler(INIT, growth_interval=INTERVAL, process_group=group)
        for step in range(3):
            loss = linear_loss([], []) if rank == 1 else linear_loss(params, [[1.0, 1.0], [1.0]])
            with gm:
                scaler.backward(gm, loss)
            scaler.step(opt)
            gm.zero_grad()
        return scaler.get_scale()

    assert run_ranks(backend, run) == [INIT * 2, INIT * 2]  # 3 clean updates, interval 2
    assert group.log[0] == group.log[1] == ["all_reduce"] * 3


def test_unscale_then_step_with_a_gradless_rank(backend, group):
    """unscale_ (one all-reduce, left running while the user clips) then step: the same
    collectives on both ranks, the flag read only after the all-reduce completed."""

    def run(rank):
        params = make_params("local")
        opt = FakeOptimizer(params)
        gm = amp.GradManager(params)
        scaler = amp.GradScaler(INIT, process_group=group)
        loss = linear_loss([], []) if rank == 1 else linear_loss(params, [[math.inf, 1.0], [1.0]])
        with gm:
            gm.backward(scaler.scale(loss))
        scaler.unscale_(opt)
        amp.clip_grad_norm(params, 1.0)
        result = scaler.step(opt)
        scaler.update()
        return result, opt.steps, scaler.stats()["last_step_skipped"]

    assert run_ranks(backend, run) == [(None, 0, True), (None, 0, True)]
    assert group.log[0] == group.log[1] == ["all_reduce"]


def test_dtensor_gradients_every_rank_enters_the_check(backend, group):
    """DTensor-like gradients agree inside the fused kernel (no collective of ours); a
    rank with no gradient enters it with zero stand-ins, so nobody waits forever."""
    r0, r1 = run_ranks(backend, lambda rank: torch_form_run(
        backend, rank, "dtensor", overflow={(0, 2)}, no_grads={(1, 2), (1, 4)}))
    assert r0["history"] == r1["history"] == expected({2})
    assert group.log[0] == group.log[1] == ["dtensor"] * STEPS


def test_single_process_adds_nothing(backend, group):
    """Not distributed (no world group): the check is as before, no collective."""
    backend.world = False
    backend.rank = 0
    result = torch_form_run(backend, 0, "sharded", overflow={(0, 1)})
    assert result["history"] == expected({1})
    assert group.log[0] == []


# -- the no_sync() window ----------------------------------------------------------------
@pytest.mark.parametrize("target", ["module", "gm", "optimizer"])
def test_unscaling_inside_no_sync_is_an_error(backend, target):
    backend.rank = 0
    params = make_params("local")
    model = FakeModule(params)
    model.require_backward_grad_sync = True  # what DDP keeps, False inside no_sync()
    gm = amp.GradManager(model)  # the model is known from here on
    assert gm.attached_tensors() == params
    opt = FakeOptimizer(params)
    scaler = amp.GradScaler(INIT)
    targets = {"module": model, "gm": gm, "optimizer": opt}
    model.require_backward_grad_sync = False  # inside model.no_sync()
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[1.0, 1.0], [1.0]])))
    with pytest.raises(RuntimeError, match=r"inside FakeModule.no_sync\(\).*after the"
                                           r" synchronising micro-batch"):
        scaler.unscale_(targets[target])
    with pytest.raises(RuntimeError, match=r"inside FakeModule.no_sync\(\)"):
        scaler.step(opt)
    model.require_backward_grad_sync = True  # the synchronising micro-batch
    with gm:
        gm.backward(scaler.scale(linear_loss(params, [[1.0, 1.0], [1.0]])))
    scaler.unscale_(targets[target])
    scaler.step(opt)
    scaler.update()
    assert opt.steps == 1


# -- clipping ----------------------------------------------------------------------------
def test_clip_grad_norm_of_sharded_params_asks_for_the_module(backend):
    backend.rank = 0
    params = make_params("sharded")
    for p in params:
        p.grad = FakeTensor([3.0] * len(p.values))
    with pytest.raises(ValueError, match=r"pass the root FSDP module"):
        amp.clip_grad_norm(params, 1.0)
    model = FakeModule(params)
    model.clip_grad_norm_ = lambda max_norm, norm_type: 42.0  # the module's global clip
    assert amp.clip_grad_norm(model, 1.0) == 42.0


# -- arguments ---------------------------------------------------------------------------
def test_process_group_is_validated(backend):
    with pytest.raises(TypeError, match="process_group must be a FakeGroup; got 'WORLD'"):
        amp.GradScaler(process_group="WORLD")
    amp.GradScaler(process_group=None)  # auto
    amp.GradScaler(process_group="anything", enabled=False)  # a pass-through checks nothing


def test_process_group_needs_a_backend_with_collectives(fake):
    with pytest.raises(ValueError, match=r"needs collectives, which the 'fake' backend does"
                                         r" not provide"):
        amp.GradScaler(process_group=object())


def test_shardedgradscaler_call_form(backend, group):
    """ShardedGradScaler users swap the class: device first, process_group by keyword.
    Its positional order puts backoff_factor before growth_factor (torch.amp's is the
    reverse); passed positionally they fail loudly here instead of swapping silently."""
    scaler = amp.GradScaler("cpu", init_scale=2.0**8, backoff_factor=0.25,
                            growth_factor=4.0, growth_interval=100, process_group=group)
    assert scaler.get_scale() == 2.0**8 and scaler._machine.process_group is group
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
    with pytest.raises(ValueError, match="growth_factor must be > 1.0"):
        amp.GradScaler("cpu", 2.0**8, 0.5, 2.0, 100, True, group)  # ShardedGradScaler's order


def test_a_rank_skipping_for_another_ranks_overflow_says_so(backend, group):
    """Forensics after an agreed skip: the overflowing rank names its gradient, the
    other reports that none of its own was non-finite; neither adds a collective."""
    def run(rank):
        params = make_params("sharded")
        gm, opt = amp.GradManager(params), FakeOptimizer(params)
        scaler = amp.GradScaler(INIT)
        with gm:
            gm.backward(scaler.scale(linear_loss(
                params, [[math.inf if rank == 0 else 1.0, 0.5], [0.25]])))
        scaler.step(opt)
        scaler.update()
        report = scaler.last_overflow()
        return report.cause, [g.name for g in report.gradients], report.line()

    (cause0, names0, _), (cause1, names1, line1) = run_ranks(backend, run)
    assert (cause0, names0, cause1, names1) == ("forward", ["param[0]"], "elsewhere", [])
    assert line1.endswith("inf/NaN gradients in 0 of 2 parameters; no gradient here held"
                          " inf/NaN: another process found one, and every rank skips"
                          " together")
    assert group.log[0] == group.log[1] == ["all_reduce"]
