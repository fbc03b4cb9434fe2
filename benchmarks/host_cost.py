"""Host time of the scaler's bookkeeping vs the number of parameter tensors:
``python -m benchmarks.host_cost`` (backend from UNIFIED_AMP_BACKEND).

For 10, 100, 1000 and 3000 small parameter tensors, the same loop runs with the
framework's own GradScaler ("native") and with unified_amp's ("unified"), interleaved
round by round, and the per-round ratio unified / native of the timed part is reported
(median and IQR over rounds), in CPU time of the Python thread:

- torch: ``scaler.scale(loss).backward()``, then, timed, ``scaler.step(opt);
  scaler.update()``; ``opt.zero_grad()``. Optimizers: SGD with ``foreach=True`` and
  Adam with ``fused=True``.
- MegEngine: timed, a block of iterations of: inside a GradManager, the forward and
  ``scaler.backward(gm, loss)`` (megengine.amp's automatic mode: scaled backward,
  unscale, update), then ``opt.step().clear_grad()``; a full sync before and after the
  block, as a training loop runs (its one sync per step is the flag read). The timed
  part includes the framework's forward and backward, the same in both variants.
  Optimizers: SGD and Adam.

A third variant, "control", is a second native scaler with its own model, run in the
same rounds: control / native is what the machine's noise alone makes of a ratio that
is really 1.0, so a unified / native figure means something only beside it. The
variants are made in a different order at each point (a model made later can run
slower or faster for reasons of memory alone).

On torch it also times a whole training step of a small MLP (6 Linear(256, 256) layers,
bfloat16 ``torch.autocast``, SGD with momentum) with each scaler: the overhead a drop-in
user sees where host time is the budget.

Writes ``<out>/host-cost-<backend>.json`` (every per-round figure) and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import unified_amp as amp

from .report import loadavg, write_json
from .timing import spread

TENSORS = (10, 100, 1000, 3000)
# CPU time of the calling thread, not wall time: on a shared machine a descheduled
# thread would otherwise charge other processes' work to whichever variant was running.
# It is the host's own work (MegEngine's kernels run on its worker thread, outside it;
# torch's CPU kernels, at one thread, inside it, in both variants alike).
_clock = time.thread_time
ELEMENTS = 64  # per parameter tensor: small, so that host work dominates
TARGET = 1.05  # unified / native at every point
MLP_TARGET = 1.02


def _ratios(a: list[float], b: list[float]) -> dict[str, float]:
    return spread([x / y for x, y in zip(a, b)])


VARIANTS = ("native", "unified", "control")


def _interleave(variants: dict[str, Callable[[int], float]], rounds: int, steps: int,
                warmup: int) -> dict[str, list[float]]:
    """Each variant runs a block of ``steps`` iterations per round, in an order rotated
    every round; ``variants[name](k)`` runs ``k`` iterations and returns the seconds of
    their timed parts, per iteration."""
    names = list(variants)
    for name in names:
        variants[name](warmup)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(variants[name](steps))
    return out


def _made_in_turn(point: int, make: Callable[[str], Callable[[int], float]]
                  ) -> dict[str, Callable[[int], float]]:
    """The three variants, made in an order that turns with ``point``, listed in
    VARIANTS' order."""
    turn = point % len(VARIANTS)
    made = {name: make(name) for name in VARIANTS[turn:] + VARIANTS[:turn]}
    return {name: made[name] for name in VARIANTS}


def _each(iteration: Callable[[], float]) -> Callable[[int], float]:
    """A block runner from an iteration that times its own part."""
    return lambda k: sum(iteration() for _ in range(k)) / k if k else 0.0


# -- torch --------------------------------------------------------------------------------
def _torch_loop(n: int, optimizer: str, scaler: Any) -> Callable[[int], float]:
    import torch

    g = torch.Generator().manual_seed(n)
    params = [torch.nn.Parameter(torch.randn(ELEMENTS, generator=g)) for _ in range(n)]
    weights = torch.rand(n * ELEMENTS, generator=g)
    opt = (torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
           if optimizer == "sgd-foreach" else torch.optim.Adam(params, lr=1e-3, fused=True))

    def iteration() -> float:
        loss = (torch.cat([p.view(-1) for p in params]) * weights).sum()
        scaler.scale(loss).backward()
        t0 = _clock()
        scaler.step(opt)
        scaler.update()
        t1 = _clock()
        opt.zero_grad()
        return t1 - t0

    return _each(iteration)


def _torch_mlp(scaler: Any) -> Callable[[int], float]:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(32, 256), torch.randn(32, 256)

    def iteration() -> float:
        t0 = _clock()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        loss.item()
        return _clock() - t0

    return _each(iteration)


def _torch_scalers() -> tuple[Callable[[], Any], Callable[[], Any]]:
    import torch

    return (lambda: torch.amp.GradScaler("cpu"), lambda: amp.GradScaler("cpu"))


# -- MegEngine ----------------------------------------------------------------------------
def _megengine_loop(n: int, optimizer: str, scaler: Any,
                    manual: bool = False) -> Callable[[int], float]:
    """``manual``: megengine.amp's manual form instead of ``scaler.backward(gm, loss)``:
    ``gm.backward(loss, dy=scale_factor)``, ``scaler.unscale(params)``, ``update()``."""
    import megengine as mge
    import megengine.functional as F
    import megengine.optimizer as O
    from megengine.autodiff import GradManager

    rng = np.random.RandomState(n)
    params = [mge.Parameter(rng.randn(ELEMENTS).astype("float32")) for _ in range(n)]
    weights = mge.tensor(rng.rand(n * ELEMENTS).astype("float32"))
    gm = GradManager().attach(params)
    opt = O.SGD(params, lr=1e-3, momentum=0.9) if optimizer == "sgd" else \
        O.Adam(params, lr=1e-3)

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


def _megengine_scalers() -> tuple[Callable[[], Any], Callable[[], Any]]:
    import megengine.amp

    return (lambda: megengine.amp.GradScaler(init_scale=2.0**4),
            lambda: amp.GradScaler(init_scale=2.0**4))


CONFIG = {
    "torch": {"optimizers": ("sgd-foreach", "adam-fused"), "loop": _torch_loop,
              "scalers": _torch_scalers},
    "megengine": {"optimizers": ("sgd", "adam"), "loop": _megengine_loop,
                  "scalers": _megengine_scalers},
}


def run(backend: str, tensors: tuple[int, ...], rounds: int, steps: int, warmup: int,
        mlp_rounds: int) -> dict[str, Any]:
    cfg = CONFIG[backend]
    make_native, make_unified = cfg["scalers"]()
    makers = {"native": make_native, "unified": make_unified, "control": make_native}
    out: dict[str, Any] = {}
    point = 0
    for optimizer in cfg["optimizers"]:
        out[optimizer] = {}
        for n in tensors:
            # Fewer rounds where one iteration is long; never fewer than 5.
            r = max(5, rounds if n <= 1000 else rounds // 2)
            # More iterations per round where one is short, so that each round's block
            # lasts long enough to average over the machine's noise.
            k = max(steps, min(100, (1000 * steps) // (4 * n)))
            variants = _made_in_turn(point, lambda name: cfg["loop"](
                n, optimizer, makers[name]()))
            point += 1
            times = _interleave(variants, r, k, warmup)
            v = out[optimizer][str(n)] = _summary(times, r, k)
            print(f"  {optimizer:12} {n:5d} tensors: native"
                  f" {v['native_s']['median'] * 1e6:9.1f} us, unified"
                  f" {v['unified_s']['median'] * 1e6:9.1f} us, {_ratio_text(v)}", flush=True)
    result: dict[str, Any] = {"loops": out}
    if backend == "torch" and mlp_rounds:
        variants = _made_in_turn(point, lambda name: _torch_mlp(makers[name]()))
        times = _interleave(variants, mlp_rounds, 25, warmup)
        result["mlp_6x256"] = _summary(times, mlp_rounds, 25)
    return result


def _summary(times: dict[str, list[float]], rounds: int, k: int) -> dict[str, Any]:
    return {"rounds": rounds, "iterations_per_round": k,
            "native_s": spread(times["native"]), "unified_s": spread(times["unified"]),
            "control_s": spread(times["control"]),
            "ratio": _ratios(times["unified"], times["native"]),
            "control_ratio": _ratios(times["control"], times["native"]),
            "per_round": times}


def _ratio_text(v: dict[str, Any]) -> str:
    r, c = v["ratio"], v["control_ratio"]
    return (f"ratio {r['median']:.4f} [{r['q1']:.4f}-{r['q3']:.4f}]  (control"
            f" {c['median']:.4f} [{c['q1']:.4f}-{c['q3']:.4f}])")


def table(result: dict[str, Any]) -> str:
    lines = [f"host time vs parameter tensors ({result['backend']}"
             f" {result['framework_version']}): median per iteration, unified / native"
             f" median [IQR] over rounds; target <= {TARGET}"]
    for optimizer, by_n in result["loops"].items():
        for n, v in by_n.items():
            lines.append(f"  {optimizer:12} {int(n):5d} tensors  native"
                         f" {v['native_s']['median'] * 1e6:9.1f} us  unified"
                         f" {v['unified_s']['median'] * 1e6:9.1f} us  {_ratio_text(v)}")
    mlp = result.get("mlp_6x256")
    if mlp:
        lines.append(f"  MLP 6x256 whole step: native {mlp['native_s']['median'] * 1e3:.3f}"
                     f" ms  unified {mlp['unified_s']['median'] * 1e3:.3f} ms"
                     f"  {_ratio_text(mlp)}; target <= {MLP_TARGET}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for optimizer, by_n in result["loops"].items():
        ns = [int(n) for n in by_n]
        med = np.array([v["ratio"]["median"] for v in by_n.values()])
        lo = med - np.array([v["ratio"]["q1"] for v in by_n.values()])
        hi = np.array([v["ratio"]["q3"] for v in by_n.values()]) - med
        ax_r.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, label=optimizer)
        ctl = [v["control_ratio"]["median"] for v in by_n.values()]
        ax_r.plot(ns, ctl, ":", marker="x", color=ax_r.lines[-1].get_color(),
                  label=f"{optimizer}, control (native / native)")
        for variant, style in (("native", "--"), ("unified", "-")):
            ax_t.plot(ns, [v[f"{variant}_s"]["median"] * 1e3 for v in by_n.values()],
                      style, marker="o", label=f"{optimizer}, {variant}")
    ax_r.axhline(TARGET, color="red", lw=0.8, ls=":", label=f"target {TARGET}")
    ax_r.axhline(1.0, color="gray", lw=0.6)
    ax_r.set_xscale("log")
    ax_r.set_xlabel("parameter tensors")
    ax_r.set_ylabel("unified / native (median, IQR)")
    ax_r.legend(fontsize=7)
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("parameter tensors")
    ax_t.set_ylabel("timed part per iteration, ms")
    ax_t.legend(fontsize=7)
    title = (f"{result['backend']} {result['framework_version']}: scaler host time vs"
             f" parameter tensors")
    mlp = result.get("mlp_6x256")
    if mlp:
        title += f"; MLP 6x256 step ratio {mlp['ratio']['median']:.4f}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_cost",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tensors", default=",".join(map(str, TENSORS)))
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per point (torch 31, MegEngine 9)")
    p.add_argument("--steps", type=int, default=None, help="iterations per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mlp-rounds", type=int, default=41, help="torch's MLP; 0 skips it")
    p.add_argument("--quick", action="store_true", help="smoke run: 10 and 100 tensors")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    backend = amp.get_backend().name
    if backend == "torch":
        import torch

        torch.set_num_threads(1)  # as benchmarks.bench: a shared 2-core machine
        version = torch.__version__
    else:
        import megengine

        version = megengine.__version__
    tensors = tuple(int(t) for t in args.tensors.split(","))
    rounds = args.rounds or (31 if backend == "torch" else 9)
    steps = args.steps or (4 if backend == "torch" else 2)
    if args.quick:
        tensors, rounds, steps, args.mlp_rounds = (10, 100), 3, 2, 3
    start, load_before = time.time(), loadavg()
    print(f"{backend} {version}: {rounds} rounds x {steps} iterations per point")
    result = {"backend": backend, "framework_version": version,
              "command": f"UNIFIED_AMP_BACKEND={backend} python -m benchmarks.host_cost"
                         f" {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
              "config": {"tensors": tensors, "elements_per_tensor": ELEMENTS,
                         "rounds": rounds, "steps": steps, "warmup": args.warmup,
                         "quick": args.quick, "target": TARGET, "mlp_target": MLP_TARGET}}
    result.update(run(backend, tensors, rounds, steps, args.warmup, args.mlp_rounds))
    result.update(runtime_s=time.time() - start, loadavg_before=load_before,
                  loadavg_after=loadavg(),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print(table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"host-cost-{backend}" + ("-quick" if args.quick else "")
    write_json(result, out / f"{stem}.json")
    plot(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
