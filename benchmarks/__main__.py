"""The benchmark tool: ``python -m benchmarks <name> [--quick] [--sections a,b] [options]``.

Every named benchmark runs on the backend ``UNIFIED_AMP_BACKEND`` names, section by
section, and writes one result per section in the one format (``results_format``) under
``benchmarks/results/``; ``python -m benchmarks report`` writes docs/BENCHMARKS.md's
tables from the latest results. One argument parser serves every section: a name, a
section or an option it does not know, or an option none of the chosen sections takes,
stops it with exit status 2 before any framework is imported.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import report, results_format

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BOTH = ("torch", "megengine")
TIMED = ("rounds", "steps", "warmup")


@dataclass(frozen=True)
class Section:
    """One part of a benchmark: ``function`` ("module:function") takes a ``Run`` and
    returns the section's figures; ``takes`` names the options it reads beyond
    ``--quick``, ``--out`` and ``--threads``."""

    function: str
    about: str
    takes: tuple[str, ...] = TIMED
    backends: tuple[str, ...] = BOTH
    needs: tuple[str, ...] = ()  # packages beyond the backend's test environment


@dataclass(frozen=True)
class Benchmark:
    about: str
    sections: dict[str, Section] = field(default_factory=dict)


WORKLOAD_OPTIONS = (*TIMED, "device", "workloads", "seed")
TORCH, MEGENGINE = ("torch",), ("megengine",)
BENCHMARKS: dict[str, Benchmark] = {
    "throughput": Benchmark("AMP against fp32: training throughput and peak memory", {
        "precisions": Section("benchmarks.throughput:precisions",
                              "float32, float16 and bfloat16 steps",
                              (*WORKLOAD_OPTIONS, "tf32")),
        "opt-levels": Section("benchmarks.throughput:opt_levels",
                              "apex's O0-O3: step time and bytes stored", WORKLOAD_OPTIONS)}),
    "overhead": Benchmark("unified_amp against the framework's own AMP: the layer's cost", {
        "eager": Section("benchmarks.overhead:eager",
                         "the eager step with each autocast beside the native's",
                         WORKLOAD_OPTIONS),
        "step": Section("benchmarks.overhead:step",
                        "the launch-bound MLP step, one piece swapped at a time",
                        (*TIMED, "device", "seed")),
        "rules": Section("benchmarks.overhead:rules",
                         "the MLP step in a block with rules beside one without",
                         (*TIMED, "device", "seed")),
        "host": Section("benchmarks.host:host",
                        "the scaler's host time by parameter-tensor count",
                        (*TIMED, "tensors")),
        "mode": Section("benchmarks.overhead:mode", "the dtype contract's cost per torch call",
                        backends=TORCH),
        "forensics": Section("benchmarks.overhead:forensics", "forward tracing on and off",
                             WORKLOAD_OPTIONS),
        # last: it registers a function with the cast registry for the rest of the process
        "pinning": Section("benchmarks.overhead:pinning",
                           "amp.keep_float32 against a pin by hand")}),
    "compile": Benchmark("eager against torch.compile", {
        "compile": Section("benchmarks.compile:forward",
                           "the forward compiled, each side eager and compiled",
                           WORKLOAD_OPTIONS, backends=TORCH),
        "whole-step": Section("benchmarks.compile:whole_step", "the whole step compiled",
                              WORKLOAD_OPTIONS, backends=TORCH)}),
    "trace": Benchmark("eager against megengine.jit.trace", {
        "trace": Section("benchmarks.trace:trace", "the forward traced; the whole step traced",
                         (*TIMED, "workloads", "seed", "symbolic"), backends=MEGENGINE)}),
    "real-models": Benchmark("ResNet-50 and GPT-2 (in .venv-integrations-models)", {
        "models": Section("benchmarks.real_models:models", "unified_amp against torch.amp",
                          (*TIMED, "device", "models"), backends=TORCH,
                          needs=("torchvision", "transformers"))}),
    "cifar": Benchmark("the CIFAR ResNet in turns: fp32, unified_amp, the native AMP", {
        "native": Section("benchmarks.__main__:cifar",
                          "examples/cifar.py --native on synthetic data", ("seed",))}),
}
REPORT_OPTIONS = ("results", "doc", "check")


class BenchmarkError(ValueError):
    """A benchmark, section or option that does not exist or does not apply (says why)."""


def parser() -> argparse.ArgumentParser:
    """The one parser of the tool. Section options default to None: given or not."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.strip().splitlines()[0],
        epilog=listing(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="a benchmark, or report")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: a smoke run")
    p.add_argument("--sections", help="comma-separated; default: all of the benchmark's")
    p.add_argument("--out", type=Path, help="default benchmarks/results")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default 1: a shared"
                   " machine; 0 keeps torch's default)")
    g = p.add_argument_group("what the sections take (each says which)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="default auto: CUDA where the framework sees a GPU")
    g.add_argument("--rounds", type=int, help="interleaved rounds")
    g.add_argument("--steps", type=int, help="steps per variant per round")
    g.add_argument("--warmup", type=int, help="untimed steps per variant first")
    g.add_argument("--workloads", help="comma-separated subset of convnet,transformer")
    g.add_argument("--seed", type=int)
    g.add_argument("--tf32", choices=("off", "on", "both"),
                   help="TF32 for float32 matmuls and convolutions (torch on CUDA)")
    g.add_argument("--tensors", help="comma-separated parameter-tensor counts")
    g.add_argument("--models", help="comma-separated subset of resnet50,gpt2")
    g.add_argument("--symbolic", type=int, choices=(0, 1), help="trace(symbolic=...)")
    g = p.add_argument_group("report")
    g.add_argument("--results", type=Path, help="default benchmarks/results")
    g.add_argument("--doc", type=Path, help="default docs/BENCHMARKS.md")
    g.add_argument("--check", action="store_true", default=None,
                   help="write nothing; exit 1 if the page's tables are out of date")
    return p


def listing() -> str:
    lines = ["benchmarks (python -m benchmarks <name> [--quick] [--sections a,b]):"]
    for name, b in BENCHMARKS.items():
        lines.append(f"  {name:<12} {b.about}")
        for s, section in b.sections.items():
            only = "" if section.backends == BOTH else f" ({', '.join(section.backends)})"
            lines.append(f"  {'':<12}   {s + ':':<11} {section.about}{only}")
    lines.append(f"  {'report':<12} docs/BENCHMARKS.md's tables from the latest results"
                 " (--results, --doc, --check)")
    return "\n".join(lines)


def _given(opts: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(opts, n) is not None]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _section_options(opts: argparse.Namespace) -> tuple[str, ...]:
    return tuple(a for a in vars(opts) if a not in
                 ("name", "quick", "sections", "out", "threads", *REPORT_OPTIONS))


def choose(opts: argparse.Namespace) -> list[str]:
    """The sections of ``opts.name`` to run, in the benchmark's order, after checking the
    name, the sections and that each option given applies to one of them (no framework
    is imported here).

    Raises:
        BenchmarkError: an unknown benchmark or section, or an option that none of the
            chosen sections takes.
    """
    section_options = _section_options(opts)
    if opts.name is None:
        raise BenchmarkError("name a benchmark (or report) before its options")
    if opts.name == "report":
        stray = _given(opts, section_options) + (["quick"] if opts.quick else []) + \
            _given(opts, ("sections", "threads", "out"))
        if stray:
            raise BenchmarkError(f"report takes --results, --doc and --check, not "
                                 f"{', '.join(map(_flag, stray))}")
        return []
    if opts.name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {opts.name!r}; the benchmarks are: "
                             f"{', '.join([*BENCHMARKS, 'report'])}")
    if _given(opts, REPORT_OPTIONS):
        raise BenchmarkError(f"{', '.join(map(_flag, _given(opts, REPORT_OPTIONS)))}:"
                             " options of python -m benchmarks report")
    known = BENCHMARKS[opts.name].sections
    wanted = [s.strip() for s in opts.sections.split(",")] if opts.sections else list(known)
    for s in wanted:
        if s not in known:
            raise BenchmarkError(f"benchmark {opts.name!r} has no section {s!r}; its"
                                 f" sections are: {', '.join(known)}")
    chosen = [s for s in known if s in wanted]
    for option in _given(opts, section_options):
        if not any(option in known[s].takes for s in chosen):
            takers = [f"{b}/{s}" for b, bench in BENCHMARKS.items()
                      for s, sec in bench.sections.items() if option in sec.takes]
            raise BenchmarkError(f"{_flag(option)} does not apply to {opts.name}"
                                 f" ({', '.join(chosen)}); it applies to: {', '.join(takers)}")
    for option, allowed in (("workloads", ("convnet", "transformer")),
                            ("models", ("resnet50", "gpt2"))):
        value = getattr(opts, option)
        if value is not None and (not value.split(",") or
                                  set(value.split(",")) - set(allowed)):
            raise BenchmarkError(f"{_flag(option)} takes a comma-separated subset of"
                                 f" {','.join(allowed)}; got {value!r}")
    if opts.tensors is not None and not all(t.isdigit() and int(t) > 0
                                            for t in opts.tensors.split(",")):
        raise BenchmarkError(f"--tensors takes positive counts, e.g. 10,100; got"
                             f" {opts.tensors!r}")
    for option in ("rounds", "steps", "threads", "warmup"):
        value, least = getattr(opts, option), 0 if option in ("threads", "warmup") else 1
        if value is not None and value < least:
            raise BenchmarkError(f"{_flag(option)} must be >= {least}; got {value}")
    return chosen


def plan(name: str, chosen: list[str], backend: str) -> list[str]:
    """The sections of ``chosen`` that run on ``backend``.

    Raises:
        BenchmarkError: none of them runs on this backend, or a package one needs is
            missing.
    """
    known = BENCHMARKS[name].sections
    here = [s for s in chosen if backend in known[s].backends]
    if not here:
        runs_on = sorted({b for s in chosen for b in known[s].backends})
        raise BenchmarkError(f"benchmark {name!r} does not run on {backend!r} (it runs on"
                             f" {', '.join(runs_on)}); set UNIFIED_AMP_BACKEND="
                             f"{runs_on[0]}.")
    for s in here:
        for package in known[s].needs:
            if importlib.util.find_spec(package) is None:
                raise BenchmarkError(f"benchmark {name!r} needs {package!r}, which this"
                                     f" environment lacks; run it in"
                                     f" .venv-integrations-models (make test-integrations"
                                     f" builds it).")
    return here


class Run:
    """What a section gets: the options, the backend, the framework kit (made on first
    use, on ``--device``), and where its result goes."""

    def __init__(self, opts: argparse.Namespace, backend: str, benchmark: str,
                 section: str) -> None:
        self.opts, self.backend, self.quick = opts, backend, opts.quick
        self.benchmark, self.section = benchmark, section
        self.device = "cpu"  # a section that makes a kit runs on the kit's device
        self.device_name: str | None = None

    @functools.cached_property
    def kit(self) -> Any:
        kit = importlib.import_module(f".{self.backend}_kit", __package__).Kit(
            self.opts.device or "auto")
        self.device = kit.device
        if kit.device == "cuda":
            self.device_name = kit.info().get("device_name")
        return kit

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full"

    def schedule(self, full: dict[str, int], quick: dict[str, int],
                 cuda: dict[str, int] | None = None) -> dict[str, int]:
        """The section's rounds, steps and warm-up: its defaults for this mode and
        device, with those the command line gives."""
        sched = dict(quick if self.quick else cuda if cuda and self.device == "cuda"
                     else full)
        sched.update({k: getattr(self.opts, k) for k in TIMED if getattr(self.opts, k)
                      is not None})
        return sched

    def workloads(self) -> list[str]:
        return (self.opts.workloads or "convnet,transformer").split(",")

    def path(self, suffix: str) -> Path:
        """Where the result (``.json``) or its plot (``.png``) goes."""
        stem = f"{self.benchmark}-{self.section}-{self.backend}-{self.device}"
        return self.opts.out / (stem + ("-quick" if self.quick else "") + suffix)


def cifar(run: Run) -> dict[str, Any]:
    """The cifar benchmark's one section: examples/cifar.py --native on synthetic data,
    with its curves beside the result."""
    from examples import cifar as example
    from examples import frameworks

    run.device = frameworks.get().device
    sizes = (["--synthetic", "40", "--train-size", "24", "--test-size", "10", "--model",
              "resnet18", "--width", "8", "--batch-size", "8", "--epochs", "2",
              "--eval-batch-size", "10"] if run.quick else
             ["--synthetic", "960", "--model", "resnet18", "--width", "8", "--batch-size",
              "32", "--epochs", "3"])
    seed = [] if run.opts.seed is None else ["--seed", str(run.opts.seed)]
    run.opts.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        result = example.main([*sizes, *seed, "--native", "--no-progress", "--out", scratch,
                               "--data", str(Path(scratch) / "synthetic"),
                               "--png", str(run.path(".png"))])
        text = json.dumps(result)
    # no path of this machine is saved: the data's scratch folder, the plot's folder
    out = run.opts.out.resolve()
    shown = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else "<out>"
    for folder, name in ((scratch, "<scratch>"), (str(out), shown),
                         (str(run.opts.out), shown)):
        text = text.replace(json.dumps(folder)[1:-1], name)
    return json.loads(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv == ["list"]:
        print(__doc__.strip().splitlines()[0])
        print(listing())
        return 0
    opts = parser().parse_args(argv)  # an unknown option: exit status 2, named
    try:
        chosen = choose(opts)
        if opts.name == "report":
            return report.main(opts.results, opts.doc, bool(opts.check))
        import unified_amp as amp

        backend = amp.get_backend().name
        chosen = plan(opts.name, chosen, backend)
    except BenchmarkError as e:
        print(f"python -m benchmarks: error: {e}\n\n{listing()}", file=sys.stderr)
        return 2
    opts.out = opts.out or RESULTS
    threads = 1  # MegEngine's default CPU comp node runs one thread
    if backend == "torch":
        import torch

        if opts.threads != 0:  # one by default: a shared machine (docs/BENCHMARKS.md)
            torch.set_num_threads(opts.threads or 1)
        threads = torch.get_num_threads()
    command = "python -m benchmarks " + " ".join(argv)
    sections = BENCHMARKS[opts.name].sections
    for name in chosen:
        section = sections[name]
        print(f"== {opts.name} / {name} on {backend}: {section.about}", flush=True)
        for option in _given(opts, _section_options(opts)):
            if option not in section.takes:
                print(f"   ({_flag(option)} does not apply to this section)")
        run = Run(opts, backend, opts.name, name)
        module, function = section.function.split(":")
        here = module == "benchmarks.__main__"  # this module, however it was started
        raw = getattr(sys.modules[__name__] if here else importlib.import_module(module),
                      function)(run)
        result = results_format.record(opts.name, name, backend, run.device, command,
                                       opts.quick, raw, run.device_name)
        result["machine"]["threads"] = threads
        path = results_format.write(result, opts.out)
        print(report.text(result))
        print(f"== result: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
