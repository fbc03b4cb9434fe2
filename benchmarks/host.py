"""The scaler's host time by parameter-tensor count: ``python -m benchmarks overhead
--sections host``.

For 10, 100, 1000 and 3000 small parameter tensors (64 float32 elements each, so that
host work dominates), the same loop runs with the framework's own GradScaler
("native"), unified_amp's ("unified") and a second native one on a model of its own
("control"), interleaved round by round, in CPU time of the Python thread (a thread
descheduled by other work on a shared machine charges nothing to either; MegEngine's
kernels run on its worker thread, outside it):

- torch: ``scaler.scale(loss).backward()``, then, timed, ``scaler.step(opt);
  scaler.update()``; ``opt.zero_grad()``. SGD with ``foreach=True``, Adam with
  ``fused=True``.
- MegEngine: timed, blocks of iterations of ``with gm:`` the forward and
  ``scaler.backward(gm, loss)`` (the automatic mode), ``opt.step().clear_grad()``, with a
  full sync before and after the block (SGD, Adam); and megengine.amp's manual form
  (``gm.backward(loss, dy=scale_factor)``, ``scaler.unscale(params)``, ``update()``).

Also the Python bytecodes each loop's iteration executes (``sys.settrace`` opcode
events, framework code included), native and unified, at up to 1000 tensors: the one
figure here that no load on the machine moves (CPython 3.10 and 3.11; from 3.12 on the
opcode events come through sys.monitoring and miss a native step's, so it is skipped).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np

import unified_amp as amp

from .timing import interleave, made_in_turn, ratios, spread

TENSORS = (10, 100, 1000, 3000)
ELEMENTS = 64
_clock = time.thread_time


def _torch_loop(n: int, optimizer: str, scaler: Any) -> Callable[[int], float]:
    import torch

    g = torch.Generator().manual_seed(n)
    params = [torch.nn.Parameter(torch.randn(ELEMENTS, generator=g)) for _ in range(n)]
    weights = torch.rand(n * ELEMENTS, generator=g)
    opt = (torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
           if optimizer == "sgd-foreach" else torch.optim.Adam(params, lr=1e-3, fused=True))

    def block(k: int) -> float:
        spent = 0.0
        for _ in range(k):
            loss = (torch.cat([p.view(-1) for p in params]) * weights).sum()
            scaler.scale(loss).backward()
            t0 = _clock()
            scaler.step(opt)
            scaler.update()
            spent += _clock() - t0
            opt.zero_grad()
        return spent / k if k else 0.0

    return block


def _megengine_loop(n: int, optimizer: str, scaler: Any) -> Callable[[int], float]:
    import megengine as mge
    import megengine.functional as F
    import megengine.optimizer as O
    from megengine.autodiff import GradManager

    rng = np.random.RandomState(n)
    params = [mge.Parameter(rng.randn(ELEMENTS).astype("float32")) for _ in range(n)]
    weights = mge.tensor(rng.rand(n * ELEMENTS).astype("float32"))
    gm = GradManager().attach(params)
    manual = optimizer == "sgd-manual"
    opt = O.Adam(params, lr=1e-3) if optimizer == "adam" else \
        O.SGD(params, lr=1e-3, momentum=0.9)

    def block(k: int) -> float:
        mge._full_sync()
        t0 = _clock()
        for _ in range(k):
            with gm:
                loss = (F.concat([p.flatten() for p in params]) * weights).sum()
                if manual:
                    gm.backward(loss, dy=mge.tensor(scaler.scale_factor))
                else:
                    scaler.backward(gm, loss)
            if manual:
                scaler.unscale(gm.attached_tensors())
                scaler.update()
            opt.step().clear_grad()
        mge._full_sync()
        return (_clock() - t0) / k if k else 0.0

    return block


def _scalers(backend: str) -> dict[str, Callable[[], Any]]:
    if backend == "torch":
        import torch

        return {"native": lambda: torch.amp.GradScaler("cpu"),
                "unified": lambda: amp.GradScaler("cpu")}
    import megengine.amp

    return {"native": lambda: megengine.amp.GradScaler(init_scale=2.0**4),
            "unified": lambda: amp.GradScaler(init_scale=2.0**4)}


def _opcodes(block: Callable[[int], float], steps: int) -> float:
    """Python bytecodes executed per iteration by ``block(steps)``."""
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    block(1)  # first-call work (caches, lazy imports) is not an iteration's
    sys.settrace(tracer)
    try:
        block(steps)
    finally:
        sys.settrace(None)
    return count[0] / steps


def host(run: Any) -> dict[str, Any]:
    backend = run.backend
    loop = _torch_loop if backend == "torch" else _megengine_loop
    optimizers = (("sgd-foreach", "adam-fused") if backend == "torch"
                  else ("sgd", "adam", "sgd-manual"))
    tensors = (10, 100) if run.quick else tuple(
        int(t) for t in (run.opts.tensors or ",".join(map(str, TENSORS))).split(","))
    sched = run.schedule(dict(warmup=3, rounds=31 if backend == "torch" else 15,
                              steps=4 if backend == "torch" else 2),
                         dict(warmup=1, rounds=3, steps=2))
    scalers = _scalers(backend)
    out: dict[str, Any] = {}
    point = 0
    for optimizer in optimizers:
        out[optimizer] = {}
        for n in tensors:
            # fewer rounds where an iteration is long; more iterations per round where it
            # is short, so that a block lasts long enough to average the machine's noise
            rounds = max(min(5, sched["rounds"]), sched["rounds"] if n <= 1000
                         else sched["rounds"] // 2)
            steps = max(sched["steps"], min(100, (1000 * sched["steps"]) // (4 * n)))
            blocks = made_in_turn(["native", "unified", "control"], lambda name: loop(
                n, optimizer, scalers["unified" if name == "unified" else "native"]()), point)
            point += 1
            times = interleave(blocks, rounds=rounds, steps=steps, warmup=sched["warmup"])
            out[optimizer][str(n)] = {
                "rounds": rounds, "iterations_per_round": steps,
                **{f"{v}_s": spread(t) for v, t in times.items()},
                "ratio": ratios(times["unified"], times["native"]),
                "control_ratio": ratios(times["control"], times["native"]),
                "per_round": times}
    work: dict[str, Any] = {}
    if sys.version_info < (3, 12):
        for n in (t for t in tensors if t <= 1000):
            work[str(n)] = {f"{v}_bytecodes": _opcodes(loop(n, optimizers[0], scalers[v]()),
                                                       2 if run.quick else 5)
                            for v in scalers}
    return {"elements_per_tensor": ELEMENTS, "tensors": tensors, "loops": out,
            "bytecodes_per_iteration": {"optimizer": optimizers[0], "by_tensors": work}}
