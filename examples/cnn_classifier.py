"""A small CNN (with BatchNorm) learns scikit-learn's handwritten digits, fp32 vs AMP.

The data is ``sklearn.datasets.load_digits``: 1797 real 8x8 scans of handwritten digits
(0-9) that ship inside the scikit-learn package, so nothing is downloaded. A stratified
split holds a third out for testing. ``train_step`` is the whole training step, written
once against unified_amp; the model, loss and optimizer come from
``examples.frameworks`` for the active backend.

With ``--demo`` the same step trains two copies of the model from the same initial
weights on the same batches, one in fp32 and one in AMP, epoch by epoch in turn (the
order alternates), so that machine load hits both alike and their throughput compares
as a ratio measured in one run.

    UNIFIED_AMP_BACKEND=torch python -m examples.cnn_classifier             # AMP
    UNIFIED_AMP_BACKEND=megengine python -m examples.cnn_classifier --demo  # fp32 vs AMP
    python -m examples.cnn_classifier --plant overflow   # a skipped step, explained
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

import unified_amp as amp

from . import frameworks, overflow

NUM_CLASSES = 10
IMAGE_SIZE = 8


def load_digits(test_fraction: float = 1 / 3, seed: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits as float32 images (n, 1, 8, 8) in [0, 1], split stratified.

    Args:
        test_fraction: the share of the 1797 images held out for testing.
        seed: fixes the split.

    Returns:
        (train images, train labels, test images, test labels).
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    # Pixels are counts 0..16 in the dataset.
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=test_fraction, stratify=digits.target,
        random_state=seed)
    return train_x, train_y, test_x, test_y


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
        # Outside autocast, as both frameworks advise: the backward pass follows the
        # forward's dtypes by itself.
        scaler.backward(gm, loss)  # scaled backward, unscale (drops inf/NaN grads), update
    optimizer.step()  # nothing to apply after an overflow: the scaler dropped the grads
    gm.zero_grad()
    return loss.item()


def evaluate(fw: Any, model: Any, images: np.ndarray, labels: np.ndarray,
             precision: Any, batch_size: int = 500,
             to_input: Callable[[np.ndarray], Any] | None = None) -> tuple[float, str]:
    """Accuracy of ``model`` on numpy data, and the dtype its logits came out in;
    ``to_input`` makes a batch the model's input (default: ``fw.tensor``)."""
    to_input = to_input or fw.tensor
    model.eval()
    correct, dtype = 0, ""
    with fw.inference(), precision:
        for start in range(0, len(images), batch_size):
            batch = slice(start, start + batch_size)
            logits = model(to_input(images[batch]))
            dtype = fw.dtype_name(logits)
            correct += int((fw.numpy(logits).argmax(1) == labels[batch]).sum())
    model.train()
    return correct / len(images), dtype


@dataclass
class _Run:
    """One model being trained, with what it has recorded so far."""

    model: Any
    gm: amp.GradManager
    optimizer: Any
    scaler: amp.GradScaler
    precision: amp.autocast
    planter: overflow.Planter
    skips: overflow.SkipPrinter
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    compute_dtype: str = ""


def train_runs(runs: dict[str, bool], *, dtype: str | None = None, epochs: int = 30,
               batch_size: int = 64, train_size: int | None = None, width: int = 16,
               lr: float = 3e-3, seed: int = 0, progress: bool = False,
               data: tuple[np.ndarray, ...] | None = None, plant: str | None = None,
               plant_step: int | None = None) -> dict[str, dict[str, Any]]:
    """Trains one model per entry of ``runs`` (name -> AMP on?) on the digits, in turn.

    Every run starts from the same weights and sees the same batches. Each epoch, each
    run trains for one pass over the training set, timed, in an order that rotates by
    one every epoch; then every run is evaluated on the held-out images (untimed).

    Args:
        runs: name -> whether that run uses AMP; False trains in fp32 through the same
            ``train_step``, with ``autocast(enabled=False)`` and
            ``GradScaler(enabled=False)``.
        dtype: the autocast dtype ("float16", "bfloat16"); None is the device's default.
        epochs: passes over the training set.
        train_size: use only the first ``train_size`` training images (None: all).
        progress: show a tqdm bar with the running losses.
        data: ``load_digits(seed=seed)``'s result, if the caller has it already.
        plant: "overflow" or "nan" plants that inf/NaN source (``examples.overflow``)
            in step ``plant_step`` (counted from 0 over all epochs; default: the middle
            one) of every AMP run, with forward tracing on; each skipped step prints
            its report.
        The others: batch, model width, Adam's learning rate; ``seed`` fixes the split,
        the weights and the batch order.

    Returns:
        name -> dict: ``losses`` (per step), ``epoch_losses`` (mean per epoch),
        ``accuracies`` (held-out, per epoch), ``accuracy`` (the last), ``epoch_seconds``
        (training time of each epoch), ``samples_per_s`` (median over the epochs after
        the first, which includes one-time setup), ``compute_dtype`` (what the logits
        came out in), ``scaler`` (its ``stats()``), ``train_step`` (the step function
        that ran) and ``model``.
    """
    # The data first: MegEngine turns on flush-to-zero when it loads, after which
    # scikit-learn's first use of np.finfo warns that subnormals are zero.
    train_x, train_y, test_x, test_y = data if data is not None else load_digits(seed=seed)
    fw = frameworks.get()
    if train_size is not None:
        train_x, train_y = train_x[:train_size], train_y[:train_size]
    steps_per_epoch = max(1, len(train_x) // batch_size)  # full batches only

    if plant_step is None:
        plant_step = epochs * steps_per_epoch // 2
    state: dict[str, _Run] = {}
    for name, amp_enabled in runs.items():
        fw.seed(seed)  # the same initial weights for every run
        model = fw.cnn(NUM_CLASSES, width, IMAGE_SIZE)
        scaler = amp.GradScaler(enabled=amp_enabled).watch(model)  # names in reports
        # An fp32 run has no scaler to skip the step: plant in AMP runs only.
        planted = plant if amp_enabled else None
        state[name] = _Run(model=model, gm=amp.GradManager(model.parameters()),
                           optimizer=fw.adam(model.parameters(), lr=lr), scaler=scaler,
                           precision=amp.autocast(enabled=amp_enabled, dtype=dtype),
                           planter=overflow.Planter(planted, plant_step, model[-1]),
                           skips=overflow.SkipPrinter(scaler, tqdm.write))

    rng = np.random.default_rng(seed)
    names = list(state)
    bar = tqdm(total=epochs * steps_per_epoch * len(names), disable=not progress,
               desc=f"{amp.get_backend().name} digits", unit="step", leave=True)
    with contextlib.ExitStack() as stack:
        for run in state.values():
            stack.enter_context(run.planter)
            stack.enter_context(overflow.tracing(run.model,
                                                 on=run.planter.kind is not None))
        for epoch in range(epochs):
            order = rng.permutation(len(train_x))
            batches = [(train_x[idx], fw.tensor(train_x[idx]), fw.labels(train_y[idx]))
                       for idx in np.split(order[:steps_per_epoch * batch_size],
                                           steps_per_epoch)]
            for name in names[epoch % len(names):] + names[:epoch % len(names)]:
                run = state[name]
                start = time.perf_counter()
                for j, (array, images, labels) in enumerate(batches):
                    planted = run.planter.batch(epoch * steps_per_epoch + j, array)
                    if planted is not array:
                        images = fw.tensor(planted)
                    run.losses.append(train_step(run.model, run.gm, run.optimizer,
                                                 run.scaler, fw.cross_entropy, images,
                                                 labels, run.precision))
                    run.skips.after_step()
                    bar.update()
                run.epoch_seconds.append(time.perf_counter() - start)
            for run in state.values():
                accuracy, run.compute_dtype = evaluate(fw, run.model, test_x, test_y,
                                                       run.precision)
                run.accuracies.append(accuracy)
            bar.set_postfix({f"{n} acc": f"{100 * state[n].accuracies[-1]:.1f}%"
                             for n in names})
    bar.close()

    results = {}
    for name, run in state.items():
        timed = run.epoch_seconds[1:] or run.epoch_seconds
        results[name] = {
            "losses": run.losses,
            "epoch_losses": [float(np.mean(run.losses[i:i + steps_per_epoch]))
                             for i in range(0, len(run.losses), steps_per_epoch)],
            "accuracies": run.accuracies,
            "accuracy": run.accuracies[-1],
            "epoch_seconds": run.epoch_seconds,
            "samples_per_s": steps_per_epoch * batch_size / float(np.median(timed)),
            "compute_dtype": run.compute_dtype,
            "scaler": run.scaler.stats(),
            "train_step": train_step,
            "model": run.model,
            "data": {"train": len(train_x), "test": len(test_x),
                     "steps_per_epoch": steps_per_epoch},
        }
    return results


def train(*, amp_enabled: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Trains one model, in AMP or in fp32; takes ``train_runs``'s keyword arguments and
    returns its result for that run."""
    name = "AMP" if amp_enabled else "fp32"
    return train_runs({name: amp_enabled}, **kwargs)[name]


def throughput_ratio(results: dict[str, dict[str, Any]], num: str = "AMP",
                     den: str = "fp32") -> dict[str, float]:
    """``num``'s throughput over ``den``'s, per epoch (the two ran back to back in each
    epoch), over the epochs after the first; median and quartiles."""
    a, b = results[num]["epoch_seconds"], results[den]["epoch_seconds"]
    ratios = [tb / ta for ta, tb in zip(a, b)][1:] or [b[0] / a[0]]
    q1, median, q3 = np.percentile(ratios, [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3), "n": len(ratios)}


def throughput_verdict(ratio: dict[str, float]) -> str:
    """One sentence on which precision trained faster, that follows from ``ratio``: a
    side is named only when the middle half of the per-epoch ratios lies on it."""
    figures = (f"AMP trained at {ratio['median']:.2f}x the throughput of fp32 (median of"
               f" {ratio['n']} per-epoch ratios; quartiles {ratio['q1']:.2f}-"
               f"{ratio['q3']:.2f})")
    if ratio["q1"] > 1.0:
        return figures + ": AMP was faster here."
    if ratio["q3"] < 1.0:
        return (figures + ": AMP was slower here. At this model size the low-precision"
                " kernels plus autocast's casts cost more than float32 ones; AMP pays"
                " off where low-precision kernels are fast (GPUs; bfloat16 with torch on"
                " recent CPUs, for larger models).")
    return figures + ": the quartiles straddle 1.0, so neither was clearly faster."


def accuracy_verdict(results: dict[str, dict[str, Any]]) -> str:
    """One sentence comparing the held-out accuracies of fp32 and AMP."""
    fp32, mixed = 100 * results["fp32"]["accuracy"], 100 * results["AMP"]["accuracy"]
    gap = mixed - fp32
    return (f"Held-out accuracy: fp32 {fp32:.1f}%, AMP {mixed:.1f}% ({gap:+.1f} points,"
            f" on {results['fp32']['data']['test']} images).")


# The rows of a run's summary that the demo and the CIFAR experiment (examples.cifar_plot)
# both print: label, and the cell made from the run's result.
LOSS_ROWS = [
    ("loss, first step", lambda r: f"{r['losses'][0]:.4f}"),
    ("loss, last epoch", lambda r: f"{r['epoch_losses'][-1]:.4f}"),
    ("held-out accuracy", lambda r: f"{100 * r['accuracy']:.1f}%"),
]
SCALER_ROWS = [
    ("final loss scale", lambda r: f"{r['scaler']['scale']:g}"
                                   + ("" if r["scaler"]["enabled"] else " (off)")),
    ("skipped steps", lambda r: f"{r['scaler']['skipped_steps']} of {len(r['losses'])}"),
]


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One column per run: losses, accuracy, samples/s, loss scale, skipped steps."""
    names = list(results)
    rows = [("compute dtype", lambda r: r["compute_dtype"]), *LOSS_ROWS,
            ("samples/s", lambda r: f"{r['samples_per_s']:.0f}"), *SCALER_ROWS]
    if "AMP" in results and "fp32" in results:
        ratio = throughput_ratio(results)
        rows.insert(5, ("throughput vs fp32",
                        lambda r: "1 (baseline)" if r is results["fp32"]
                        else f"{ratio['median']:.2f}x"))
    print(f"{'':<19}" + "".join(f"{n:>16}" for n in names))
    for label, cell in rows:
        print(f"{label:<19}" + "".join(f"{cell(results[n]):>16}" for n in names))


def plot_curves(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Saves training loss (per step, and per-epoch mean) and held-out accuracy (per
    epoch) of every run to a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    # fp32 wide and solid, AMP dashed on top: where the curves agree both stay visible.
    styles = ({"color": "tab:blue", "linewidth": 3.0, "alpha": 0.7},
              {"color": "tab:orange", "linewidth": 1.5, "linestyle": "--"})
    for (name, r), style in zip(results.items(), styles):
        color = style["color"]
        per_epoch = r["data"]["steps_per_epoch"]
        steps = np.arange(1, len(r["losses"]) + 1)
        ax_loss.plot(steps, r["losses"], color=color, alpha=0.25, linewidth=0.8)
        ends = per_epoch * np.arange(1, len(r["epoch_losses"]) + 1)
        ax_loss.plot(ends, r["epoch_losses"], marker=".", **style,
                     label=f"{name} ({r['compute_dtype']}), epoch mean")
        epochs = np.arange(1, len(r["accuracies"]) + 1)
        ax_acc.plot(epochs, 100 * np.asarray(r["accuracies"]), marker=".", **style,
                    label=f"{name}: {100 * r['accuracy']:.1f}% at the end")
    ax_loss.set(xlabel="step", ylabel="training loss (cross-entropy)", yscale="log",
                title="training loss")
    ax_acc.set(xlabel="epoch", ylabel="held-out accuracy (%)",
               title=f"held-out accuracy ({results[next(iter(results))]['data']['test']}"
                     f" images)")
    ax_acc.set_ylim(max(0.0, min(100 * min(r["accuracies"]) for r in results.values())
                        - 2), 100.5)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None, description: str = __doc__,
               amp_options: bool = True) -> argparse.Namespace:
    """The command line of this example; ``examples.fp32_baseline`` shares it without
    the AMP options (``amp_options=False``)."""
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-size", type=int, default=None,
                   help="train on the first N training images only (default: all)")
    p.add_argument("--width", type=int, default=16, help="channels of the first conv")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    if amp_options:
        p.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                       help="autocast dtype (default: the device's, bfloat16 on"
                            " torch/CPU, float16 on MegEngine/CPU and on CUDA)")
        p.add_argument("--demo", action="store_true",
                       help="train in fp32 and in AMP, in turn, and compare")
        p.add_argument("--plot", type=Path, default=None,
                       help="with --demo: save the loss and accuracy curves to this PNG")
        overflow.add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the example; returns ``train()``'s result, or {"fp32": ..., "AMP": ...}
    with ``--demo``."""
    args = parse_args(argv)
    data = load_digits(seed=args.seed)  # before the framework: see train_runs()
    fw = frameworks.get()
    backend = fw.name
    runs = {"fp32": False, "AMP": True} if args.demo else {"AMP": True}
    print(f"cnn_classifier on {backend} ({fw.device_name()}): scikit-learn's handwritten"
          f" digits, 8x8, 10 classes; batch {args.batch_size}, {args.epochs} epochs")
    print(f"AMP: autocast(dtype={args.dtype!r})"
          + (", the device's default low precision" if args.dtype is None else "")
          + " and GradScaler()"
          + ("; fp32 and AMP train in turn, epoch by epoch" if args.demo else ""))
    results = train_runs(runs, dtype=args.dtype, epochs=args.epochs,
                         batch_size=args.batch_size, train_size=args.train_size,
                         width=args.width, lr=args.lr, seed=args.seed,
                         progress=not args.no_progress, data=data, plant=args.plant,
                         plant_step=args.plant_step)
    data = results[next(iter(results))]["data"]
    print(f"\n{data['train']} training images, {data['test']} held out\n")
    print_table(results)
    last = overflow.summary(results["AMP"]["scaler"])
    if last is not None:
        print(f"\nLast skipped step, as the scaler explains it:\n  {last}")
    if not args.demo:
        return results["AMP"]
    print()
    print(accuracy_verdict(results))
    print(throughput_verdict(throughput_ratio(results)))
    if args.plot is not None:
        ratio = throughput_ratio(results)
        title = (f"unified_amp on {backend} ({fw.device_name()}): digits CNN, fp32 vs AMP"
                 f" ({results['AMP']['compute_dtype']}); AMP/fp32 throughput"
                 f" {ratio['median']:.2f}x (quartiles {ratio['q1']:.2f}-{ratio['q3']:.2f})")
        print(f"Curves: {plot_curves(results, args.plot, title)}")
    return results


if __name__ == "__main__":
    main()
