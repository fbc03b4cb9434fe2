"""unified_amp's step against torch.amp's on real models: ``python -m benchmarks.real_models``.

torchvision's ``resnet50(num_classes=10)`` on 32x32 images and Hugging Face transformers'
``GPT2LMHeadModel`` from a small ``GPT2Config`` (random weights: nothing is downloaded),
each trained with torch.amp's loop (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``, the loss read every step) in these variants, each on its own copy of
the model, seeded alike:

- native: ``torch.autocast`` + ``torch.amp.GradScaler``;
- control: a second native copy; control / native is what the machine's noise alone
  makes of a ratio that is really 1.0, so the other ratios mean something only beside it;
- unified: ``amp.autocast`` (the dtype contract on) + ``amp.GradScaler``, the defaults;
- unified, contract off: ``amp.autocast(contract=False)`` + ``amp.GradScaler``;
- scaler only: ``torch.autocast`` + ``amp.GradScaler`` (the drop-in swap).

Every round times each variant for a few steps, in an order rotated round by round; the
ratios to native are taken within a round and summarised by median and quartiles. It
needs torchvision and transformers: run it in the environment `make test-integrations`
makes for them (``.venv-integrations-models``). Writes
``benchmarks/results/real-models-<device>[-quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network: never ask the Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import unified_amp as amp  # noqa: E402

from .common import TARGET  # noqa: E402
from .report import loadavg, write_json  # noqa: E402
from .timing import interleaved, round_ratios, spread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("native", "control", "unified", "unified, contract off", "scaler only")
# Sizes per mode: what an eager CPU step of a few hundred ms holds (full), a smoke run
# (quick), and what keeps a GPU busy (cuda).
SIZES = {
    "full": {"resnet50": dict(batch=8), "gpt2": dict(batch=4, seq=128, layers=4, width=256)},
    "quick": {"resnet50": dict(batch=2), "gpt2": dict(batch=2, seq=16, layers=1, width=32)},
    "cuda": {"resnet50": dict(batch=128), "gpt2": dict(batch=16, seq=512, layers=12,
                                                        width=768)},
}
SCHEDULE = {"full": dict(warmup=2, rounds=31, steps=3),
            "quick": dict(warmup=1, rounds=2, steps=1),
            "cuda": dict(warmup=10, rounds=15, steps=10)}


def _resnet50(size: dict[str, int], device: str) -> tuple[Any, Callable[..., Any], tuple]:
    import torchvision

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size["batch"], 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (size["batch"],), generator=g).to(device)
    model = torchvision.models.resnet50(num_classes=10).to(device)
    return model, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y), (x, y)


def _gpt2(size: dict[str, int], device: str) -> tuple[Any, Callable[..., Any], tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=size["layers"], n_head=max(1, size["width"] // 64),
                        n_embd=size["width"], vocab_size=1024, n_positions=size["seq"],
                        bos_token_id=0, eos_token_id=0)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (size["batch"], size["seq"]), generator=g)
    return GPT2LMHeadModel(config).to(device), lambda m, x, y: m(x, labels=y).loss, \
        (ids.to(device), ids.to(device))


MODELS = {"resnet50": _resnet50, "gpt2": _gpt2}


def _sides(device: str, dtype: torch.dtype) -> dict[str, tuple[Callable[[], Any], Any]]:
    """name -> (autocast factory, scaler factory)."""
    native = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
    return {
        "native": (native, lambda: torch.amp.GradScaler(device)),
        "control": (native, lambda: torch.amp.GradScaler(device)),
        "unified": (lambda: amp.autocast(device, dtype=dtype), lambda: amp.GradScaler(device)),
        "unified, contract off": (lambda: amp.autocast(device, dtype=dtype, contract=False),
                                  lambda: amp.GradScaler(device)),
        "scaler only": (native, lambda: amp.GradScaler(device)),
    }


def make_step(model_name: str, size: dict[str, int], device: str, autocast: Callable[[], Any],
              scaler: Any) -> Callable[[], float]:
    """One variant's training step on its own model copy (seed 0: the same weights)."""
    torch.manual_seed(0)
    model, loss_of, (x, y) = MODELS[model_name](size, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.item()  # a host sync per step, as a training loop that logs has

    return step


def run(mode: str, device: str, dtype: torch.dtype, models: list[str],
        progress: bool = True) -> dict[str, Any]:
    sched, sides = SCHEDULE[mode], _sides(device, dtype)
    out: dict[str, Any] = {}
    for model_name in models:
        size = SIZES[mode][model_name]
        steps = {name: make_step(model_name, size, device, sides[name][0], sides[name][1]())
                 for name in VARIANTS}
        times = interleaved(steps, warmup=sched["warmup"], rounds=sched["rounds"],
                            steps=sched["steps"])
        out[model_name] = {
            "size": size,
            "step_s": {n: spread(t["per_round"]) for n, t in times.items()},
            "ratio_to_native": {n: spread(round_ratios(times, n, "native"))
                                for n in VARIANTS if n != "native"},
            "final_loss": {n: t["losses"][-1] for n, t in times.items()},
            "per_round_s": {n: t["per_round"] for n, t in times.items()},
        }
        if progress:
            print(table({"models": {model_name: out[model_name]}}), flush=True)
    return out


def table(result: dict[str, Any]) -> str:
    lines = []
    for model_name, r in result["models"].items():
        native = r["step_s"]["native"]["median"] * 1e3
        lines.append(f"{model_name} {r['size']}: native {native:.2f} ms per step; step time"
                     f" / native's, per round, median [IQR] (min-max):")
        for name, ratio in r["ratio_to_native"].items():
            lines.append(f"  {name:22} {ratio['median']:.4f} [{ratio['q1']:.4f}-"
                         f"{ratio['q3']:.4f}] ({ratio['min']:.3f}-{ratio['max']:.3f})")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """The ratios to native per model, with their quartiles, beside the control's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    names = [n for n in VARIANTS if n != "native"]
    fig, ax = plt.subplots(figsize=(4 + 3 * len(models), 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        med = [result["models"][m]["ratio_to_native"][name]["median"] for m in models]
        lo = [med[j] - result["models"][m]["ratio_to_native"][name]["q1"]
              for j, m in enumerate(models)]
        hi = [result["models"][m]["ratio_to_native"][name]["q3"] - med[j]
              for j, m in enumerate(models)]
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(models))], med,
               width, yerr=[lo, hi], capsize=3, label=name,
               hatch="//" if name == "control" else None)
    ax.axhline(1.0, color="gray", lw=0.6)
    ax.axhline(TARGET, color="red", lw=0.8, ls=":", label=f"target {TARGET}")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("step time / native's (median, IQR)")
    lows = [r["ratio_to_native"][n]["q1"] for r in result["models"].values() for n in names]
    ax.set_ylim(min(0.9, min(lows) - 0.02), None)
    ax.legend(fontsize=7)
    ax.set_title(f"torch {result['torch']} on {result['device']}, {result['dtype']},"
                 f" {result['threads']} thread(s) ({result['mode']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_models",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: resnet50,gpt2")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1, as the other benchmarks: a shared"
                        " 2-core machine; 0 keeps torch's default)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if amp.get_backend().name != "torch":
        p.error("these models are torch's (torchvision, transformers);"
                " set UNIFIED_AMP_BACKEND=torch")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        p.error(f"--models takes a comma-separated subset of {','.join(MODELS)};"
                f" got {args.models!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else ("cuda" if args.device == "cuda" else "full")
    dtype = torch.float16 if args.device == "cuda" else torch.bfloat16
    start, load_before = time.time(), loadavg()
    result: dict[str, Any] = {
        "command": "python -m benchmarks.real_models " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__, "device": args.device, "dtype": str(dtype)[6:],
        "threads": torch.get_num_threads(), "mode": mode, "schedule": SCHEDULE[mode],
        "target": TARGET}
    result["models"] = run(mode, args.device, dtype, models)
    result.update(runtime_s=time.time() - start, loadavg_before=load_before,
                  loadavg_after=loadavg(),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"real-models-{args.device}" + ("-quick" if args.quick else ""))
    write_json(result, stem.with_suffix(".json"))
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
