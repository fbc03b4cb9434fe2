"""Eager against ``torch.compile`` (inductor), unified_amp against torch.amp, in one run:
``python -m benchmarks compile``.

- ``compile``: the conv net and the transformer block, each variant on its own copy of
  the model, seeded alike, with torch.amp's loop (``scaler.scale(loss).backward();
  scaler.step(opt); scaler.update()``), eager and with the forward and loss, autocast
  block included, in one ``torch.compile(..., fullgraph=True)`` (backward and the scaler
  stay eager, as in a compiled model). Variants: native (``torch.autocast`` +
  ``torch.amp.GradScaler``); unified (``amp.autocast`` + ``amp.GradScaler``); unified
  with ``contract=False``; and native with the contract's float32 casts written into the
  model by hand (the models' ``fp32_sensitive``), the native twin of "unified".
- ``whole-step``: one ``torch.compile`` (graph breaks allowed) around the forward in its
  block, ``scaler.scale(loss).backward()``, ``scaler.step(opt)`` with a foreach SGD,
  ``scaler.update()`` and ``zero_grad``: whatever dynamo compiles of the optimizer's step
  through the scaler counts. Variants: native, a second native copy (the control),
  unified with the contract off and with its defaults.

All variants run in every round, in turned order; ratios are taken within a round. The
first call of each compiled variant (the compile) is timed apart.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

import unified_amp as amp

from .timing import interleave, ratios, spread
from .workloads import SIZES, lookup

DTYPE = "bfloat16"  # CPU: torch computes bfloat16 fast there; float16 it emulates
SIDES = {  # name -> (autocast factory, scaler factory, fp32_sensitive)
    "native": (lambda dev, dt: torch.autocast(dev, dtype=getattr(torch, dt)),
               lambda dev: torch.amp.GradScaler(dev), False),
    "unified": (lambda dev, dt: amp.autocast(dtype=dt, device=dev),
                lambda dev: amp.GradScaler(dev), False),
    "unified, contract off": (lambda dev, dt: amp.autocast(dtype=dt, device=dev,
                                                           contract=False),
                              lambda dev: amp.GradScaler(dev), False),
    "native + contract's casts": (lambda dev, dt: torch.autocast(dev, dtype=getattr(torch, dt)),
                                  lambda dev: torch.amp.GradScaler(dev), True),
}
WHOLE_STEP = {"native": "native", "control (native again)": "native",
              "unified, contract off": "unified, contract off", "unified": "unified"}
FULL, QUICK = dict(warmup=3, rounds=15, steps=2), dict(warmup=1, rounds=2, steps=2)


def _dtype(kit: Any) -> str:
    return DTYPE if kit.device == "cpu" else "float16"


def _step(kit: Any, name: str, size: dict[str, int], seed: int, side: str,
          compiled: bool) -> Callable[[], torch.Tensor]:
    """One training step of a fresh copy of workload ``name`` on ``side``, the forward
    and its block compiled with ``compiled``."""
    autocast, scaler_of, fp32_sensitive = SIDES[side]
    w = kit.build(name, size, seed)
    scaler, opt, dtype = scaler_of(kit.device), w.optimizer, _dtype(kit)

    def forward() -> torch.Tensor:
        with autocast(kit.device, dtype):
            return w.loss(fp32_sensitive)

    if compiled:
        forward = torch.compile(forward, fullgraph=True)

    def step() -> torch.Tensor:
        loss = forward()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _whole_step(kit: Any, name: str, size: dict[str, int], seed: int, side: str
                ) -> Callable[[], torch.Tensor]:
    """The whole training step of a fresh copy of ``name``, compiled, on ``side``."""
    autocast, scaler_of, _ = SIDES[WHOLE_STEP[side]]
    w = kit.build(name, size, seed)
    scaler, dtype = scaler_of(kit.device), _dtype(kit)
    opt = torch.optim.SGD(w.params, lr=0.01, momentum=0.9, foreach=True)

    @torch.compile
    def step() -> torch.Tensor:
        with autocast(kit.device, dtype):
            loss = w.loss(False)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _timed(run: Any, makers: dict[str, Callable[[], Callable[[], Any]]]
           ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each variant made and called once (a compiled one compiles then: timed apart),
    then interleaved."""
    blocks, first_call_s = {}, {}
    for key, make in makers.items():
        blocks[key] = run.kit.block(make())
        first_call_s[key] = round(blocks[key](1), 2)
    return interleave(blocks, **run.schedule(FULL, QUICK)), first_call_s


def forward(run: Any) -> dict[str, Any]:
    kit, seed = run.kit, run.opts.seed or 0
    out = {}
    for name in run.workloads():
        size = lookup(SIZES, "torch", kit.device, run.mode)[name]
        times, first = _timed(run, {
            f"{side}, {mode}": (lambda side=side, mode=mode: _step(
                kit, name, size, seed, side, mode == "compiled"))
            for side in SIDES for mode in ("eager", "compiled")})
        r = {}
        for mode in ("eager", "compiled"):
            for side in ("unified", "unified, contract off"):
                r[f"{side} / native, {mode}"] = ratios(times[f"{side}, {mode}"],
                                                       times[f"native, {mode}"])
            r[f"unified / native + contract's casts, {mode}"] = ratios(
                times[f"unified, {mode}"], times[f"native + contract's casts, {mode}"])
        out[name] = {"size": size, "step_s": {k: spread(v) for k, v in times.items()},
                     "first_call_s (compiles)": {k: v for k, v in first.items()
                                                 if k.endswith("compiled")},
                     "ratios": r,
                     "compiled_speedup (eager / compiled)": {
                         side: ratios(times[f"{side}, eager"], times[f"{side}, compiled"])
                         for side in SIDES},
                     "per_round_s": times}
    return {"torch": torch.__version__, "dtype": _dtype(kit), "fullgraph": True,
            "workloads": out}


def whole_step(run: Any) -> dict[str, Any]:
    kit, seed = run.kit, run.opts.seed or 0
    out = {}
    for name in run.workloads():
        size = lookup(SIZES, "torch", kit.device, run.mode)[name]
        # dynamo compiles opt.step once per optimizer object (it guards on self), and
        # earlier optimizers count against its recompile limit of 8: past it the later
        # variants' optimizer steps would run eagerly. A clean slate per workload.
        torch._dynamo.reset()
        started = time.perf_counter()
        times, first = _timed(run, {side: (lambda side=side: _whole_step(
            kit, name, size, seed, side)) for side in WHOLE_STEP})
        out[name] = {"size": size, "optimizer": "SGD(momentum=0.9, foreach=True)",
                     "step_s": {k: spread(v) for k, v in times.items()},
                     "first_call_s (compiles)": first,
                     "ratios": {f"{side} / native": ratios(times[side], times["native"])
                                for side in WHOLE_STEP if side != "native"},
                     "per_round_s": times, "seconds": time.perf_counter() - started}
    return {"torch": torch.__version__, "dtype": _dtype(kit), "whole_step_compiled": out}
