"""What a compile leaves behind: a function holding an autocast block is compiled, called
and dropped with ``torch._dynamo.reset()``, over and over; this counts what each such
cycle leaves in the process, for ``amp.autocast`` in each of its forms beside plain
``torch.autocast`` and a function with no block, in one process.

    UNIFIED_AMP_BACKEND=torch python tools/compile_leak.py [--cycles 20] [--bytes]

Run it in a process of its own (a test runner keeps the log records dynamo emits, which
would count as left behind). Per cycle, after a few cycles of warm-up: objects the garbage collector tracks,
``weakref.finalize`` entries (dynamo hangs one on each object an ID_MATCH guard names,
and it keeps the guards' manager alive until that object dies), and with ``--bytes``
the memory still allocated (tracemalloc; slower). tests/native/test_torch_compile_leaks.py
runs the same cycles and holds amp.autocast's counts to torch.autocast's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tracemalloc
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

import unified_amp as amp
from unified_amp.backends.torch_backend import autocast as torch_autocast

BF16 = torch.bfloat16


def _plain(x):
    return torch.mm(x, x).sum()


def _native(x):
    with torch.autocast("cpu", dtype=BF16):
        return torch.mm(x, x).sum()


def _native_cpu_and_cuda(x):
    with torch.autocast("cpu", dtype=BF16), torch.autocast("cuda", dtype=BF16):
        return torch.mm(x, x).sum()


def _unified(x):
    with amp.autocast(dtype="bfloat16", device="cpu"):
        return torch.mm(x, x).sum()


def _unified_no_contract(x):
    with amp.autocast(dtype="bfloat16", device="cpu", contract=False):
        return torch.mm(x, x).sum()


def _unified_every_device(x):
    # A GPU machine's default block covers CUDA; the CPU block nested in it adds the CPU
    # (docs/API.md, "Devices")
    with amp.autocast(dtype="bfloat16"), amp.autocast(dtype="bfloat16", device="cpu"):
        return torch.mm(x, x).sum()


def _native_graph_break(x):
    with torch.autocast("cpu", dtype=BF16):
        y = torch.mm(x, x)
        torch._dynamo.graph_break()
        return y.sum()


def _unified_graph_break(x):
    with amp.autocast(dtype="bfloat16", device="cpu"):
        y = torch.mm(x, x)
        torch._dynamo.graph_break()
        return y.sum()


def _redefined(block: str) -> Callable[[], Callable]:
    """A graph break inside ``block``, in a function defined anew each cycle (new code),
    as a notebook cell run again defines it."""
    source = f"""
def f(x):
    with {block}:
        y = torch.mm(x, x)
        torch._dynamo.graph_break()
        return y.sum()
"""

    def make() -> Callable:
        scope = {"amp": amp, "torch": torch}
        exec(compile(source, "<cell>", "exec"), scope)
        return scope["f"]
    return make


def _decorated() -> Callable:
    @amp.autocast(dtype="bfloat16", device="cpu")
    def f(x):
        return torch.mm(x, x).sum()
    return f


def _made_outside() -> Callable:
    block = amp.autocast(dtype="bfloat16", device="cpu")

    def f(x):
        with block:
            return torch.mm(x, x).sum()
    return f


@contextlib.contextmanager
def _cpu_and_cuda() -> Iterator[None]:
    """The adapter sees a GPU (an enabled block with no device covers CUDA), torch does
    not: as tests/native/test_torch_compile.py's GPU-machine test does, since a torch.cuda
    that says a GPU is there makes dynamo start CUDA on a build without one."""
    devices, bf16 = torch_autocast.devices, torch.cuda.is_bf16_supported
    torch_autocast.devices = lambda device, enabled: (
        [device] if device else ["cuda"] if enabled else ["cpu", "cuda"])
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*CUDA is not available")
            yield
    finally:
        torch_autocast.devices, torch.cuda.is_bf16_supported = devices, bf16


@dataclass(frozen=True)
class Form:
    name: str
    make: Callable[[], Callable]  # a new function per cycle, as a new model would be
    around: Callable[[], Any] = contextlib.nullcontext
    quiet: bool = False  # a graph break inside a block warns once per function


FORMS = {f.name: f for f in (
    Form("no block", lambda: _plain),
    Form("torch.autocast", lambda: _native),
    Form("amp.autocast", lambda: _unified),
    Form("amp.autocast contract=False", lambda: _unified_no_contract),
    Form("decorated", _decorated),
    Form("block made outside", _made_outside),
    Form("torch.autocast, graph break inside", lambda: _native_graph_break),
    Form("amp.autocast, graph break inside", lambda: _unified_graph_break, quiet=True),
    Form("torch.autocast, graph break, redefined",
         _redefined('torch.autocast("cpu", dtype=torch.bfloat16)')),
    Form("amp.autocast, graph break, redefined",
         _redefined('amp.autocast(dtype="bfloat16", device="cpu")'), quiet=True),
    Form("torch.autocast CPU+CUDA (fake)", lambda: _native_cpu_and_cuda, _cpu_and_cuda),
    Form("amp.autocast CPU+CUDA (fake)", lambda: _unified_every_device, _cpu_and_cuda),
)}


def _cycle(form: Form, x: torch.Tensor) -> None:
    fn = torch.compile(form.make(), backend="eager")
    with warnings.catch_warnings():
        if form.quiet:
            warnings.simplefilter("ignore", amp.CompileWarning)
        fn(x)
    del fn
    torch._dynamo.reset()
    # dynamo keeps the metrics of its last 64 compiles: bounded, and no block's doing.
    torch._dynamo.utils.clear_compilation_metrics()
    # Nor is its metrics context's record of who set which metric (two entries a compile,
    # never cleared: plain torch.compile grows it too, torch 2.10-2.13). A block whose
    # frame dynamo gives up on makes more compiles (its callees) than the torch.autocast
    # form it is held to, so this would count compiles, not what a block leaves.
    context = getattr(torch._dynamo.utils, "get_metrics_context", None)
    edits = getattr(context(), "_edits", None) if context is not None else None
    if isinstance(edits, list):
        edits.clear()
    gc.collect()


@dataclass(frozen=True)
class Left:
    """What one cycle left behind, on average."""
    objects: float
    finalizers: float
    bytes: float | None


def measure(name: str, cycles: int, warmup: int = 2, trace_bytes: bool = False) -> Left:
    """Runs ``warmup`` cycles of the form, then ``cycles`` more, and returns what each of
    the latter left on average."""
    form = FORMS[name]
    x = torch.randn(8, 8)
    with form.around():
        return _measure(form, x, cycles, warmup, trace_bytes)


def _measure(form: Form, x: torch.Tensor, cycles: int, warmup: int, trace_bytes: bool) -> Left:
    registry = weakref.finalize._registry  # type: ignore[attr-defined]
    if trace_bytes:  # from the start: what the warm-up left may go later
        tracemalloc.start()
    for _ in range(warmup):
        _cycle(form, x)
    objects, finalizers = len(gc.get_objects()), len(registry)
    held = tracemalloc.get_traced_memory()[0] if trace_bytes else 0
    for _ in range(cycles):
        _cycle(form, x)
    gained = tracemalloc.get_traced_memory()[0] - held if trace_bytes else None
    if trace_bytes:
        tracemalloc.stop()
    return Left(objects=(len(gc.get_objects()) - objects) / cycles,
                finalizers=(len(registry) - finalizers) / cycles,
                bytes=None if gained is None else gained / cycles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bytes", action="store_true", help="also the memory (tracemalloc)")
    parser.add_argument("--forms", nargs="*", choices=list(FORMS), default=list(FORMS))
    parser.add_argument("--json", action="store_true",
                        help="one JSON object, form -> what a cycle left, on stdout")
    args = parser.parse_args(argv)
    if args.json:
        json.dump({name: vars(measure(name, args.cycles, args.warmup, args.bytes))
                   for name in args.forms}, sys.stdout)
        return 0
    print(f"torch {torch.__version__}, CPython {sys.version.split()[0]}: per cycle, after"
          f" {args.warmup} cycles of warm-up, average of {args.cycles}")
    width = max(map(len, args.forms))
    print(f"{'form':{width}} {'objects':>9} {'finalizers':>11}" + (f" {'bytes':>9}" if args.bytes else ""))
    for name in args.forms:
        left = measure(name, args.cycles, args.warmup, args.bytes)
        line = f"{name:{width}} {left.objects:9.1f} {left.finalizers:11.1f}"
        print(line + (f" {left.bytes:9.0f}" if left.bytes is not None else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
