"""unified_amp's step against torch.amp's on real models: ``python -m benchmarks real-models``.

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
makes for them (``.venv-integrations-models``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network: never ask the Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import unified_amp as amp  # noqa: E402

from .timing import Block, interleave, ratios, spread  # noqa: E402

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


def models(run: Any) -> dict[str, Any]:
    device = "cuda" if run.opts.device in (None, "auto") and torch.cuda.is_available() \
        else run.opts.device or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks: --device cuda: torch sees no CUDA device")
    run.device = device
    mode = "quick" if run.quick else ("cuda" if device == "cuda" else "full")
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    sched, sides = run.schedule(SCHEDULE[mode], SCHEDULE["quick"]), _sides(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else None
    out: dict[str, Any] = {}
    for model_name in (run.opts.models or ",".join(MODELS)).split(","):
        size = SIZES[mode][model_name]
        blocks = {name: Block(make_step(model_name, size, device, sides[name][0],
                                        sides[name][1]()), sync=sync,
                        clock=time.process_time if device == "cpu" else time.perf_counter)
                  for name in VARIANTS}
        times = interleave(blocks, **sched)
        out[model_name] = {
            "size": size,
            "step_s": {n: spread(t) for n, t in times.items()},
            "ratio_to_native": {n: ratios(times[n], times["native"])
                                for n in VARIANTS if n != "native"},
            "final_loss": {n: b.last for n, b in blocks.items()},
            "per_round_s": times}
    return {"torch": torch.__version__, "device": device, "dtype": str(dtype)[6:],
            "threads": torch.get_num_threads(), "schedule": sched, "models": out}
