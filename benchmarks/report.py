"""``python -m benchmarks report [--results DIR] [--doc PATH] [--check]``: docs/BENCHMARKS.md's
tables, written from the latest full (not --quick) result of each benchmark, section,
backend and device, between the page's generated-table markers; the prose around them
stays as it is. ``--check`` writes nothing and fails when the page is out of date.

A table shows the rows a user decides by (``SHOWN``: which rows, and their labels), one
column per backend and device; the JSON keeps every figure.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from . import results_format

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- generated tables: python -m benchmarks report (edits here are overwritten) -->"
END = "<!-- end of generated tables -->"
W = r"([\w.-]+)"
# (benchmark, section) -> (what it shows, [(row-name pattern, label)]), in the page's order.
SHOWN: dict[tuple[str, str], tuple[str, list[tuple[str, str]]]] = {
    ("throughput", "precisions"): ("AMP against fp32: speed-up of the step, median of"
                                   " per-round ratios", [
        (rf"workloads / {W} / throughput / 0 / variants / (float16|bfloat16)"
         r" / speedup_vs_fp32", r"\1, \2"),
        (rf"workloads / {W} / throughput / 0 / variants / (float16|bfloat16)"
         r" / peak_memory_vs_fp32", r"\1, \2: peak memory vs fp32")]),
    ("overhead", "eager"): ("the eager step against the native AMP step (time per step as"
                            " a ratio to the native's; calls per forward: exact)", [
        (rf"workloads / {W} / ratios / (.+)", r"\1: \2"),
        (rf"workloads / {W} / torch_calls_per_forward", r"\1: torch calls per forward"),
        (rf"workloads / {W} / variants / (.+) / unified_amp_calls_per_forward",
         r"\1: Python calls into unified_amp per forward, \2")]),
    ("overhead", "step"): ("the launch-bound MLP step with one piece swapped in at a time,"
                           " ratio to the native step", [
        (r"mlp / ratios / (.+)", r"\1"),
        (r"mode_floor / ratios / (.+)", r"a run of its own: \1")]),
    ("overhead", "rules"): ("the launch-bound MLP step in a block with rules beside the"
                            " same block without, ratio to the native step", [
        (r"mlp / ratios / (.+)", r"\1")]),
    ("overhead", "mode"): ("the contract's cost per torch call (an 8x8 linear, relu and add)", [
        (r"ratio_to_torch_autocast / (?!torch\.autocast$)(.+)",
         r"\1: time per call / torch.autocast's"),
        (r"extra_us_per_call / (?!torch\.autocast$)(.+)", r"\1: µs added per call")]),
    ("overhead", "forensics"): ("overflow forensics: the unified step with forward tracing"
                                " on and off, ratio to the step without forensics", [
        (rf"workloads / {W} / ratios / (.+)", r"\1: \2")]),
    ("overhead", "host"): ("the scaler's host time by parameter-tensor count, unified /"
                           " native, beside the control", [
        (rf"loops / {W} / (\d+) / ratio", r"\1, \2 tensors: unified / native"),
        (rf"loops / {W} / (\d+) / control_ratio", r"\1, \2 tensors: control / native")]),
    ("overhead", "pinning"): ("amp.keep_float32 against the same layer pinned by hand", [
        (r"ratios / (.+)", r"\1")]),
    ("throughput", "opt-levels"): ("apex's opt levels, ratios to O0", [
        (rf"workloads / {W} / opt_levels / levels / (O\d) / (bytes_vs_O0|step_time_vs_O0)",
         r"\1, \2: \3")]),
    ("compile", "compile"): ("eager and compiled (the forward and its block), unified_amp"
                             " / torch.amp per round", [
        (rf"workloads / {W} / ratios / (.+)", r"\1: \2")]),
    ("compile", "whole-step"): ("the whole step compiled, ratio to torch.amp's", [
        (rf"whole_step_compiled / {W} / ratios / (.+) / native", r"\1: \2")]),
    ("trace", "trace"): ("megengine.jit.trace: process CPU time per step, ratios per round", [
        (rf"workloads / {W} / ratios_cpu / (.+)", r"\1: \2")]),
    ("real-models", "models"): ("real models: step time / torch.amp's", [
        (rf"models / {W} / ratio_to_native / (.+)", r"\1: \2")]),
    ("cifar", "native"): ("the CIFAR ResNet in turns (synthetic data)", [
        (r"runs / (\w+) / (accuracy|samples_per_s)", r"\1: \2"),
        (r"throughput_vs_native", r"AMP throughput / the native AMP's"),
        (r"weights_identical_to_native", r"final weights identical to the native AMP's")]),
}
# What the page shows: the sections whose figures decide something (the others' results
# stay in benchmarks/results/, and `python -m benchmarks` prints them).
ON_THE_PAGE = [("throughput", "precisions"), ("overhead", "eager"), ("overhead", "step"),
               ("overhead", "rules"), ("overhead", "mode"), ("overhead", "forensics"), ("compile", "compile"),
               ("compile", "whole-step"), ("trace", "trace"), ("real-models", "models"),
               ("cifar", "native")]


def shown(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, row) for each row of ``result`` its section shows, in the result's order,
    labelled by the first pattern that matches the row's whole name."""
    patterns = SHOWN.get((result["benchmark"], result["section"]), ("", []))[1]
    out = []
    for row in result["rows"]:
        for pattern, label in patterns:
            if re.fullmatch(pattern, row["name"]):
                out.append((re.sub(f"^{pattern}$", label, row["name"]), row))
                break
    return out


def latest(folder: Path) -> list[dict[str, Any]]:
    """The newest full result per (benchmark, section, backend, device), each with the
    file it came from (``path``)."""
    best: dict[tuple[str, ...], dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        r = results_format.load(path)
        if r is None or r["quick"]:
            continue
        r["path"] = path
        key = (r["benchmark"], r["section"], r["backend"], r["device"])
        if key not in best or r["date"] > best[key]["date"]:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["backend"] != "torch", r["device"]))


def number(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return "n/a"


def cell(row: dict[str, Any]) -> str:
    if "median" not in row:
        return number(row["value"])
    quartiles = f" [{number(row['q1'])}–{number(row['q3'])}]" if "q1" in row else ""
    return number(row["median"]) + quartiles


def _who(result: dict[str, Any]) -> str:
    return (f"{results_format.FRAMEWORKS.get(result['backend'], result['backend'])}"
            f" {result['versions'].get(result['backend'], '?')}, {result['device']}")


def _conditions(result: dict[str, Any], rows: list[dict[str, Any]], doc: Path) -> str:
    v, machine = result["versions"], result.get("machine", {})
    known = [f"unified_amp {v.get('unified_amp')}"]
    if v.get("python", "unknown") != "unknown":
        known.append(f"CPython {v['python']}")
    where = machine.get("device_name") or machine.get("cpu")
    if where and where != "unknown":
        known.append(where)
    if machine.get("load_average"):
        cpus = f" on {machine['cpus']} CPUs" if machine.get("cpus") else ""
        known.append(f"load average {machine['load_average'][0]}{cpus}")
    ns = sorted({r["n"] for r in rows if "n" in r})
    if ns:
        known.append(f"n = {ns[0]}" + (f"–{ns[-1]}" if len(ns) > 1 else "") + " rounds")
    link = f"[{result['path'].name}]({os.path.relpath(result['path'], doc.parent)})"
    if re.search(r"-m benchmarks(\s|$)", result["command"]) and "converted" not in \
            result["command"]:
        how = f"`{result['command']}` on {result['date'][:10]} ({', '.join(known)}): {link}"
    else:  # run by a script the tool replaced: its command names a file that is gone
        how = (f"a run of {result['date'][:10]} by a script the tool replaced ("
               f"{', '.join(known)}; its command: {link})")
    return f"- {_who(result)}: {how}"


def table(results: list[dict[str, Any]], doc: Path) -> str:
    """One section's results as one markdown table, a column per backend and device,
    with each result's command and conditions below it."""
    about = SHOWN[(results[0]["benchmark"], results[0]["section"])][0]
    columns = [dict(shown(r)) for r in results]
    labels = list(dict.fromkeys(label for c in columns for label in c))
    lines = [f"### {results[0]['benchmark']} / {results[0]['section']}: {about}", "",
             "| | " + " | ".join(_who(r) for r in results) + " |",
             "|---|" + "---|" * len(results)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(cell(c[label]) if label in c else ""
                                                   for c in columns) + " |")
    lines.append("")
    lines += [_conditions(r, list(c.values()), doc) for r, c in zip(results, columns)]
    return "\n".join(lines)


def render(results: list[dict[str, Any]], doc: Path) -> str:
    by_section: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        if (r["benchmark"], r["section"]) in ON_THE_PAGE and shown(r):
            by_section.setdefault((r["benchmark"], r["section"]), []).append(r)
    if not by_section:
        return "No full results yet: run `python -m benchmarks <name>`."
    return "\n\n".join(table(by_section[key], doc) for key in ON_THE_PAGE
                       if key in by_section)


def text(result: dict[str, Any]) -> str:
    """What a run prints: the section's shown rows (all of them where it names none)."""
    rows = shown(result) or [(r["name"], r) for r in result["rows"]]
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"  {label:<{width}}  {cell(row)}" for label, row in rows)


def rewrite(text: str, generated: str, doc: Path) -> str:
    """``text`` with what lies between the markers replaced by ``generated``.

    Raises:
        ValueError: the page lacks the markers (or has them out of order).
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{doc} has no generated-table markers; put the lines {BEGIN!r}"
                         f" and {END!r} where the tables go.")
    return text[:start + len(BEGIN)] + "\n\n" + generated + "\n\n" + text[end:]


def main(results: Path | None, doc: Path | None, check: bool) -> int:
    results = results or ROOT / "benchmarks" / "results"
    doc = doc or ROOT / "docs" / "BENCHMARKS.md"
    old = doc.read_text()
    try:
        new = rewrite(old, render(latest(results), doc), doc)
    except ValueError as e:
        print(f"python -m benchmarks report: error: {e}", file=sys.stderr)
        return 2
    if check:
        if new != old:
            print(f"{doc}'s tables are out of date: run python -m benchmarks report",
                  file=sys.stderr)
            return 1
        return 0
    doc.write_text(new)
    print(f"wrote the tables of {len(latest(results))} results into {doc}")
    return 0
