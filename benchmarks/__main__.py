"""The benchmark tool: ``python -m benchmarks <name> [--quick] [--sections a,b] [--out DIR]``.

Every named benchmark runs on the backend ``UNIFIED_AMP_BACKEND`` names, section by
section, and writes one result per section in the one format (``results_format``) under
``benchmarks/results/``; ``python -m benchmarks report`` writes docs/BENCHMARKS.md's
tables from the latest results. Arguments the tool does not know go to each section's
own script (``--rounds 21``, ``--threads 2``, ...); ``python -m benchmarks`` lists the
benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import results_format

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Section:
    """One part of a benchmark: a script of this package (or the CIFAR example) run with
    these arguments, on these backends."""

    module: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)  # with --quick
    full_args: tuple[str, ...] = ()  # without it
    backends: tuple[str, ...] = ("torch", "megengine")
    needs: tuple[str, ...] = ()  # packages beyond the backend's test environment


@dataclass(frozen=True)
class Benchmark:
    about: str
    sections: dict[str, Section] = field(default_factory=dict)


CIFAR_QUICK = ("--synthetic", "40", "--train-size", "24", "--test-size", "10",
               "--model", "resnet18", "--width", "8", "--batch-size", "8", "--epochs", "2",
               "--eval-batch-size", "10")
BENCHMARKS: dict[str, Benchmark] = {
    "throughput": Benchmark(
        "training throughput and peak memory in float32, float16 and bfloat16, and apex's"
        " O0-O3 (a conv net and a transformer block)", {
            "precisions": Section("benchmarks.bench", ("--sections", "throughput")),
            "opt-levels": Section("benchmarks.bench", ("--sections", "opt-levels"))}),
    "overhead": Benchmark(
        "unified_amp's step against the framework's own AMP step, as ratios measured in"
        " the same rounds (the one place for the layer's cost)", {
            "step": Section("benchmarks.defaults_cost"),
            "workloads": Section("benchmarks.bench", ("--sections", "overhead")),
            "host": Section("benchmarks.host_cost"),
            "parts": Section("benchmarks.host_cost_parts"),
            "mode": Section("benchmarks.mode_cost", backends=("torch",)),
            # last: it registers a function (and unregisters it) in this process
            "pinning": Section("benchmarks.pinning")}),
    "compile": Benchmark(
        "eager vs torch.compile, unified_amp vs torch.amp (torch only)",
        {"compile": Section("benchmarks.compile", backends=("torch",))}),
    "trace": Benchmark(
        "eager vs megengine.jit.trace, unified_amp vs megengine.amp (MegEngine only)",
        {"trace": Section("benchmarks.trace_megengine", backends=("megengine",))}),
    "real-models": Benchmark(
        "torchvision's ResNet-50 and transformers' GPT-2, unified_amp vs torch.amp (torch;"
        " runs in .venv-integrations-models)",
        {"models": Section("benchmarks.real_models", backends=("torch",),
                           needs=("torchvision", "transformers"))}),
    "cifar": Benchmark(
        "the CIFAR ResNet trained in turns in fp32, with unified_amp and with the"
        " framework's own AMP (examples/cifar.py --native; synthetic data)",
        {"native": Section("examples.cifar", ("--native", "--no-progress"),
                           full_args=("--synthetic", "960", "--model", "resnet18", "--width",
                                      "8", "--batch-size", "32", "--epochs", "3"),
                           quick_args=CIFAR_QUICK)}),
}


class BenchmarkError(ValueError):
    """A benchmark or section that does not exist, or cannot run here (says why)."""


def listing() -> str:
    lines = ["benchmarks (python -m benchmarks <name> [--quick] [--sections a,b]):"]
    for name, b in BENCHMARKS.items():
        lines.append(f"  {name:<12} {b.about}")
        lines.append(f"  {'':<12} sections: {', '.join(b.sections)}")
    lines.append(f"  {'report':<12} write docs/BENCHMARKS.md's tables from the latest results")
    return "\n".join(lines)


def sections_of(name: str, sections: str | None) -> list[str]:
    """The sections of ``name`` asked for (all by default), checked before any framework
    is imported.

    Raises:
        BenchmarkError: an unknown benchmark or section.
    """
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; the benchmarks are: "
                             f"{', '.join([*BENCHMARKS, 'report'])}")
    known = BENCHMARKS[name].sections
    wanted = [s.strip() for s in sections.split(",")] if sections else list(known)
    for s in wanted:
        if s not in known:
            raise BenchmarkError(f"benchmark {name!r} has no section {s!r}; its sections"
                                 f" are: {', '.join(known)}")
    return wanted


def plan(name: str, wanted: list[str], backend: str) -> list[tuple[str, Section]]:
    """The sections of ``name`` in ``wanted`` that run on ``backend``.

    Raises:
        BenchmarkError: none of them runs on this backend, or a package one needs is
            missing.
    """
    known = BENCHMARKS[name].sections
    chosen = [(s, known[s]) for s in wanted if backend in known[s].backends]
    if not chosen:
        runs_on = sorted({b for s in wanted for b in known[s].backends})
        raise BenchmarkError(f"benchmark {name!r} does not run on {backend!r} (it runs on"
                             f" {', '.join(runs_on)}); set UNIFIED_AMP_BACKEND="
                             f"{runs_on[0]}.")
    for s, section in chosen:
        for package in section.needs:
            if importlib.util.find_spec(package) is None:
                raise BenchmarkError(f"benchmark {name!r} needs {package!r}, which this"
                                     f" environment lacks; run it in"
                                     f" .venv-integrations-models (make test-integrations"
                                     f" builds it).")
    return chosen


def run_section(name: str, section_name: str, section: Section, quick: bool,
                extra: list[str], out: Path, backend: str, command: str) -> Path:
    """Runs one section's script into a scratch folder and saves its figures as a result."""
    with tempfile.TemporaryDirectory() as scratch:
        argv = [*(section.quick_args if quick else section.full_args), *section.args, *extra,
                "--out", scratch]
        if section.module == "examples.cifar" and "--data" not in extra:
            argv += ["--data", str(Path(scratch) / "synthetic")]
        status = importlib.import_module(section.module).main(argv)
        if isinstance(status, int) and status:
            raise SystemExit(status)
        found = {p.stem: p for p in sorted(Path(scratch).glob("*.json"))}
        if not found:
            raise RuntimeError(f"{section.module} wrote no JSON result")
        # The scripts record where they wrote (their --out, a scratch folder here): say
        # where the result went instead, so no path of this machine is saved.
        shown = os.path.relpath(out, ROOT) if out.resolve().is_relative_to(ROOT) else "<out>"
        raws = {stem: json.loads(_replace(p.read_text(), scratch, shown))
                for stem, p in found.items()}
        raw = next(iter(raws.values())) if len(raws) == 1 else raws
        device = _device(raw)
        result = results_format.record(name, section_name, backend, device, command, quick,
                                       raw)
        path = results_format.write(result, out)
        for png in Path(scratch).glob("*.png"):  # the section's plot, beside its result
            shutil.copy(png, path.with_suffix(".png") if len(found) == 1
                        else path.with_name(f"{path.stem}-{png.stem}.png"))
    return path


def _replace(text: str, scratch: str, shown: str) -> str:
    for folder in {str(Path(scratch).resolve()), scratch}:
        text = text.replace(json.dumps(folder)[1:-1], shown)
    return text


def _device(raw: dict) -> str:
    for source in (raw, raw.get("config", {}), raw.get("machine", {})):
        device = source.get("device") if isinstance(source, dict) else None
        if isinstance(device, str):
            return "cuda" if "cuda" in device.lower() or "nvidia" in device.lower() else "cpu"
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.strip().splitlines()[0])
        print(listing())
        return 0
    if argv[0] == "report":
        from . import tables
        return tables.main(argv[1:])
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {argv[0]}")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--sections", default=None, help="comma-separated; default: all")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"default {RESULTS}")
    args, extra = p.parse_known_args(argv[1:])
    try:
        wanted = sections_of(argv[0], args.sections)
        import unified_amp as amp

        backend = amp.get_backend().name
        chosen = plan(argv[0], wanted, backend)
    except BenchmarkError as e:
        print(f"python -m benchmarks: error: {e}\n\n{listing()}", file=sys.stderr)
        return 2
    command = "python -m benchmarks " + " ".join(argv)
    for section_name, section in chosen:
        print(f"== {argv[0]} / {section_name} ({section.module}) on {backend}", flush=True)
        path = run_section(argv[0], section_name, section, args.quick, extra, args.out,
                           backend, command)
        print(f"== result: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
