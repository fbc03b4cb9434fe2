"""Gradient accumulation with AMP in manual mode: N micro-batches, one unscale, gradient
clipping on true-scale gradients, one optimizer step, one scale update.

An MLP learns a synthetic 4-class problem (the class of a point is which of 4 random
linear scores is largest). ``accumulation_step`` is written once against unified_amp;
the model, loss and optimizer come from ``examples.frameworks`` for the active backend.

    UNIFIED_AMP_BACKEND=torch python -m examples.grad_accumulation --micro-batches 4
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

import numpy as np
from tqdm import tqdm

import unified_amp as amp

from . import frameworks, overflow


def make_problem(n: int, features: int, classes: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random teacher ``w`` (features, classes) and ``n`` points labelled by it.

    Returns:
        (w, inputs float32 (n, features), labels (n,)).
    """
    w = rng.normal(size=(features, classes))
    x = rng.normal(size=(n, features)).astype(np.float32)
    return w, x, (x @ w).argmax(1)


def accumulation_step(model: Any, gm: amp.GradManager, optimizer: Any,
                      scaler: amp.GradScaler, loss_fn: Callable[[Any, Any], Any],
                      micro_batches: Sequence[tuple[Any, Any]], precision: amp.autocast,
                      max_norm: float) -> tuple[float, float]:
    """One optimizer step over several micro-batches, in the scaler's manual mode.

    Args:
        model, gm, optimizer: the network, a GradManager attached to its parameters,
            and the framework's optimizer over them.
        scaler: the loss scaler.
        loss_fn: ``loss_fn(logits, labels)`` -> mean loss over the micro-batch.
        micro_batches: (inputs, labels) pairs of equal size, as framework tensors.
        precision: the autocast block for the forward passes.
        max_norm: the gradient norm to clip to.

    Returns:
        (the loss over the whole batch, the gradient norm before clipping; 0.0 when
        the gradients overflowed and the scaler dropped them).
    """
    batch_loss = 0.0
    for inputs, labels in micro_batches:
        with gm:
            with precision:
                # Divided so the accumulated gradient is that of the whole batch's mean.
                loss = loss_fn(model(inputs), labels) / len(micro_batches)
            gm.backward(scaler.scale(loss))  # adds scaled gradients to p.grad
        batch_loss += loss.item()
    # Once, after the last micro-batch: clipping must see true-scale gradients, and
    # unscaling twice would divide them by the scale twice.
    scaler.unscale(gm)
    grad_norm = amp.clip_grad_norm(gm, max_norm)
    scaler.step(optimizer)  # skipped if the unscale found an inf/NaN
    scaler.update()
    gm.zero_grad()
    return batch_loss, grad_norm


def evaluate(fw: Any, model: Any, x: np.ndarray, y: np.ndarray,
             precision: amp.autocast) -> float:
    """Accuracy of ``model`` on numpy data."""
    with fw.inference(), precision:
        return float((fw.numpy(model(fw.tensor(x))).argmax(1) == y).mean())


def train(*, amp_enabled: bool = True, dtype: str | None = None, steps: int = 200,
          micro_batches: int = 4, micro_batch_size: int = 32, features: int = 16,
          classes: int = 4, hidden: int = 64, train_size: int = 4096,
          test_size: int = 1000, lr: float = 0.05, max_norm: float = 1.0, seed: int = 0,
          progress: bool = False) -> dict[str, Any]:
    """Trains the MLP with ``micro_batches`` x ``micro_batch_size`` samples per step.

    Returns:
        A dict: ``losses`` and ``grad_norms`` (per step), ``accuracy`` (held-out),
        ``scaler`` (its ``stats()``) and ``model``.
    """
    fw = frameworks.get()
    rng = np.random.default_rng(seed)
    w, train_x, train_y = make_problem(train_size, features, classes, rng)
    test_x = rng.normal(size=(test_size, features)).astype(np.float32)
    test_y = (test_x @ w).argmax(1)

    fw.seed(seed)
    model = fw.mlp([features, hidden, hidden, classes])
    optimizer = fw.sgd(model.parameters(), lr=lr, momentum=0.9)
    gm = amp.GradManager(model.parameters())
    scaler = amp.GradScaler(enabled=amp_enabled).watch(model)  # names in overflow reports
    precision = amp.autocast(enabled=amp_enabled, dtype=dtype)

    batch = micro_batches * micro_batch_size
    order = np.concatenate([rng.permutation(train_size)
                            for _ in range(steps * batch // train_size + 1)])
    losses, grad_norms = [], []
    bar = tqdm(range(steps), desc=f"{fw.name} accumulation", disable=not progress)
    for i in bar:
        chunks = np.split(order[i * batch:(i + 1) * batch], micro_batches)
        loss, norm = accumulation_step(
            model, gm, optimizer, scaler, fw.cross_entropy,
            [(fw.tensor(train_x[c]), fw.labels(train_y[c])) for c in chunks],
            precision, max_norm)
        losses.append(loss)
        grad_norms.append(norm)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    bar.close()
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "accuracy": evaluate(fw, model, test_x, test_y, precision),
        "scaler": scaler.stats(),
        "model": model,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the example and prints a summary; returns ``train()``'s result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                   help="autocast dtype (default: the device's)")
    p.add_argument("--no-amp", action="store_true", help="train in fp32")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    r = train(amp_enabled=not args.no_amp, dtype=args.dtype, steps=args.steps,
              micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
              hidden=args.hidden, lr=args.lr, max_norm=args.max_norm, seed=args.seed,
              progress=not args.no_progress)
    s = r["scaler"]
    clipped = sum(n > args.max_norm for n in r["grad_norms"])
    print(f"gradient accumulation on {amp.get_backend().name}, {args.steps} steps of"
          f" {args.micro_batches} x {args.micro_batch_size} samples,"
          f" {'fp32' if args.no_amp else 'AMP'}")
    print(f"  loss {r['losses'][0]:.4f} -> {np.mean(r['losses'][-10:]):.4f} (last 10 steps);"
          f" held-out accuracy {100 * r['accuracy']:.1f}%")
    print(f"  gradient norm clipped to {args.max_norm} in {clipped} of {args.steps} steps")
    print(f"  scaler: {s['steps']} updates, {s['skipped_steps']} skipped,"
          f" final scale {s['scale']:g}")
    if overflow.summary(s):
        print(f"  last overflow: {overflow.summary(s)}")
    return r


if __name__ == "__main__":
    main()
