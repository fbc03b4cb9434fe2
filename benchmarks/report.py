"""What a run leaves behind: machine description, stdout table, JSON and PNG."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# The ratios that measure unified_amp's own cost, held to the target; the others explain.
TARGETED = ("unified", "scaler_only", "unified_same_dtypes", "trace_off")
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def _cpuinfo() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": [f for f in _CPU_FLAGS if f in flags]}


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info(kit: Any) -> dict[str, Any]:
    """CPU, memory, OS, Python, framework and device, as plain JSON values."""
    import numpy

    info = _cpuinfo()
    info.update(
        cpu_count=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        memory_bytes=_mem_total_bytes(),
        platform=platform.platform(),
        python=platform.python_version(),
        numpy=numpy.__version__,
        device=kit.device,
    )
    info.update(kit.info())
    info.setdefault("device_name", f"CPU: {info['cpu_model']}")
    return info


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages: how busy the machine was (it is shared)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and inf floats (a diverged loss) as None: JSON has no NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(data: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")


# -- the stdout table -----------------------------------------------------------------
def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:9.2f} [{s['q1'] * 1e3:.2f}-{s['q3'] * 1e3:.2f}]"


def _mem(v: dict[str, Any]) -> str:
    b, r = v.get("peak_memory_bytes"), v.get("peak_memory_vs_fp32")
    if b is None:
        return "n/a"
    return f"{b / 2**20:.1f} MiB" + ("" if r is None else f" ({r:.2f}x)")


def _tf32(t: bool | None) -> str:
    return "n/a" if t is None else ("on" if t else "off")


def table(result: dict[str, Any]) -> str:
    """The run's figures as aligned text."""
    cfg, m = result["config"], result["machine"]
    lines = [
        f"unified_amp benchmark: backend {cfg['backend']} {m['framework_version']},"
        f" device {m['device']} ({m['device_name']}), {cfg['mode']} mode,"
        f" {result['runtime_s']:.0f} s",
        "",
        "Training throughput, unified_amp step (median over rounds [IQR]):",
        f"{'workload':12} {'precision':9} {'tf32':4} {'step ms':>26} {'samples/s':>10}"
        f" {'vs fp32':>7} {'peak memory (vs fp32)':>22}",
    ]
    for wname, w in result["workloads"].items():
        for tp in w["throughput"]:
            for prec, v in tp["variants"].items():
                head = f"{wname:12} {_SHORT[prec]:9} {_tf32(tp['tf32']):4}"
                if v.get("skipped"):
                    lines.append(f"{head} skipped: {v['reason']}")
                    continue
                sp = v["speedup_vs_fp32"]
                sp_text = "" if sp is None else f"{sp['median']:.2f}x"
                lines.append(f"{head} {_ms(v['step_time_s']):>26}"
                             f" {v['samples_per_s']:10.1f} {sp_text:>7} {_mem(v):>22}")
    lines += ["", "Overhead ratios: step time of variant A / variant B, per interleaved round"
              f" (median [IQR] (min-max)); ok: <= target {cfg['overhead_target']}:",
              f"{'workload':12} {'dtype':5} {'ratio':20} {'A ms':>8} {'B ms':>8}"
              f"  {'A/B':>29} {'ok':>3}"]
    legend: dict[str, str] = {}
    for wname, w in result["workloads"].items():
        o = w.get("overhead")
        if o is None:
            continue
        if o.get("skipped"):
            lines.append(f"{wname:12} skipped: {o['reason']}")
            continue
        for name, r in o["ratios"].items():
            num, den = (o["variants"][r[k]]["step_time_s"]["median"] * 1e3
                        for k in ("numerator", "denominator"))
            ok = ("yes" if r["median"] <= o["target"] else "NO") if name in TARGETED else ""
            lines.append(
                f"{wname:12} {_SHORT[o['dtype']]:5} {name:20} {num:8.2f} {den:8.2f}"
                f"  {r['median']:.4f} [{r['q1']:.4f}-{r['q3']:.4f}]"
                f" ({r['min']:.3f}-{r['max']:.3f}) {ok:>3}")
            legend[name] = f"{r['numerator']} / {r['denominator']}"
    if legend:
        lines.append("  where " + "; ".join(f"{k} = {v}" for k, v in legend.items()))
    lines += _opt_level_lines(result)
    if result["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines)


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _opt_level_lines(result: dict[str, Any]) -> list[str]:
    lines = ["", "apex opt levels (amp.initialize + amp.scale_loss; each level on its own copy"
             " of the model, interleaved; ratios to O0 per round, median [IQR]):",
             f"{'workload':12} {'level':5} {'low':4} {'step ms':>26} {'vs O0':>22}"
             f" {'weights + masters + opt state':>34} {'vs O0':>6} {'peak (vs O0)':>20}"]
    for wname, w in result["workloads"].items():
        o = w.get("opt_levels")
        if o is None:
            continue
        if o.get("skipped"):
            lines.append(f"{wname:12} skipped: {o['reason']}")
            continue
        for level, v in o["levels"].items():
            head = f"{wname:12} {level:5} {_SHORT[o['low_dtype']]:4}"
            if v.get("skipped"):
                lines.append(f"{head} {v['reason']}")
                continue
            r = v["step_time_vs_O0"]
            ratio = "" if r is None else f"{r['median']:.3f} [{r['q1']:.3f}-{r['q3']:.3f}]"
            b = v["bytes"]
            parts = f"{_mib(b['weights'])} + {_mib(b['master_weights'])} +" \
                    f" {_mib(b['optimizer_state'])}"
            vs = "" if v["bytes_vs_O0"] is None else f"{v['bytes_vs_O0']:.3f}"
            mem = v.get("peak_memory_bytes")
            peak = "n/a" if mem is None else _mib(mem) + (
                "" if v.get("peak_memory_vs_O0") is None else
                f" ({v['peak_memory_vs_O0']:.2f}x)")
            lines.append(f"{head} {_ms(v['step_time_s']):>26} {ratio:>22} {parts:>34}"
                         f" {vs:>6} {peak:>20}")
    return lines if len(lines) > 3 else []


# -- the plot -------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput bars per workload (IQR whiskers), the overhead ratios and the opt-level
    ratios, as a PNG: one panel each, for the sections that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    bars = max(sum(len(tp["variants"]) for tp in w["throughput"]) for w in workloads.values())
    panel = max(5.0, 1.1 * bars + 1.0)  # room for each bar's three-line label
    panels: list[tuple[float, Any]] = []
    if bars:
        for wname, w in workloads.items():
            panels.append((panel, lambda ax, wname=wname, w=w: _plot_throughput(ax, wname, w)))
    if any(w.get("overhead") and not w["overhead"].get("skipped")
           for w in workloads.values()):
        panels.append((5.5, lambda ax: _plot_overhead(ax, result)))
    if any(w.get("opt_levels") and not w["opt_levels"].get("skipped")
           for w in workloads.values()):
        panels.append((5.5, lambda ax: _plot_opt_levels(ax, workloads)))
    widths = [width for width, _ in panels] or [5.5]
    fig, axes = plt.subplots(1, len(widths), layout="constrained", squeeze=False,
                             figsize=(max(sum(widths), 9.0), 4.8), width_ratios=widths)
    for ax, (_, draw) in zip(axes[0], panels):
        draw(ax)
    cfg, m = result["config"], result["machine"]
    threads = f", {m['threads']} CPU thread(s)" if m["device"] == "cpu" else ""
    fig.suptitle(f"{cfg['backend']} {m['framework_version']} on {m['device_name']}{threads}"
                 f" ({cfg['mode']} mode, {result['date'][:10]})", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_throughput(ax: Any, wname: str, w: dict[str, Any]) -> None:
    colors = {"float32": "#4c72b0", "float16": "#dd8452", "bfloat16": "#55a868"}
    labels, heights, errs, cols, notes = [], [], [[], []], [], []
    for tp in w["throughput"]:
        for prec, v in tp["variants"].items():
            label = _SHORT[prec]
            if tp["tf32"] is not None:
                label += f"\ntf32 {_tf32(tp['tf32'])}"
            labels.append(label)
            cols.append(colors[prec])
            if v.get("skipped"):
                heights.append(0.0)
                errs[0].append(0.0)
                errs[1].append(0.0)
                notes.append("skipped")
                continue
            lo, hi = v["samples_per_s_iqr"]
            heights.append(v["samples_per_s"])
            errs[0].append(max(v["samples_per_s"] - lo, 0.0))
            errs[1].append(max(hi - v["samples_per_s"], 0.0))
            note = f"{v['samples_per_s']:.4g}/s"
            if v["speedup_vs_fp32"] is not None:
                note += f"\n{v['speedup_vs_fp32']['median']:.2f}x fp32"
            if v["peak_memory_bytes"] is not None:
                note += f"\npeak {v['peak_memory_bytes'] / 2**30:.2f} GiB"
            notes.append(note)
    xs = range(len(labels))
    ax.bar(xs, heights, yerr=errs, color=cols, capsize=4)
    top = max([h + e for h, e in zip(heights, errs[1])] + [1.0])
    for x, h, e, note in zip(xs, heights, errs[1], notes):
        ax.text(x, h + e + top * 0.02, note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("samples / s (higher is better)")
    size = ", ".join(f"{k}={v}" for k, v in w["size"].items())
    ax.set_title(f"{wname}: training throughput\n{size}", fontsize=9)


def _plot_overhead(ax: Any, result: dict[str, Any]) -> None:
    workloads = result["workloads"]
    names = ("unified", "scaler_only", "autocast_only", "contract_cost",
             "unified_same_dtypes", "trace_on", "trace_off")
    width = 0.8 / len(names)
    ratios = []
    for i, w in enumerate(workloads.values()):
        o = w.get("overhead")
        if not o or o.get("skipped"):
            continue
        for j, name in enumerate(names):
            r = o["ratios"].get(name)
            if r is None:
                continue
            ratios += [r["q1"], r["q3"]]
            x = i + (j - (len(names) - 1) / 2) * width
            ax.errorbar(x, r["median"], yerr=[[r["median"] - r["q1"]], [r["q3"] - r["median"]]],
                        fmt="o", color=f"C{j}", capsize=3, label=name if i == 0 else None)
            ax.annotate(f"{r['median']:.3f}", (x, r["q3"]), xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7,
                        rotation=90)
    ax.axhline(1.0, color="black", lw=0.8)
    target = result["config"]["overhead_target"]
    ax.axhline(target, color="red", lw=0.8, ls="--", label=f"target {target}")
    lo, hi = min(ratios + [0.97]), max(ratios + [1.03])
    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.25 * (hi - lo))  # headroom for the labels
    ax.set_xlim(-0.5, len(workloads) - 0.5)
    ax.set_xticks(range(len(workloads)), list(workloads))
    ax.set_ylabel("step time ratio (lower is better)")
    dtypes = {w["overhead"]["dtype"] for w in workloads.values()
              if w.get("overhead") and not w["overhead"].get("skipped")}
    ax.set_title(f"overhead ratios, {', '.join(_SHORT[d] for d in sorted(dtypes))}: median of"
                 " per-round ratios, IQR whiskers", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)


def _plot_opt_levels(ax: Any, workloads: dict[str, Any]) -> None:
    """Step time and weight + optimizer-state bytes of O1-O3 as ratios to O0."""
    kinds = (("step time", "step_time_vs_O0"), ("weights + opt state", "bytes_vs_O0"))
    x, ticks, tick_labels = 0.0, [], []
    for wname, w in workloads.items():
        o = w.get("opt_levels")
        if not o or o.get("skipped"):
            continue
        for level, v in o["levels"].items():
            if v.get("skipped"):
                continue
            for j, (label, key) in enumerate(kinds):
                value = v[key]["median"] if isinstance(v[key], dict) else v[key]
                if value is None:
                    continue
                bar_x = x + (j - 0.5) * 0.4
                ax.bar(bar_x, value, width=0.4, color=f"C{j}",
                       label=label if not ticks else None)
                ax.text(bar_x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=6,
                        rotation=90)
            ticks.append(x)
            tick_labels.append(f"{level}\n{wname}" if level == "O0" else level)
            x += 1.0
        x += 0.5
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(ticks, tick_labels, fontsize=7)
    ax.set_ylabel("ratio to O0 (lower is better)")
    dtypes = {w["opt_levels"]["low_dtype"] for w in workloads.values()
              if w.get("opt_levels") and not w["opt_levels"].get("skipped")}
    ax.set_title(f"apex opt levels ({', '.join(_SHORT[d] for d in sorted(dtypes))}):"
                 " ratios to O0", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)


def command_line(argv: list[str]) -> str:
    """The invocation, as one shell line with the backend variable it ran under."""
    import shlex

    env = os.environ.get("UNIFIED_AMP_BACKEND")
    prefix = f"UNIFIED_AMP_BACKEND={env} " if env else ""
    # The interpreter relative to the checkout (its .venv-*), else by name: a saved
    # result names the command, not the machine it ran on.
    exe = Path(sys.executable)
    try:
        python = str(exe.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        python = exe.name
    return f"{prefix}{python} -m benchmarks.bench {shlex.join(argv)}".rstrip()
