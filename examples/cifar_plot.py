"""The CIFAR experiment's charts and table, from saved results (framework-free).

One row of four panels per result (one result per backend, or per run of
``examples.cifar``): training loss against step and against wall time, held-out
accuracy against step and against wall time, fp32 and AMP in each panel. Wall time is
each run's own training time (its turns, without evaluation and without the other
run's turns), so the curves show what each would have taken alone.

    python -m examples.cifar --plot cifar-output/torch-resnet18.json \\
        cifar-output/megengine-resnet18.json --png cifar-output/both.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from . import cnn_classifier

# fp32 wide and solid, AMP dashed on top: where the curves agree both stay visible.
STYLES = {"fp32": {"color": "tab:blue", "linewidth": 2.6, "alpha": 0.75},
          "AMP": {"color": "tab:orange", "linewidth": 1.4, "linestyle": "--"},
          "native": {"color": "tab:green", "linewidth": 1.0, "linestyle": ":"}}


def load(paths: list[Path]) -> list[dict[str, Any]]:
    """Saved results (``examples.cifar``'s JSON files), in the order given.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: a file that is not a result of ``examples.cifar``.
    """
    results = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        if not isinstance(result, dict) or not {"fp32", "AMP"} <= set(result.get("runs", {})):
            raise ValueError(f"{str(path)!r} is not a result of examples.cifar (it has no"
                             f" fp32 and AMP runs); pass the .json files that it wrote.")
        results.append(result)
    return results


def smooth(values: list[float], window: int) -> np.ndarray:
    """Running mean over the last ``window`` values (fewer at the start)."""
    a = np.asarray(values, dtype=np.float64)
    if window <= 1 or a.size == 0:
        return a
    sums = np.cumsum(np.insert(a, 0, 0.0))
    counts = np.minimum(np.arange(1, a.size + 1), window)
    return (sums[1:] - sums[np.maximum(np.arange(1, a.size + 1) - window, 0)]) / counts


def mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.0f} MiB"


def headline(result: dict[str, Any]) -> str:
    """What one row of the chart shows, in one line."""
    runs, ratio = result["runs"], result["throughput_ratio"]
    mem = ""
    if runs["fp32"]["peak_memory_bytes"] is not None:
        mem = (f"; step memory {mib(runs['AMP']['step_memory_bytes'])} vs"
               f" {mib(runs['fp32']['step_memory_bytes'])} fp32")
    data = "synthetic CIFAR-10-shaped" if result["data"]["synthetic"] else "CIFAR-10"
    return (f"{result['backend']} {result['framework_version']} ({result['device']}):"
            f" {result['model']} (width {result['width']}) on {data}, batch"
            f" {result['batch_size']}; AMP = {runs['AMP']['precision']}: throughput"
            f" {ratio['median']:.2f}x fp32{mem}; skipped"
            f" {runs['AMP']['scaler']['skipped_steps']} of {len(runs['AMP']['losses'])}")


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Draws every result as a row of the four panels and saves the PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(20, 4.6 * len(results)), layout="constrained")
    rows = fig.subfigures(len(results), 1, squeeze=False)[:, 0]
    for subfig, result in zip(rows, results):
        row = subfig.subplots(1, 4)
        subfig.suptitle(headline(result), fontsize=10)
        window = max(1, min(50, result["steps_per_epoch"] // 2))
        for name, run in result["runs"].items():
            style = STYLES[name]
            steps = np.arange(1, len(run["losses"]) + 1)
            label = f"{name} ({run['precision']})"
            for ax, x in ((row[0], steps), (row[1], np.asarray(run["times"]))):
                ax.plot(x, run["losses"], color=style["color"], alpha=0.2, linewidth=0.6)
                ax.plot(x, smooth(run["losses"], window), **style,
                        label=f"{label}, mean of {window} steps")
            for ax, x in ((row[2], run["epoch_end_steps"]), (row[3], run["epoch_times"])):
                ax.plot(x, 100 * np.asarray(run["accuracies"]), marker="o", markersize=3,
                        **style, label=f"{label}: {100 * run['accuracy']:.1f}% at the end")
        test = result["runs"]["fp32"]["data"]["test"]
        for ax, xlabel, ylabel in ((row[0], "step", "training loss"),
                                   (row[1], "wall time of the run (s)", "training loss"),
                                   (row[2], "step", f"held-out accuracy (%, {test} images)"),
                                   (row[3], "wall time of the run (s)",
                                    f"held-out accuracy (%, {test} images)")):
            ax.set(xlabel=xlabel, ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in row[:2]:
            ax.set_yscale("log")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ratio_cell(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.2f}x ({ratio['q1']:.2f}-{ratio['q3']:.2f})"


def table(result: dict[str, Any]) -> str:
    """One column per run: the figures the experiment compares."""
    runs = result["runs"]
    ratio = result["throughput_ratio"]
    ratios = result.get("throughput_ratios", {})  # per run; older results have AMP's only
    rows = [
        ("precision", lambda r: r["precision"]), *cnn_classifier.LOSS_ROWS,
        ("best accuracy", lambda r: f"{100 * max(r['accuracies']):.1f}%"),
        ("samples/s", lambda r: f"{r['samples_per_s']:.1f}"),
        ("throughput vs fp32", lambda r: "1 (baseline)" if r is runs["fp32"] else
         _ratio_cell(ratios.get(next(n for n in runs if runs[n] is r), ratio))),
        ("peak memory", lambda r: mib(r["peak_memory_bytes"])),
        ("step memory", lambda r: mib(r["step_memory_bytes"])),
        *cnn_classifier.SCALER_ROWS,
    ]
    lines = [f"{'':<20}" + "".join(f"{n:>24}" for n in runs)]
    lines += [f"{label:<20}" + "".join(f"{cell(r):>24}" for r in runs.values())
              for label, cell in rows]
    return "\n".join(lines)
