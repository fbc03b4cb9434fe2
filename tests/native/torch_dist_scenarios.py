"""The scenarios of test_torch_distributed.py, run inside each of 2 gloo processes.

``run_all(rank, world, port, out_dir)`` is the spawned entry point: it joins the
process group, runs every scenario in order (all ranks run the same ones, so their
collectives line up), and writes ``rank<r>.pkl`` with a result (or the traceback) per
scenario. The test functions only read those files and assert.

Every scenario plants an overflow on one rank only -- in its loss (DDP, where the
all-reduce carries it to every rank) or in its local shard of the gradient (FSDP,
hand-sharded parameters, where nothing else would) -- and records, per step, the
scale and whether the step was skipped, plus the full weights.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import unified_amp as amp

STEPS = 8
OVERFLOW_STEPS = (2, 5)  # planted on rank 1 only
INIT, INTERVAL = 2.0**10, 2
BATCH = 4
INF = float("inf")


def make_model(seed: int = 0) -> torch.nn.Module:
    """The same weights on every rank. The last layer has one output, so FSDP gives
    rank 1 an empty shard of its bias (and, with use_orig_params, no gradient)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batch(step: int, rank: int, micro: int = 0, overflow: bool = False):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.randn(BATCH, 1, generator=g)
    if overflow:
        x[0, 0] = INF
    return x, y


def loss_of(model, x, y, scale_by: float = 1.0, low: bool = True):
    """MSE under bfloat16 autocast; ``low=False`` computes in float32, where a run must
    match another one that sums over the batch in a different order (bfloat16 rounds
    each partial sum of a gradient to 8 bits, so those would differ by ~0.5%)."""
    with amp.autocast(enabled=low, dtype="bfloat16", device="cpu"):
        out = model(x)
    return F.mse_loss(out.float(), y) * scale_by


def shard(model: torch.nn.Module, world: int) -> None:
    """fully_shard over a CPU mesh. Without a mesh, FSDP2 makes one on the machine's
    accelerator: on a GPU machine it moves the parameters to cuda:0 while these
    scenarios' data and gloo group stay on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))


def planted(rank: int, step: int) -> bool:
    return rank == 1 and step in OVERFLOW_STEPS


def weights(params) -> list[np.ndarray]:
    out = []
    for p in params:
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()  # a DTensor: every rank sees the whole parameter
        out.append(t.float().numpy().copy())
    return out


def fsdp1_weights(model) -> list[np.ndarray]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return [p.detach().clone().numpy() for p in model.parameters()]


def plant_in_local_shard(params) -> None:
    """inf into this rank's first non-empty local piece of gradient."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if hasattr(g, "to_local") else g
            if local.numel():
                local.view(-1)[0] = INF
                return
    raise AssertionError("no local gradient to plant an inf in")


class Recorder:
    def __init__(self, scaler):
        self.scaler = scaler
        self.history = []  # per step: (scale, last_step_skipped)

    def note(self, skipped=None):
        if isinstance(self.scaler, amp.GradScaler):
            stats = self.scaler.stats()
            self.history.append((stats["scale"], stats["last_step_skipped"]))
        else:  # a torch.amp scaler, for the controls and the natives to compare with
            self.history.append((self.scaler.get_scale(), skipped))


def torch_amp_skipped(scaler, before: float) -> bool:
    return scaler.get_scale() < before


# -- scenarios ---------------------------------------------------------------------------
def ddp(rank, world):
    """DDP, torch.amp's loop, an inf in rank 1's loss; on rank 0 also the single-process
    run over the global batch (both ranks' data), for comparison. In float32 compute,
    so that the two runs can be compared closely (see loss_of)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(range(1, 20)), gamma=0.9)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rec = Recorder(scaler)
    lrs = []
    for step in range(STEPS):
        x, y = batch(step, rank, overflow=planted(rank, step))
        lrs.append(opt.param_groups[0]["lr"])
        scaler.scale(loss_of(model, x, y, low=False)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.note()
        if not scaler.stats()["last_step_skipped"]:  # the documented scheduler pattern
            sched.step()
    out = {"history": rec.history, "weights": weights(model.parameters()), "lrs": lrs}
    if rank == 0:
        out["single"] = single_process(world, schedule=True)
    return out


def single_process(world, micro_batches=1, schedule=False):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(range(1, 20)), gamma=0.9)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rec = Recorder(scaler)
    for step in range(STEPS):
        for micro in range(micro_batches):
            parts = [batch(step, r, micro, overflow=planted(r, step) and micro == 0)
                     for r in range(world)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            scaler.scale(loss_of(model, x, y, 1.0 / micro_batches, low=False)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.note()
        if schedule and not scaler.stats()["last_step_skipped"]:
            sched.step()
    return {"history": rec.history, "weights": weights(model.parameters())}


def ddp_no_sync(rank, world):
    """DDP with 2 micro-batches, the first inside no_sync() (with rank 1's inf in it at
    the overflow steps); unscale_ + clipping after the synchronising micro-batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rec = Recorder(scaler)
    norms = []
    for step in range(STEPS):
        for micro in range(2):
            x, y = batch(step, rank, micro, overflow=planted(rank, step) and micro == 0)
            sync = contextlib.nullcontext() if micro == 1 else model.no_sync()
            with sync:
                scaler.scale(loss_of(model, x, y, 0.5, low=False)).backward()
        scaler.unscale_(opt)
        norms.append(amp.clip_grad_norm(model, 1e6))  # the model as target: no_sync-aware
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.note()
    out = {"history": rec.history, "weights": weights(model.parameters()), "norms": norms}
    if rank == 0:
        out["single"] = single_process(world, micro_batches=2)
    return out


def ddp_no_sync_misuse(rank, world):
    """Unscaling inside the no_sync() window: an error on every rank with unified_amp;
    with torch.amp's scaler (the control) the ranks split silently."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu", init_scale=INIT)
    gm = amp.GradManager(model)  # shows the model to unified_amp
    x, y = batch(0, rank, overflow=rank == 1)
    with model.no_sync():
        with gm:
            gm.backward(scaler.scale(loss_of(model, x, y)))
        try:
            scaler.unscale_(opt)
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = str(exc)

    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    native = torch.amp.GradScaler("cpu", init_scale=INIT)
    with model.no_sync():
        native.scale(loss_of(model, x, y)).backward()
        native.unscale_(opt)
        native.step(opt)
        native.update()
    out["control_scale"] = native.get_scale()
    out["control_weights"] = weights(model.parameters())
    return out


def fsdp2(rank, world):
    """fully_shard (DTensor gradients), an inf in rank 1's local shard at the overflow
    steps; also torch.amp's own scaler on the same run, to compare with."""
    out = {}
    for name, make in (("ours", lambda: amp.GradScaler("cpu", init_scale=INIT,
                                                        growth_interval=INTERVAL)),
                       ("native", lambda: torch.amp.GradScaler("cpu", init_scale=INIT,
                                                               growth_interval=INTERVAL))):
        model = make_model()
        shard(model, world)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = make()
        rec = Recorder(scaler)
        norms = []
        for step in range(STEPS):
            x, y = batch(step, rank)
            scaler.scale(loss_of(model, x, y)).backward()
            if planted(rank, step):
                plant_in_local_shard(model.parameters())
            if name == "ours":
                scaler.unscale_(opt)
                norms.append(amp.clip_grad_norm(model.parameters(), 1e6))
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.note(torch_amp_skipped(scaler, before))
        out[name] = {"history": rec.history, "weights": weights(model.parameters()),
                     "norms": norms}
    return out


def fsdp2_gradless_rank(rank, world):
    """fully_shard, but rank 1 holds no gradient at all at the overflow steps (rank 0
    plants the inf): rank 1 must still enter the check, or rank 0 waits forever."""
    model = make_model()
    shard(model, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rec = Recorder(scaler)
    for step in range(STEPS):
        x, y = batch(step, rank)
        scaler.scale(loss_of(model, x, y)).backward()
        if step in OVERFLOW_STEPS:
            if rank == 0:
                plant_in_local_shard(model.parameters())
            else:
                opt.zero_grad(set_to_none=True)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.note()
    return {"history": rec.history, "weights": weights(model.parameters())}


def fsdp1(rank, world):
    """FSDP1 (flat parameters), an inf in rank 1's local shard; unified_amp with no
    process_group given, ShardedGradScaler (the native), and torch.amp's plain scaler
    (the control, a per-rank check)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    makers = {
        "ours": lambda: amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL),
        "sharded": lambda: ShardedGradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL),
        "plain": lambda: torch.amp.GradScaler("cpu", init_scale=INIT,
                                              growth_interval=INTERVAL),
    }
    out = {}
    for name, make in makers.items():
        model = FSDP(make_model(), device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = make()
        rec = Recorder(scaler)
        reads = ReadCounter() if name == "ours" else None
        norms, local_clip_error = [], None
        for step in range(STEPS):
            x, y = batch(step, rank)
            scaler.scale(loss_of(model, x, y)).backward()
            if planted(rank, step):
                plant_in_local_shard(model.parameters())
            if name == "ours":
                scaler.unscale_(opt)
                norms.append(amp.clip_grad_norm(model, 1e6))
                if local_clip_error is None:
                    try:
                        amp.clip_grad_norm(opt, 1e6)
                    except ValueError as exc:
                        local_clip_error = str(exc)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            rec.note(torch_amp_skipped(scaler, before))
        out[name] = {"history": rec.history, "weights": fsdp1_weights(model), "norms": norms,
                     "reads": None if reads is None else reads.stop(),
                     "local_clip_error": local_clip_error}
    return out


def fsdp1_orig_params(rank, world):
    """FSDP1 with use_orig_params=True: rank 1's shard of the last layer is empty, so
    some of its parameters have no gradient at all."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rec = Recorder(scaler)
    gradless = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        scaler.scale(loss_of(model, x, y)).backward()
        gradless.append(sum(p.grad is None for p in model.parameters()))
        if planted(rank, step):
            plant_in_local_shard(model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.note()
    return {"history": rec.history, "weights": fsdp1_weights(model), "gradless": gradless}


def hand_sharded(rank, world):
    """Each rank trains its own parameters (no framework sharding): rank 0 overflows at
    the overflow steps, where rank 1 computes no gradient at all. megengine.amp's call
    form (backward(gm, loss) + the optimizer's own step), with and without a group."""
    out = {}
    for name, group in (("group", dist.group.WORLD), ("none", None)):
        model = make_model(seed=rank)  # different parameters on each rank
        gm = amp.GradManager(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL,
                                process_group=group)
        reads = ReadCounter()
        scales = []
        for step in range(STEPS):
            x, y = batch(step, rank, overflow=(rank == 0 and step in OVERFLOW_STEPS))
            with gm:
                loss = loss_of(model, x, y)
                if rank == 1 and step in OVERFLOW_STEPS:
                    # this rank's loss reaches none of its params: no gradient at all
                    loss = torch.zeros((), requires_grad=True) * 1.0
                scaler.backward(gm, loss)
            opt.step()
            gm.zero_grad()
            scales.append(scaler.get_scale())
        out[name] = {"scales": scales, "reads": reads.stop()}
    return out


def callbacks_all_reduce(rank, world):
    """Data parallelism through GradManager callbacks on torch (what MegEngine users do
    with make_allreduce_cb): an all-reduce-mean callback, an inf in rank 1's loss."""

    def all_reduce_mean(param, grad):
        dist.all_reduce(grad)
        return grad / world

    model = make_model()
    gm = amp.GradManager(model.parameters(), callbacks=[all_reduce_mean])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    rec = Recorder(scaler)
    for step in range(STEPS):
        x, y = batch(step, rank, overflow=planted(rank, step))
        with gm:
            scaler.backward(gm, loss_of(model, x, y))
        opt.step()
        gm.zero_grad()
        rec.note()
    return {"history": rec.history, "weights": weights(model.parameters())}


# A rank with no loss in some steps (an empty micro-batch, an expert that got no tokens)
IDLE_STEPS = 12
IDLE_ON_RANK0 = {1: "unscale_", 4: "step", 9: "zeroed"}  # step -> how rank 0 idles
INF_ON_RANK1 = (2, 4, 7)


def idle_rank(rank, world):
    """Hand-sharded parameters with process_group=WORLD. Rank 0 has no loss at three
    steps and still calls unscale_ (or not) / step / update: with its gradients None
    (steps 1, 4) or zeroed in place (step 9). Rank 1 plants an inf in its own gradient
    at three steps, one of them (4) an idle step of rank 0. Both ranks must skip the
    same steps and keep the same scales; a rank that skipped the agreement would make
    the other wait until the process group's timeout."""
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL,
                            process_group=dist.group.WORLD)
    history, weights_before = [], []
    for step in range(IDLE_STEPS):
        idle = IDLE_ON_RANK0.get(step) if rank == 0 else None
        if idle is None:
            x, y = batch(step, rank)
            scaler.scale(loss_of(model, x, y)).backward()
            if rank == 1 and step in INF_ON_RANK1:
                plant_in_local_shard(model.parameters())
        weights_before.append(weights(model.parameters()))
        if idle != "step":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=IDLE_ON_RANK0.get(step + 1) != "zeroed")
        history.append((scaler.get_scale(), scaler.stats()["last_step_skipped"]))
    changed = [any(not np.array_equal(a, b) for a, b in zip(before, after))
               for before, after in zip(weights_before,
                                        weights_before[1:] + [weights(model.parameters())])]
    return {"history": history, "changed": changed}


class ReadCounter:
    """Counts the scaler's host reads of the overflow flag (the one sync per step)."""

    def __init__(self):
        self.backend = amp.get_backend()
        self.original = self.backend.flag_is_set
        self.n = 0

        def counted(flag):
            self.n += 1
            return self.original(flag)

        self.backend.flag_is_set = counted

    def stop(self) -> int:
        del self.backend.flag_is_set  # back to the class's method
        return self.n


SCENARIOS = [ddp, ddp_no_sync, ddp_no_sync_misuse, fsdp2, fsdp2_gradless_rank, fsdp1,
             fsdp1_orig_params, hand_sharded, callbacks_all_reduce, idle_rank]


def run_all(rank: int, world: int, port: int, out_dir: str) -> None:
    """The spawned entry point (see the module docstring)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The timeout turns a hang (a rank that skipped a collective) into an error that the
    # test reports; no result depends on it.
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=45))
    torch.set_num_threads(1)  # two processes share two cores
    results = {}
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        for scenario in SCENARIOS:
            try:
                results[scenario.__name__] = scenario(rank, world)
            except Exception:  # noqa: BLE001 - reported by the test of that scenario
                results[scenario.__name__] = {"traceback": traceback.format_exc()}
                break  # the ranks' collectives may no longer line up
            finally:
                # Written as we go: a rank that dies later still leaves its results.
                with open(path, "wb") as f:
                    pickle.dump(results, f)
    finally:
        gc.collect()  # DDP/FSDP sit in reference cycles; gloo may abort if they outlive it
        dist.destroy_process_group()
