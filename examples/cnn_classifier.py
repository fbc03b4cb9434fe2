"""A small CNN (with BatchNorm) learns to tell bar orientations apart, with AMP.

The images are made here with numpy: 16x16 noise with one bright bar that is
horizontal, vertical, diagonal or anti-diagonal (the four classes), at a random offset.
``train_step`` is the whole training step, written once against unified_amp; the model,
loss and optimizer come from ``examples.frameworks`` for the active backend.

    UNIFIED_AMP_BACKEND=torch python -m examples.cnn_classifier             # AMP
    UNIFIED_AMP_BACKEND=megengine python -m examples.cnn_classifier --demo  # fp32 vs AMP
    python -m examples.cnn_classifier --plant overflow   # a skipped step, explained
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

import unified_amp as amp

from . import frameworks, overflow

CLASSES = ("horizontal", "vertical", "diagonal", "anti-diagonal")


def make_bars(n: int, size: int, noise: float, rng: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy images (n, 1, size, size) float32, one bar each, and their labels.

    Args:
        n: how many images.
        size: height and width in pixels.
        noise: standard deviation of the Gaussian pixel noise (the bar is 1.0 bright).
        rng: the numpy generator to draw from.
    """
    labels = rng.integers(0, len(CLASSES), n)
    offsets = rng.integers(-size // 3, size // 3 + 1, n)
    rows, cols = np.mgrid[:size, :size]
    images = rng.normal(0.0, noise, (n, 1, size, size)).astype(np.float32)
    for i, (label, off) in enumerate(zip(labels, offsets)):
        # A line through the centre, shifted by `off`, three pixels thick.
        coord = (rows, cols, rows - cols, rows + cols - (size - 1))[label]
        centre = size // 2 if label < 2 else 0
        images[i, 0] += (np.abs(coord - centre - off) <= 1.0).astype(np.float32)
    return images, labels


def train_step(model: Any, gm: amp.GradManager, optimizer: Any, scaler: amp.GradScaler,
               loss_fn: Callable[[Any, Any], Any], images: Any, labels: Any,
               precision: amp.autocast) -> float:
    """One optimizer step in automatic mode; the same code on both frameworks.

    Args:
        model: the network (a torch or MegEngine module).
        gm: a GradManager attached to the model's parameters.
        optimizer: the framework's optimizer over those parameters.
        scaler: the loss scaler; ``GradScaler(enabled=False)`` makes this an fp32 step.
        loss_fn: ``loss_fn(logits, labels)`` -> scalar loss.
        images, labels: one batch, as framework tensors.
        precision: the autocast block for the forward pass; ``autocast(enabled=False)``
            for fp32.

    Returns:
        The batch loss. Reading it every step also surfaces MegEngine's asynchronous
        kernel errors at the step that caused them.
    """
    with gm:
        with precision:
            loss = loss_fn(model(images), labels)
        # Outside autocast: the backward pass follows the forward's dtypes anyway.
        scaler.backward(gm, loss)  # scaled backward, unscale (drops inf/NaN grads), update
    optimizer.step()  # nothing to apply after an overflow: the scaler dropped the grads
    gm.zero_grad()
    return loss.item()


def evaluate(fw: Any, model: Any, images: np.ndarray, labels: np.ndarray,
             precision: amp.autocast, batch_size: int = 500) -> tuple[float, str]:
    """Accuracy of ``model`` on numpy data, and the dtype its logits came out in."""
    model.eval()
    correct, dtype = 0, ""
    with fw.inference(), precision:
        for start in range(0, len(images), batch_size):
            batch = slice(start, start + batch_size)
            logits = model(fw.tensor(images[batch]))
            dtype = fw.dtype_name(logits)
            correct += int((fw.numpy(logits).argmax(1) == labels[batch]).sum())
    model.train()
    return correct / len(images), dtype


def train(*, amp_enabled: bool = True, dtype: str | None = None, steps: int = 150,
          batch_size: int = 64, train_size: int = 2048, test_size: int = 1000,
          image_size: int = 16, width: int = 8, noise: float = 1.0, lr: float = 3e-3,
          seed: int = 0, progress: bool = False, desc: str = "",
          plant: str | None = None, plant_step: int | None = None) -> dict[str, Any]:
    """Trains the CNN classifier on the active backend and evaluates it on held-out data.

    Args:
        amp_enabled: False trains in fp32 through the same ``train_step``, with
            ``autocast(enabled=False)`` and ``GradScaler(enabled=False)``.
        dtype: the autocast dtype ("float16", "bfloat16"); None is the device's default.
        progress: show a tqdm bar with the running loss.
        desc: the progress bar's label.
        plant: "overflow" or "nan" plants that inf/NaN source (``examples.overflow``)
            in step ``plant_step`` (default: the middle one) of an AMP run, with
            forward tracing on; each skipped step prints its report.
        The others: data, model and optimizer sizes; ``seed`` fixes data and weights.

    Returns:
        A dict: ``losses`` (per step), ``accuracy`` (held-out), ``samples_per_s``,
        ``compute_dtype`` (what the logits came out in), ``scaler`` (its ``stats()``),
        ``train_step`` (the step function that ran) and ``model``.
    """
    fw = frameworks.get()
    rng = np.random.default_rng(seed)
    train_x, train_y = make_bars(train_size, image_size, noise, rng)
    test_x, test_y = make_bars(test_size, image_size, noise, rng)

    fw.seed(seed)
    model = fw.cnn(len(CLASSES), width, image_size)
    optimizer = fw.adam(model.parameters(), lr=lr)
    gm = amp.GradManager(model.parameters())
    scaler = amp.GradScaler(enabled=amp_enabled).watch(model)  # names in overflow reports
    precision = amp.autocast(enabled=amp_enabled, dtype=dtype)
    plant = plant if amp_enabled else None  # an fp32 run has no scaler to skip the step
    plant_step = steps // 2 if plant_step is None else plant_step

    order = np.concatenate([rng.permutation(train_size)
                            for _ in range(steps * batch_size // train_size + 1)])
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=True)
    skips = overflow.SkipPrinter(scaler, tqdm.write)
    start = time.perf_counter()
    with overflow.Planter(plant, plant_step, model[-1]) as planter, \
            overflow.tracing(model, on=plant is not None):
        for i in bar:
            idx = order[i * batch_size:(i + 1) * batch_size]
            images = planter.batch(i, train_x[idx])
            loss = train_step(model, gm, optimizer, scaler, fw.cross_entropy,
                              fw.tensor(images), fw.labels(train_y[idx]), precision)
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            skips.after_step()
    elapsed = time.perf_counter() - start
    bar.close()

    accuracy, compute_dtype = evaluate(fw, model, test_x, test_y, precision)
    return {
        "losses": losses,
        "accuracy": accuracy,
        "samples_per_s": steps * batch_size / elapsed,
        "compute_dtype": compute_dtype,
        "scaler": scaler.stats(),
        "train_step": train_step,
        "model": model,
    }


def final_loss(losses: list[float], last: int = 10) -> float:
    """The mean loss over the last ``last`` steps (one batch's loss is noisy)."""
    return float(np.mean(losses[-last:]))


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One column per run: final loss, accuracy, samples/s, loss scale, skipped steps."""
    names = list(results)
    rows = [
        ("compute dtype", lambda r: r["compute_dtype"]),
        ("loss, first step", lambda r: f"{r['losses'][0]:.4f}"),
        ("loss, last 10 avg", lambda r: f"{final_loss(r['losses']):.4f}"),
        ("held-out accuracy", lambda r: f"{100 * r['accuracy']:.1f}%"),
        ("samples/s", lambda r: f"{r['samples_per_s']:.0f}"),
        ("final loss scale", lambda r: f"{r['scaler']['scale']:g}"
                                       + ("" if r["scaler"]["enabled"] else " (off)")),
        ("skipped steps", lambda r: f"{r['scaler']['skipped_steps']}"
                                    f" of {len(r['losses'])}"),
    ]
    print(f"{'':<19}" + "".join(f"{n:>16}" for n in names))
    for label, cell in rows:
        print(f"{label:<19}" + "".join(f"{cell(results[n]):>16}" for n in names))


def parse_args(argv: list[str] | None, description: str = __doc__,
               amp_options: bool = True) -> argparse.Namespace:
    """The command line of this example; ``examples.fp32_baseline`` shares it without
    the AMP options (``amp_options=False``)."""
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--image-size", type=int, default=16, help="a multiple of 4")
    p.add_argument("--width", type=int, default=8, help="channels of the first conv")
    p.add_argument("--noise", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    if amp_options:
        p.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                       help="autocast dtype (default: the device's, bfloat16 on"
                            " torch/CPU, float16 on MegEngine/CPU)")
        p.add_argument("--demo", action="store_true",
                       help="train in fp32 and then in AMP on the same data, and compare")
        overflow.add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the example; returns ``train()``'s result, or {"fp32": ..., "AMP": ...}
    with ``--demo``."""
    args = parse_args(argv)
    config = dict(dtype=args.dtype, steps=args.steps, batch_size=args.batch_size,
                  train_size=args.train_size, test_size=args.test_size,
                  image_size=args.image_size, width=args.width, noise=args.noise,
                  lr=args.lr, seed=args.seed, progress=not args.no_progress,
                  plant=args.plant, plant_step=args.plant_step)
    backend = amp.get_backend().name
    print(f"cnn_classifier on {backend}: {len(CLASSES)} classes of {args.image_size}x"
          f"{args.image_size} bar images, {args.train_size} for training,"
          f" {args.test_size} held out; batch {args.batch_size}, {args.steps} steps")
    print(f"AMP: autocast(dtype={args.dtype!r})"
          + (", the device's default low precision" if args.dtype is None else "")
          + " and GradScaler()")
    runs = {"fp32": False, "AMP": True} if args.demo else {"AMP": True}
    results = {name: train(amp_enabled=on, desc=f"{backend} {name}", **config)
               for name, on in runs.items()}
    print()
    print_table(results)
    last = overflow.summary(results["AMP"]["scaler"])
    if last is not None:
        print(f"\nLast skipped step, as the scaler explains it:\n  {last}")
    if args.demo and results["AMP"]["samples_per_s"] < results["fp32"]["samples_per_s"]:
        low = results["AMP"]["compute_dtype"]
        print(f"\nAMP is slower than fp32 here: on this device and at this model size,"
              f" {low} kernels plus autocast's casts cost more than float32 ones. AMP pays"
              f" off where low-precision kernels are fast (GPUs; bfloat16 with torch on"
              f" recent CPUs, for larger models).")
    return results if args.demo else results["AMP"]


if __name__ == "__main__":
    main()
