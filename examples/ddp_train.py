"""Data-parallel AMP training with torch DDP: one process per CPU or GPU, launched by
torchrun, gradient accumulation with ``no_sync()``, clipping, an LR schedule that
follows the optimizer, and a GradScaler whose decisions every rank shares.

    torchrun --standalone --nproc_per_node 2 -m examples.ddp_train            # CPU: gloo
    torchrun --standalone --nproc_per_node 2 -m examples.ddp_train --steps 200
    torchrun --standalone --nproc_per_node 2 -m examples.ddp_train --overflow-at 5

Run it from the repository root (``-m`` keeps this checkout's unified_amp first on the
path). With CUDA each process takes the GPU of its LOCAL_RANK and NCCL; without, gloo
on the CPU. ``--overflow-at N`` plants an inf in rank 1's first micro-batch at step N:
DDP averages it into every rank's gradients, so every rank skips that step, and the
final check finds the weights identical on all ranks. docs/DISTRIBUTED.md explains what
the scaler promises across ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import unified_amp as amp


def make_data(n: int, features: int, classes: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points labelled by a random linear teacher (the same on every rank)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(features, classes))
    x = rng.normal(size=(n, features)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy((x @ w).argmax(1))


def train_step(model: DDP, optimizer: Any, scaler: amp.GradScaler,
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float
               ) -> tuple[float, bool]:
    """One optimizer step over this rank's micro-batches.

    Gradients are synchronised only on the last micro-batch (the others run inside
    ``no_sync()``), so they are unscaled, clipped and checked after it: every rank then
    checks the same averaged gradients and takes the same decision.

    Returns:
        (this rank's loss, whether the optimizer stepped).
    """
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            # the batch's device: ranks without a GPU each train on the CPU, where a
            # block with no device would cover the machine's GPU instead
            with amp.autocast(device=x.device.type):
                loss = F.cross_entropy(model(x), y) / len(micro_batches)
            scaler.scale(loss).backward()
        total += loss.item()
    scaler.unscale_(optimizer)
    amp.clip_grad_norm(model, max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total, not scaler.stats()["last_step_skipped"]


def gpu_per_process() -> bool:
    """Whether each local process gets a GPU of its own (nccl); with fewer GPUs than
    processes (2 ranks on a 1-GPU machine) the ranks train on CPU over gloo instead of
    failing with an invalid device ordinal."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return torch.cuda.is_available() and torch.cuda.device_count() >= local


def train(steps: int = 60, micro_batches: int = 2, micro_batch_size: int = 16,
          hidden: int = 64, lr: float = 0.1, max_norm: float = 1.0,
          overflow_at: int | None = None) -> dict[str, Any]:
    """Trains on this process's share of the data; the process group must be up."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = gpu_per_process()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda \
        else torch.device("cpu")
    features, classes = 16, 4
    per_step = world * micro_batches * micro_batch_size
    x_all, y_all = make_data(steps * per_step + 512, features, classes)
    x_test, y_test = x_all[-512:].to(device), y_all[-512:].to(device)

    torch.manual_seed(0)  # DDP also broadcasts rank 0's weights at construction
    net = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, classes)).to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = amp.GradScaler(init_scale=2.0**12, growth_interval=20)

    losses, scales, stepped = [], [], []
    for step in range(steps):
        # This rank's micro-batches: a disjoint slice of the step's global batch.
        start = step * per_step + rank * micro_batches * micro_batch_size
        mbs = []
        for m in range(micro_batches):
            lo = start + m * micro_batch_size
            x = x_all[lo:lo + micro_batch_size].clone()
            if step == overflow_at and rank == 1 and m == 0:
                x[0, 0] = float("inf")
            mbs.append((x.to(device), y_all[lo:lo + micro_batch_size].to(device)))
        loss, did_step = train_step(model, optimizer, scaler, mbs, max_norm)
        if did_step:  # the schedule counts optimizer steps, not iterations
            schedule.step()
        losses.append(loss)
        scales.append(scaler.get_scale())
        stepped.append(did_step)

    with torch.no_grad(), amp.autocast(device=device.type):
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return {"rank": rank, "world": world, "device": str(device),
            "backend": dist.get_backend(), "losses": losses, "scales": scales,
            "stepped": stepped, "accuracy": accuracy,
            "weights_identical": weights_identical(model), "stats": scaler.stats()}


def weights_identical(model: torch.nn.Module) -> bool:
    """Whether every rank holds exactly the same weights (one all-reduce)."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    both = torch.cat([flat, -flat])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the max of each weight, and its min
    return bool(torch.equal(both[:flat.numel()], -both[flat.numel():]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--overflow-at", type=int, default=None,
                        help="plant an inf in rank 1's data at this step")
    parser.add_argument("--out", default=None,
                        help="write each rank's results to OUT/rank<r>.json")
    args = parser.parse_args(argv)

    amp.set_backend("torch")
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --standalone --nproc_per_node 2"
                     " -m examples.ddp_train")
    cuda = gpu_per_process()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        results = train(steps=args.steps, micro_batches=args.micro_batches,
                        micro_batch_size=args.micro_batch_size, hidden=args.hidden,
                        lr=args.lr, overflow_at=args.overflow_at)
    finally:
        # DDP sits in reference cycles: free it while the process group is still up.
        # Left to the interpreter's exit, gloo can abort the process (seen with torch
        # 2.13 on CPU in about one run in five).
        gc.collect()
        dist.destroy_process_group()
    if args.out:
        with open(os.path.join(args.out, f"rank{results['rank']}.json"), "w") as f:
            json.dump(results, f)
    if results["rank"] == 0 and results["losses"]:
        stats = results["stats"]
        print(f"{results['world']} ranks on {results['backend']} ({results['device']}):"
              f" loss {results['losses'][0]:.3f} -> {results['losses'][-1]:.3f},"
              f" held-out accuracy {results['accuracy']:.3f}, loss scale {stats['scale']:g},"
              f" skipped steps {stats['skipped_steps']}/{stats['steps']},"
              f" weights identical on all ranks: {results['weights_identical']}")
    return results


if __name__ == "__main__":
    main()
