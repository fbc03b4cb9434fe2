"""The experiment unified_amp starts from: a ResNet on CIFAR-10, fp32 vs AMP, either framework.

Two copies of a CIFAR ResNet (``examples.resnet``: ResNet-18 or ResNet-50, 3x3 stem, no
max-pool) train from the same initial weights on the same batches, one in fp32 and one
in AMP, epoch by epoch in turn (the order alternates), so that machine load hits both
alike and their throughput compares as a ratio measured in one run. The step is the
demo's (``examples.cnn_classifier.train_step``: ``amp.autocast`` + ``amp.GradScaler``)
or, with ``--opt-level``, apex's (``examples.apex_style.generator_step``:
``amp.initialize`` + ``amp.scale_loss``; the fp32 run is then O0). With ``--native`` a
third copy trains in the same turns with the framework's own AMP (``examples.native_amp``:
torch.autocast + torch.amp.GradScaler, or megengine.amp's), so unified_amp's cost shows
as a ratio to the native loop's, and ``--no-contract`` makes the two byte-comparable. SGD with momentum
0.9, weight decay 5e-4, the learning rate times 0.1 at half and three quarters of the
epochs; random crops (4-pixel padding) and mirroring.

The data is CIFAR-10 from a local folder (``examples.cifar_data``; nothing is
downloaded), or with ``--synthetic N`` a generated folder in the same layout. It prints
held-out accuracy per epoch, samples/s, peak memory (on a GPU) and skipped steps, and
writes the results as JSON and the curves as a PNG (``examples.cifar_plot``).

    make cifar CIFAR_ARGS="--data ~/data/cifar-10-batches-py"     # ResNet-50, batch 128
    UNIFIED_AMP_BACKEND=megengine python -m examples.cifar --synthetic 2000 \\
        --model resnet18 --width 16 --batch-size 32 --epochs 4
    python -m examples.cifar --plot cifar-output/torch-resnet18.json \\
        cifar-output/megengine-resnet18.json --png cifar-output/both.png
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

import unified_amp as amp

from . import apex_style, cifar_data, cifar_plot, cnn_classifier, frameworks, native_amp, resnet

DEFAULT_DATA = Path("data") / cifar_data.FOLDER
PAD = 4  # random crops: pad each side by 4 pixels, cut a 32x32 window


@dataclass
class Options:
    """How the two runs train; the defaults are the experiment's (ResNet-50, batch 128)."""

    model: str = "resnet50"
    width: int = 64
    epochs: int = 30
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    dtype: str | None = None  # None: the device's low precision
    opt_level: str | None = None  # None: amp.autocast + amp.GradScaler; "O1"/"O2": apex's API
    contract: bool = True  # amp.autocast's dtype contract; False: the native autocast's dtypes
    native: bool = False  # a third run: the framework's own AMP (examples.native_amp)
    channels_last: bool = False
    augment: bool = True
    seed: int = 0
    eval_batch_size: int = 500
    time_budget: float | None = None  # seconds; no epoch starts that would run past it
    progress: bool = False


@dataclass
class _Run:
    """One model being trained, with what it has recorded so far."""

    model: Any
    step: Callable[[Any, Any], float]
    scheduler: Any
    stats: Callable[[], dict[str, Any]]  # the scaler's figures
    precision: Any  # the block evaluation runs in
    label: str
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # its own training clock, per step
    clock: float = 0.0
    epoch_seconds: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    peak_memory: list[int] = field(default_factory=list)
    step_memory: list[int] = field(default_factory=list)
    compute_dtype: str = ""


def channels_last_refusal(fw: Any, model: str = "resnet50", width: int = 64) -> str | None:
    """Why ``--channels-last`` cannot run here, or None where it can: the backend has no
    memory formats, or this CPU's oneDNN would hang in the model's backward."""
    if not hasattr(fw, "channels_last"):
        return (f"--channels-last asks for torch's channels-last memory format; {fw.name} has"
                f" none (MegEngine 1.13's tensors have no memory format to choose). Drop"
                f" --channels-last on this backend.")
    return fw.channels_last_hazard(resnet.resnet(fw, model, len(cifar_data.CLASSES), width))


def _make_run(fw: Any, mode: str, opts: Options) -> _Run:
    """``mode``: "fp32", "AMP" (unified_amp's) or "native" (the framework's own AMP)."""
    fw.seed(opts.seed)  # the same initial weights for every run
    model = resnet.resnet(fw, opts.model, len(cifar_data.CLASSES), opts.width)
    if opts.channels_last:
        model = fw.channels_last(model)
    optimizer = fw.sgd(model.parameters(), opts.lr, opts.momentum, opts.weight_decay)
    loss_fn = fw.cross_entropy
    amp_on = mode != "fp32"
    milestones = sorted({max(1, opts.epochs // 2), max(1, 3 * opts.epochs // 4)})
    scheduler = fw.lr_milestones(optimizer, milestones, 0.1)
    if mode == "native":
        native = native_amp.native_amp(fw, model, optimizer, loss_fn, opts.dtype)
        return _Run(model=model, step=native.step, stats=native.stats, label=native.label,
                    precision=native.precision, scheduler=scheduler)
    if opts.opt_level is not None:  # apex's API: the fp32 run is O0
        level = opts.opt_level if amp_on else "O0"
        model, optimizer = amp.initialize(model, optimizer, opt_level=level,
                                          low_dtype=opts.dtype, verbosity=0)
        scaler, props = amp.loss_scaler(0), amp.opt_properties()
        label = f"{level}, {props.low_dtype}" if amp_on else "O0, float32"
        gm = amp.GradManager(model.parameters())
        precision: Any = contextlib.nullcontext()  # initialize wrapped the forward

        def step(images: Any, labels: Any) -> float:
            return apex_style.generator_step(model=model, optimizer=optimizer, gm=gm,
                                             loss_fn=loss_fn, inputs=images, targets=labels)
    else:
        scaler = amp.GradScaler(enabled=amp_on)
        precision = amp.autocast(enabled=amp_on, dtype=opts.dtype, contract=opts.contract)
        gm = amp.GradManager(model.parameters())
        label = ""  # the compute dtype, once the first evaluation has seen it

        def step(images: Any, labels: Any) -> float:
            return cnn_classifier.train_step(model, gm, optimizer, scaler, loss_fn, images,
                                             labels, precision)
    return _Run(model=model, step=step, stats=lambda: _jsonable_stats(scaler),
                precision=precision, label=label, scheduler=scheduler)


def normaliser(train_x: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """uint8 images -> float32, each channel shifted and scaled by the training set's
    mean and standard deviation."""
    pixels = train_x.transpose(1, 0, 2, 3).reshape(3, -1)
    mean = pixels.mean(1, dtype=np.float64).reshape(1, 3, 1, 1)
    std = np.sqrt(np.maximum(pixels.var(1, dtype=np.float64), 1e-6)).reshape(1, 3, 1, 1)
    scale, shift = (1 / std).astype(np.float32), (mean / std).astype(np.float32)
    return lambda x: x.astype(np.float32) * scale - shift


def epoch_batches(images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int,
                  epoch: int, augment: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """The epoch's full batches, uint8, shuffled and (with ``augment``) randomly cropped
    from a 4-pixel zero padding and mirrored; the same for every run of an epoch."""
    rng = np.random.default_rng([seed, epoch])
    steps = len(images) // batch_size
    order = rng.permutation(len(images))[:steps * batch_size]
    offsets = rng.integers(0, 2 * PAD + 1, (len(order), 2))
    flips = rng.random(len(order)) < 0.5
    out = []
    for b, idx in enumerate(np.split(order, steps)):
        x, window = images[idx], slice(b * batch_size, (b + 1) * batch_size)
        if augment:
            padded = np.pad(x, ((0, 0), (0, 0), (PAD, PAD), (PAD, PAD)))
            x = np.stack([padded[i, :, dy:dy + 32, dx:dx + 32]
                          for i, (dy, dx) in enumerate(offsets[window])])
            mirror = flips[window]
            x[mirror] = x[mirror][..., ::-1]
        out.append((x, labels[idx]))
    return out


def _jsonable_stats(scaler: amp.GradScaler) -> dict[str, Any]:
    stats = dict(scaler.stats())
    stats["overflows"] = [o.get("line") for o in stats.get("overflows") or []]
    return stats


def train_runs(data: dict[str, Any], opts: Options) -> dict[str, Any]:
    """Trains the fp32 and the AMP run on ``data`` (``cifar_data.load``'s) in turn.

    Each epoch both runs train one pass over the same batches, each timed on its own
    clock, in an order that alternates; then both are evaluated on the held-out images
    (untimed) and their learning rates step.

    Returns:
        The result that ``examples.cifar_plot`` draws and that is saved as JSON: the
        options, the data, and per run (``runs["fp32"]``, ``runs["AMP"]``) ``losses``
        and ``times`` per step, ``accuracies``/``epoch_end_steps``/``epoch_times`` per
        epoch, ``samples_per_s``, ``peak_memory_bytes`` and ``step_memory_bytes`` (the
        peak above what was allocated when its turn began; None off a GPU) and the
        scaler's ``stats()``; ``throughput_ratio`` (AMP over fp32, per epoch).

    Raises:
        ValueError: options that cannot run (a batch larger than the training set,
            fewer than one epoch, ``channels_last`` where the backend has none or
            this CPU's oneDNN would hang in the backward).
    """
    fw = frameworks.get()
    if opts.channels_last and (why := channels_last_refusal(fw, opts.model, opts.width)):
        raise ValueError(why)
    n_train = len(data["train_x"])
    if not 1 <= opts.batch_size <= n_train:
        raise ValueError(f"batch size {opts.batch_size} must be between 1 and the"
                         f" {n_train} training images; pass a smaller --batch-size.")
    if opts.epochs < 1:
        raise ValueError(f"epochs must be at least 1; got {opts.epochs}.")
    normalise = normaliser(data["train_x"])
    test_x = normalise(data["test_x"])

    def to_input(x: np.ndarray) -> Any:
        t = fw.tensor(x)
        return fw.channels_last(t) if opts.channels_last else t

    modes = ("fp32", "AMP", "native") if opts.native else ("fp32", "AMP")
    runs = {mode: _make_run(fw, mode, opts) for mode in modes}
    names = list(runs)
    turn = len(names)
    steps_per_epoch = n_train // opts.batch_size
    bar = tqdm(total=opts.epochs * steps_per_epoch * len(runs), disable=not opts.progress,
               desc=f"{fw.name} {opts.model}", unit="step", leave=True)
    started, epochs_run, stopped = time.perf_counter(), 0, None
    memory_how = ""
    for epoch in range(opts.epochs):
        elapsed = time.perf_counter() - started
        if opts.time_budget is not None and epoch and \
                elapsed * (epoch + 1) / epoch > opts.time_budget:
            stopped = (f"after {epoch} of {opts.epochs} epochs: the next would end past the"
                       f" time budget of {opts.time_budget:g} s")
            break
        batches = epoch_batches(data["train_x"], data["train_y"], opts.batch_size,
                                opts.seed, epoch, opts.augment)
        for name in names[epoch % turn:] + names[:epoch % turn]:
            run = runs[name]
            fw.reset_peak_memory()
            resident, memory_how = fw.peak_memory()  # right after a reset: what is held now
            start = time.perf_counter()
            for x, y in batches:
                run.losses.append(run.step(to_input(normalise(x)), fw.labels(y)))
                run.times.append(run.clock + time.perf_counter() - start)
                bar.update()
            run.epoch_seconds.append(time.perf_counter() - start)
            run.clock += run.epoch_seconds[-1]
            peak, _ = fw.peak_memory()
            if peak is not None and resident is not None:
                run.peak_memory.append(peak)
                run.step_memory.append(peak - resident)
        for run in runs.values():
            run.scheduler.step()
            accuracy, run.compute_dtype = cnn_classifier.evaluate(
                fw, run.model, test_x, data["test_y"], run.precision, opts.eval_batch_size,
                to_input)
            run.accuracies.append(accuracy)
        epochs_run += 1
        bar.set_postfix({f"{n} acc": f"{100 * runs[n].accuracies[-1]:.1f}%" for n in names})
    bar.close()
    return _result(fw, data, opts, runs, epochs_run, steps_per_epoch, stopped, memory_how)


def _result(fw: Any, data: dict[str, Any], opts: Options, runs: dict[str, _Run],
            epochs_run: int, steps_per_epoch: int, stopped: str | None,
            memory_how: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, run in runs.items():
        timed = run.epoch_seconds[1:] or run.epoch_seconds
        out[name] = {
            "precision": run.label or run.compute_dtype, "compute_dtype": run.compute_dtype,
            "losses": run.losses, "times": run.times,
            "epoch_losses": [float(np.mean(run.losses[i:i + steps_per_epoch]))
                             for i in range(0, len(run.losses), steps_per_epoch)],
            "accuracies": run.accuracies, "accuracy": run.accuracies[-1],
            "epoch_end_steps": [steps_per_epoch * (e + 1) for e in range(epochs_run)],
            "epoch_times": list(np.cumsum(run.epoch_seconds)),
            "epoch_seconds": run.epoch_seconds,
            "samples_per_s": steps_per_epoch * opts.batch_size / float(np.median(timed)),
            "peak_memory_bytes": max(run.peak_memory, default=None),
            "step_memory_bytes": max(run.step_memory, default=None),
            "scaler": run.stats(),
            "data": {"train": len(data["train_x"]), "test": len(data["test_x"]),
                     "steps_per_epoch": steps_per_epoch},
        }
    backend = amp.get_backend().name
    native: dict[str, Any] = {}
    if "native" in runs:  # the same loop in the framework's own AMP: ratio, and same bytes?
        native = {"throughput_vs_native": cnn_classifier.throughput_ratio(out, "AMP", "native"),
                  "weights_identical_to_native": _same_bytes(fw, runs["AMP"].model,
                                                             runs["native"].model)}
    return {
        "backend": backend,
        "framework_version": importlib.metadata.version(
            {"torch": "torch", "megengine": "MegEngine"}[backend]),
        "device": fw.device_name(), "model": opts.model, "width": opts.width,
        "parameters": resnet.parameter_count(runs["fp32"].model),
        "batch_size": opts.batch_size, "epochs": opts.epochs, "epochs_run": epochs_run,
        "steps_per_epoch": steps_per_epoch, "stopped_early": stopped,
        "options": {k: v for k, v in vars(opts).items() if k != "progress"},
        "data": {"folder": data["folder"], "synthetic": data["synthetic"],
                 "train": len(data["train_x"]), "test": len(data["test_x"])},
        "memory_measured_by": memory_how,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": out,
        "throughput_ratio": cnn_classifier.throughput_ratio(out),
        "throughput_ratios": {name: cnn_classifier.throughput_ratio(out, name)
                              for name in out if name != "fp32"},
        **native,
    }


def _same_bytes(fw: Any, a: Any, b: Any) -> bool:
    """Whether two models' parameters are equal byte for byte."""
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(
        fw.numpy(x).tobytes() == fw.numpy(y).tobytes() for x, y in zip(pa, pb))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m examples.cifar",
                                description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None,
                   help=f"the {cifar_data.FOLDER} folder (or the one above it); default"
                        f" {DEFAULT_DATA}, or with --synthetic data/cifar-10-synthetic-N")
    p.add_argument("--synthetic", type=int, default=None, metavar="N",
                   help="write (or reuse) a synthetic folder of N training images and N/5"
                        " held out in CIFAR-10's layout, and train on it")
    p.add_argument("--model", choices=sorted(resnet.ARCHITECTURES), default=d.model)
    p.add_argument("--width", type=int, default=d.width,
                   help="channels of the first stage (64 in the paper)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--train-size", type=int, default=None,
                   help="train on the first N training images only (default: all)")
    p.add_argument("--test-size", type=int, default=None,
                   help="score the first N held-out images only (default: all)")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                   help="the AMP dtype (default: the device's: float16 on CUDA and on"
                        " MegEngine's CPU, bfloat16 on torch's CPU)")
    p.add_argument("--opt-level", choices=("O1", "O2"), default=None,
                   help="train with apex's API (amp.initialize + amp.scale_loss) at this"
                        " level; the fp32 run is O0")
    p.add_argument("--native", action="store_true",
                   help="a third run in the same turns: the framework's own AMP"
                        " (torch.autocast + torch.amp.GradScaler, or megengine.amp's)")
    p.add_argument("--no-contract", action="store_true",
                   help="amp.autocast(contract=False): the native autocast's dtypes, so that"
                        " the unified run can be compared with --native byte for byte")
    p.add_argument("--channels-last", action="store_true",
                   help="torch's channels-last memory format (model and inputs); an error"
                        " on MegEngine, which has none, and on a CPU without AVX-512 at"
                        " --width below 8, where oneDNN's backward hangs (docs/CIFAR.md)")
    p.add_argument("--no-augment", action="store_true", help="no random crops or mirroring")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no epoch that would end past this many seconds of training")
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=Path("cifar-output"),
                   help="folder for the JSON result and the PNG")
    p.add_argument("--plot", type=Path, nargs="+", default=None, metavar="JSON",
                   help="draw saved results (say, a torch run's and a MegEngine run's) as"
                        " rows of one PNG, and train nothing")
    p.add_argument("--png", type=Path, default=None,
                   help="where the PNG goes (default: next to the JSON in --out)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _fail(message: str) -> None:
    """Stops the command line with ``message`` and exit status 2 (argparse's)."""
    sys.stderr.write(f"python -m examples.cifar: error: {message}\n")
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    """Runs the experiment (or, with ``--plot``, draws saved results); returns the result
    (or the results drawn)."""
    args = parse_args(argv)
    if args.plot:
        try:
            results = cifar_plot.load(args.plot)
        except (OSError, ValueError) as e:
            _fail(str(e))
        png = args.png or args.out / "cifar-curves.png"
        for result in results:
            print(cifar_plot.headline(result))
        print(f"Curves: {cifar_plot.plot(results, png)}")
        return results
    try:
        if args.synthetic is not None:
            folder = args.data or Path("data") / f"cifar-10-synthetic-{args.synthetic}"
            cifar_data.write_synthetic(folder, args.synthetic)
        else:
            folder = args.data or DEFAULT_DATA
        data = cifar_data.load(folder, args.train_size, args.test_size)
    except (OSError, ValueError) as e:  # missing, damaged, or not to be overwritten
        _fail(str(e))
    # numpy's float limits before the framework: MegEngine turns on flush-to-zero when it
    # loads, and numpy's first np.finfo after that (matplotlib's) warns that subnormals
    # are zero. numpy keeps what it computed here.
    np.finfo(np.float64), np.finfo(np.float32)
    fw = frameworks.get()
    if args.channels_last and (why := channels_last_refusal(fw, args.model, args.width)):
        _fail(why)
    opts = Options(model=args.model, width=args.width, epochs=args.epochs,
                   batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                   dtype=args.dtype, opt_level=args.opt_level, native=args.native,
                   contract=not args.no_contract,
                   channels_last=args.channels_last, augment=not args.no_augment,
                   seed=args.seed, eval_batch_size=args.eval_batch_size,
                   time_budget=args.time_budget, progress=not args.no_progress)
    kind = "synthetic images in CIFAR-10's layout" if data["synthetic"] else "CIFAR-10"
    print(f"cifar on {fw.name} ({fw.device_name()}): {opts.model} (width {opts.width}) on"
          f" {kind} from {data['folder']}: {len(data['train_x'])} training images,"
          f" {len(data['test_x'])} held out; batch {opts.batch_size}, {opts.epochs} epochs")
    how = (f"amp.initialize(opt_level={opts.opt_level!r}) + amp.scale_loss; fp32 is O0"
           if opts.opt_level else f"amp.autocast(dtype={opts.dtype!r}) + amp.GradScaler()")
    turns = "fp32, AMP and the native AMP" if opts.native else "fp32 and AMP"
    print(f"AMP: {how}; {turns} train in turn, epoch by epoch")
    try:
        result = train_runs(data, opts)
    except ValueError as e:
        _fail(str(e))
    result["command"] = "python -m examples.cifar " + " ".join(
        sys.argv[1:] if argv is None else argv)
    print()
    for epoch, (a, b) in enumerate(zip(result["runs"]["fp32"]["accuracies"],
                                       result["runs"]["AMP"]["accuracies"]), 1):
        print(f"epoch {epoch:3d}: held-out accuracy fp32 {100 * a:5.1f}%, AMP {100 * b:5.1f}%")
    if result["stopped_early"]:
        print(f"Stopped {result['stopped_early']}.")
    print()
    print(cifar_plot.table(result))
    print()
    print(cnn_classifier.accuracy_verdict(result["runs"]))
    print(cnn_classifier.throughput_verdict(result["throughput_ratio"]))
    if opts.native:
        r = result["throughput_vs_native"]
        same = "identical" if result["weights_identical_to_native"] else "not identical"
        print(f"unified_amp trained at {r['median']:.3f}x the throughput of"
              f" {result['runs']['native']['precision']} (median of {r['n']} per-epoch"
              f" ratios; quartiles {r['q1']:.3f}-{r['q3']:.3f}); final weights {same}"
              f" byte for byte.")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['backend']}-{opts.model}" + (f"-{opts.opt_level}" if opts.opt_level else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    png = cifar_plot.plot([result], args.png or args.out / f"{stem}.png")
    print(f"Results: {args.out / stem}.json; curves: {png}")
    return result


if __name__ == "__main__":
    main()
