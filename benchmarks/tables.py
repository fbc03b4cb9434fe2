"""``python -m benchmarks report [--results DIR] [--doc PATH] [--check]``: docs/BENCHMARKS.md's
tables, written from the latest full (not --quick) result of each benchmark, section,
backend and device, between the page's generated-table markers; the prose around them
stays as it is. ``--check`` writes nothing and fails when the page is out of date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import results_format

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- generated tables: python -m benchmarks report (edits here are overwritten) -->"
END = "<!-- end of generated tables -->"
# The rows a benchmark's table shows (its JSON keeps all of them): names containing one
# of these words; everything else (per-variant step times, ...) stays in the JSON.
SHOWN = {"throughput": ("samples_per_s", "bytes_vs_O0", "peak_memory", "ratio"),
         "overhead": ("ratio", "share", "us_per_call"), "compile": ("ratio",),
         "trace": ("ratio",), "real-models": ("ratio",),
         "cifar": ("throughput", "samples_per_s", "accuracy", "weights")}


def latest(folder: Path) -> list[dict[str, Any]]:
    """The newest full result per (benchmark, section, backend, device), in name order."""
    best: dict[tuple[str, ...], dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        r = results_format.load(path)
        if r is None or r["quick"]:
            continue
        key = (r["benchmark"], r["section"], r["backend"], r["device"])
        if key not in best or r["date"] > best[key]["date"]:
            best[key] = r
    order = list(SHOWN)
    return sorted(best.values(), key=lambda r: (order.index(r["benchmark"])
                                                if r["benchmark"] in order else len(order),
                                                r["section"], r["backend"], r["device"]))


def _number(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return "n/a"


def table(result: dict[str, Any]) -> str:
    """One result as a markdown table with the command and conditions above it."""
    words = SHOWN.get(result["benchmark"], ())
    shown = [r for r in result["rows"] if not words or any(w in r["name"] for w in words)]
    v, machine = result["versions"], result.get("machine", {})
    known = [f"unified_amp {v.get('unified_amp')}"]
    if v.get("python", "unknown") != "unknown":
        known.append(f"CPython {v['python']}")
    if machine.get("load_average"):
        cpus = f" on {machine['cpus']} CPUs" if machine.get("cpus") else ""
        known.append(f"load average {machine['load_average'][0]}{cpus}")
    head = (f"### {result['benchmark']} / {result['section']}: {result['backend']}"
            f" {v.get(result['backend'], '?')}, {result['device']}\n\n"
            f"`{result['command']}` on {result['date'][:10]} ({', '.join(known)})."
            f" Median of per-round figures, quartiles, rounds.\n\n")
    lines = ["| figure | median | quartiles | n |", "|---|---|---|---|"]
    for r in shown:
        if "median" in r:
            quart = (f"{_number(r['q1'])}-{_number(r['q3'])}" if "q1" in r else "")
            lines.append(f"| {r['name']} | {_number(r['median'])} | {quart} |"
                         f" {r.get('n', '')} |")
        else:
            lines.append(f"| {r['name']} | {_number(r['value'])} | | |")
    if not shown:
        lines.append("| (no summary figures) | | | |")
    return head + "\n".join(lines)


def render(results: list[dict[str, Any]]) -> str:
    if not results:
        return "No full results yet: run `python -m benchmarks <name>`."
    return "\n\n".join(table(r) for r in results)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the page's tables are out of date")
    args = p.parse_args(argv)
    text = args.doc.read_text()
    try:
        new = rewrite(text, render(latest(args.results)), args.doc)
    except ValueError as e:
        print(f"python -m benchmarks report: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"{args.doc}'s tables are out of date: run python -m benchmarks report",
                  file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"wrote the tables of {len(latest(args.results))} results into {args.doc}")
    return 0
