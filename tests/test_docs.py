"""Every ```python block of README.md and docs/*.md runs as printed (issue 29).

How to mark a block: an HTML comment (GitHub does not show it) on the line right before
the opening fence. A block without one fails ``test_every_python_block_is_marked``, so
no new example escapes.

    <!-- doc-test: torch megengine -->
        runs as printed on each backend named (torch, megengine, or both)
    <!-- doc-test: torch prelude=model,data then=trains -->
        runs after the named preludes (PRELUDES below: only what the text leaves out,
        such as a model, an optimizer, a loader), then the named check (THEN below:
        for a block that only defines functions, the calls that make it run)
    <!-- doc-test: torch prelude=model needs=traceable_autocast -->
        where the named condition (NEEDS below) does not hold, the block must fail
        with the error its text says it fails with there
    <!-- doc-test: fragment: why it cannot run here -->
        not run (a loop body without its loop, a step that needs two GPUs); it must
        still compile as Python

A ```diff block (README's drop-in) takes the same marker. Each line starts with "-"
(the native's code only), "+" (unified_amp's only) or a blank (both); both sides run,
each in a fresh namespace, and must end with the same weights, byte for byte, and scale
(``test_doc_diff_sides_train_alike``): the "+" side's ``scaler`` is unified_amp's,
the "-" side's is not, and the check named by then= runs on the "+" side.

``make test`` runs this file once per backend (UNIFIED_AMP_BACKEND); each run executes
the blocks that name its backend, one test per block, named by file and line
(``test_doc_block_runs[docs/COMPILE.md:14]``), so pytest's output counts them, and
compiles every fragment. A block runs in a fresh namespace with its preludes first;
a failure's traceback gives the document's own line numbers. Afterwards the function
registries are put back and amp.initialize's state is dropped, as in a new process.
"""

from __future__ import annotations

import ast
import gc
import math
import pathlib
import re
import sys
import textwrap
import types
from dataclasses import dataclass, field
from typing import Callable

import pytest

import unified_amp as amp
from unified_amp import _registry, cast_registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BACKENDS = ("torch", "megengine")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<kind>python|diff)\s*$")

# What the text leaves out, per backend. A block marked prelude=a,b runs a's code, then
# b's, then its own, all in one namespace.
PRELUDES: dict[str, dict[str, str]] = {
    # A classifier, its loss, an optimizer (as `opt` and `optimizer`) and one batch.
    "model": {
        "torch": """
            import numpy as np
            import torch
            import torch.nn.functional as F
            import unified_amp as amp
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 4)
            loss_fn = F.cross_entropy
            opt = optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
        """,
        "megengine": """
            import numpy as np
            import megengine
            import megengine.functional as F
            import megengine.module as M
            from megengine.jit import trace
            import unified_amp as amp
            model = M.Linear(8, 4)
            loss_fn = F.nn.cross_entropy
            # (with momentum: MegEngine 1.13's SGD without it cannot load its own
            # state_dict, which APEX.md's checkpoint example does)
            opt = optimizer = megengine.optimizer.SGD(model.parameters(), lr=0.1,
                                                      momentum=0.9)
            x = megengine.tensor(np.random.RandomState(0).randn(4, 8).astype("float32"))
            y = megengine.tensor([0, 1, 2, 3], dtype="int32")
        """,
    },
    # Batches to loop over (after "model").
    "data": {b: "loader = micro_batches = [(x, y), (x, y)]" for b in BACKENDS},
    "gm": {b: "gm = amp.GradManager(model.parameters())" for b in BACKENDS},
    # An LR schedule (after "model"): the same class and arguments on both.
    "sched": {
        "torch": "sched = torch.optim.lr_scheduler.MultiStepLR(opt, [5, 10, 15], 0.5)",
        "megengine": "sched = megengine.optimizer.MultiStepLR(opt, [5, 10, 15], 0.5)",
    },
    "scaler": {b: "scaler = amp.GradScaler()" for b in BACKENDS},
    # "after initialize" (after "model"), at O2 as APEX.md's first example.
    "initialized": {b: 'model, optimizer = amp.initialize(model, optimizer, opt_level="O2")'
                    for b in BACKENDS},
    # The model and optimizer a new process would build before loading a checkpoint.
    "fresh": {
        "torch": """
            new_model = torch.nn.Linear(8, 4)
            new_optimizer = torch.optim.SGD(new_model.parameters(), lr=0.1, momentum=0.9)
        """,
        "megengine": """
            new_model = M.Linear(8, 4)
            new_optimizer = megengine.optimizer.SGD(new_model.parameters(), lr=0.1,
                                                    momentum=0.9)
        """,
    },
    # A scaled backward pass already run, and an LR schedule (after "model", "gm",
    # "scaler").
    "scaled_backward": {
        "torch": """
            with gm:
                gm.backward(scaler.scale(loss_fn(model(x), y)))
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        """,
        "megengine": """
            with gm:
                gm.backward(scaler.scale(loss_fn(model(x), y)))
            scheduler = megengine.optimizer.MultiStepLR(optimizer, milestones=[1])
        """,
    },
    # A model with the submodule the overflow report's example names.
    "encoder": {
        "torch": """
            import torch
            import unified_amp as amp
            model = torch.nn.Module()
            model.encoder = torch.nn.Module()
            model.encoder.layer3 = torch.nn.Linear(4, 4)
        """,
        "megengine": """
            import megengine.module as M
            import unified_amp as amp

            class Encoder(M.Module):
                def __init__(self):
                    super().__init__()
                    self.layer3 = M.Linear(4, 4)

                def forward(self, x):
                    return self.layer3(x)

            class Model(M.Module):
                def __init__(self):
                    super().__init__()
                    self.encoder = Encoder()

                def forward(self, x):
                    return self.encoder(x)

            model = Model()
        """,
    },
    # A one-process gloo group (the fixture ends it), a net, and the DDP model of the
    # first DDP example, for the next (after "model").
    "ddp": {
        "torch": """
            import contextlib, tempfile
            import torch.distributed
            from torch.nn.parallel import DistributedDataParallel as DDP
            torch.distributed.init_process_group(
                "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
            net, max_norm = model, 1.0
            model = DDP(net)
        """,
    },
    # Two small nets for a GAN step, their optimizers and data.
    "gan": {
        "torch": """
            import torch
            import torch.nn.functional as F
            import unified_amp as amp
            torch.manual_seed(0)
            model_D, model_G = torch.nn.Linear(4, 1), torch.nn.Linear(2, 4)
            opt_D = torch.optim.SGD(model_D.parameters(), lr=0.1)
            opt_G = torch.optim.SGD(model_G.parameters(), lr=0.1)
            loss_fn = F.binary_cross_entropy_with_logits
            noise, real = torch.randn(8, 2), torch.randn(8, 4)
            real_label, fake_label = torch.ones(8, 1), torch.zeros(8, 1)
        """,
    },
}


def _sched_steps(sched) -> int:
    """How often an LR scheduler was stepped (torch's last_epoch, MegEngine's
    current_epoch)."""
    return getattr(sched, "last_epoch", None) if ACTIVE == "torch" else sched.current_epoch


def _trains(ns: dict) -> None:
    """README's step: 20 finite losses that fall, 20 scaler steps, autocast off after;
    the scheduler stepped with the optimizer only, also through a planted overflow."""
    losses = ns["losses"]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]
    stats = ns["scaler"].stats()
    assert stats["steps"] == 20
    _scheduled(ns)
    sched, before = ns["sched"], _sched_steps(ns["sched"])
    weights = _weights(ns)
    ns["train_step"](ns["model"], ns["loss_fn"], ns["opt"], sched, ns["gm"], ns["scaler"],
                     ns["x"] * float("inf"), ns["y"])  # an overflow: a skipped step
    assert ns["scaler"].stats()["last_step_skipped"] and _weights(ns) == weights
    assert _sched_steps(sched) == before, "the schedule moved on a skipped step"


def _scheduled(ns: dict) -> None:
    """A loop that steps an LR schedule: the scheduler stepped once per optimizer step
    that the scaler did not skip."""
    stats = ns["scaler"].stats()
    assert stats["steps"] >= 1
    assert _sched_steps(ns["sched"]) == stats["steps"] - stats["skipped_steps"]


def _compiled_calls(ns: dict) -> None:
    """The compiled functions, called: a finite loss from each."""
    for fn in (ns["loss_fn"], ns["step"]):
        assert math.isfinite(fn(ns["model"], ns["x"], ns["y"]).item())


def _traced_steps(ns: dict) -> None:
    """The traced step, called three times (a record, then replays): each one a step."""
    for _ in range(3):
        assert math.isfinite(float(ns["train_step"](ns["x"], ns["y"]).item()))
    assert ns["scaler"].stats()["steps"] == 3


def _stepped(ns: dict) -> None:
    """The loop's scaler ran its steps (a block that trains but returns nothing)."""
    assert ns["scaler"].stats()["steps"] >= 1


# name -> (whether it holds here, the error a block needing it raises where it does not).
# None today: every block runs on every torch and backend it names.
NEEDS: dict[str, tuple[Callable[[], bool], str]] = {}

THEN = {"trains": _trains, "compiled_calls": _compiled_calls,
        "traced_steps": _traced_steps, "stepped": _stepped, "scheduled": _scheduled}


@dataclass
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    marker: str | None  # the marker's body, None if unmarked
    backends: list[str] = field(default_factory=list)
    preludes: list[str] = field(default_factory=list)
    then: str | None = None
    needs: str | None = None
    fragment: bool = False
    problems: list[str] = field(default_factory=list)
    kind: str = "python"
    before: str = ""  # a diff's "-" side with its context; ``code`` is its "+" side

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _parse_marker(block: Block) -> None:
    if block.marker is None:
        block.problems.append("no <!-- doc-test: ... --> marker on the line before it")
        return
    if block.marker.startswith("fragment"):
        block.fragment = True
        if not block.marker.partition(":")[2].strip():
            block.problems.append("a fragment marker says why: <!-- doc-test: fragment: why -->")
        return
    for word in block.marker.split():
        key, eq, value = word.partition("=")
        if not eq:
            block.backends.append(word)
        elif key == "prelude":
            block.preludes.extend(value.split(","))
        elif key == "then":
            block.then = value
        elif key == "needs":
            block.needs = value
        else:
            block.problems.append(f"unknown marker field {key!r}")
    for b in block.backends:
        if b not in BACKENDS:
            block.problems.append(f"unknown backend {b!r} (the backends: {BACKENDS})")
    if not block.backends:
        block.problems.append("a runnable block names its backends (torch, megengine)")
    for p in block.preludes:
        missing = [b for b in block.backends if b not in PRELUDES.get(p, {})]
        if missing:
            block.problems.append(f"prelude {p!r} has no code for {missing}")
    if block.then is not None and block.then not in THEN:
        block.problems.append(f"unknown check then={block.then!r} (known: {sorted(THEN)})")
    if block.needs is not None and block.needs not in NEEDS:
        block.problems.append(f"unknown condition needs={block.needs!r} (known: {sorted(NEEDS)})")


def _split_diff(block: Block, body: list[str]) -> None:
    """A diff's two programs: context lines in both, "-" lines before, "+" lines after.
    Blank lines keep their place in both, so a traceback's line numbers stay right."""
    sides: dict[str, list[str]] = {"-": [], "+": []}
    for number, line in enumerate(body, block.line + 1):
        sign, text = (line[:1], line[1:]) if line.strip() else (" ", "")
        if sign not in " -+":
            block.problems.append(f"line {number}: a diff line starts with '-', '+' or ' '")
            continue
        for side, lines in sides.items():
            lines.append(text if sign in (" ", side) else "")
    if not any(l.startswith("-") for l in body) or not any(l.startswith("+") for l in body):
        block.problems.append("a diff block needs both '-' and '+' lines")
    block.before = textwrap.dedent("\n".join(sides["-"])) + "\n"
    block.code = textwrap.dedent("\n".join(sides["+"])) + "\n"


def collect() -> list[Block]:
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            marker = MARKER.match(lines[i - 1]) if i else None
            body = lines[i + 1:end]
            block = Block(path, i + 1, textwrap.dedent("\n".join(body)) + "\n",
                          marker.group("body") if marker else None, kind=fence.group("kind"))
            if block.kind == "diff":
                _split_diff(block, body)
            _parse_marker(block)
            blocks.append(block)
            i = end + 1
    return blocks


BLOCKS = collect()
ACTIVE = amp.get_backend().name  # UNIFIED_AMP_BACKEND's, or the first installed
_registry._reset_for_tests()
RUNNABLE = [b for b in BLOCKS if not b.fragment and not b.problems and ACTIVE in b.backends
            and b.kind == "python"]
DIFFS = [b for b in BLOCKS if not b.fragment and not b.problems and ACTIVE in b.backends
         and b.kind == "diff"]
FRAGMENTS = [b for b in BLOCKS if b.fragment and not b.problems]


def _compiled(block: Block, code: str | None = None):
    # Padded so that a traceback's line numbers are the document's own.
    return compile("\n" * block.line + (block.code if code is None else code), block.name,
                   "exec")


def test_every_python_block_is_marked():
    assert len(BLOCKS) >= 20, "the extraction lost blocks"
    assert len([b for b in BLOCKS if b.kind == "diff"]) >= 2, "README's drop-in diffs"
    bad = [f"{b.name}: {p}" for b in BLOCKS for p in b.problems]
    assert not bad, "\n".join(bad)


def test_every_backend_has_examples_and_every_name_is_used():
    for backend in BACKENDS:
        assert any(backend in b.backends for b in BLOCKS), backend
    used = {p for b in BLOCKS for p in b.preludes}
    assert used == set(PRELUDES), f"unused preludes: {set(PRELUDES) - used}"
    assert {b.then for b in BLOCKS if b.then} == set(THEN)
    assert {b.needs for b in BLOCKS if b.needs} == set(NEEDS)


@pytest.fixture
def fresh_process():
    """What a new process would start from, and what it would leave behind."""
    _registry._reset_for_tests()  # the backend named by UNIFIED_AMP_BACKEND
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # the "ddp" prelude's
    cast_registry._unregister_all()
    gc.collect()  # amp.initialize's state goes with its models and optimizers
    _registry._reset_for_tests()
    assert not amp.is_autocast_enabled(), "the example left an autocast block open"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_doc_block_runs(block, fresh_process, monkeypatch):
    # A module of its own, as a script's: torch.compile imports the module its code
    # says it is in.
    module = types.ModuleType("doc_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for name in block.preludes:
        code = textwrap.dedent(PRELUDES[name][ACTIVE])
        exec(compile(code, f"<prelude {name}>", "exec"), namespace)
    holds, error = NEEDS[block.needs] if block.needs else (lambda: True, "")
    if holds():
        _run(block, namespace)
        return
    with pytest.raises(Exception) as info:
        _run(block, namespace)
    assert f"{info.type.__module__}.{info.type.__name__}" == error, info.value


def _run(block: Block, namespace: dict) -> None:
    exec(_compiled(block), namespace)
    if block.then:
        THEN[block.then](namespace)


def _side(block: Block, code: str) -> dict:
    """One side of a diff, run as a script of its own would run."""
    _registry._reset_for_tests()
    module = types.ModuleType("doc_example")
    sys.modules[module.__name__] = module
    try:
        for name in block.preludes:
            exec(compile(textwrap.dedent(PRELUDES[name][ACTIVE]), f"<prelude {name}>", "exec"),
                 module.__dict__)
        exec(_compiled(block, code), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


def _weights(namespace: dict) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in namespace["model"].parameters()]


def _scale(scaler) -> float:
    """The loss scale as each native spells it: megengine.amp's attribute, torch.amp's call."""
    value = getattr(scaler, "scale_factor", None)
    return float(scaler.get_scale() if value is None else value)


def _is_ours(scaler) -> bool:
    return any(c.__module__.split(".")[0] == "unified_amp" for c in type(scaler).__mro__)


@pytest.mark.parametrize("block", DIFFS, ids=[b.name for b in DIFFS])
def test_doc_diff_sides_train_alike(block, fresh_process):
    """The drop-in claim as printed: the native loop and the loop with the "+" lines give
    the same weights, byte for byte, and the same loss scale; only the "+" side runs
    unified_amp's scaler."""
    before = _side(block, block.before)
    after = _side(block, block.code)
    assert not _is_ours(before["scaler"]), "the '-' side already runs unified_amp's scaler"
    assert _is_ours(after["scaler"]), "the '+' lines do not put unified_amp's scaler in"
    stats = after["scaler"].stats()
    assert stats["steps"] > stats["skipped_steps"], f"no step changed the weights: {stats}"
    assert _weights(after) == _weights(before), "the two sides end with different weights"
    assert _scale(after["scaler"]) == _scale(before["scaler"]), "the scales parted"
    if block.then:
        THEN[block.then](after)


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.name for b in FRAGMENTS])
def test_doc_fragment_compiles(block):
    ast.parse(block.code)
    _compiled(block)


def test_readme_starts_with_the_code():
    """The front door (issue 34): the first Python code within the first 40 lines, the
    whole README under 200; the rest belongs in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines, 1) if FENCE.match(line))
    assert first + 1 <= 40, f"README's first code starts at line {first + 1}"
    assert len(lines) < 200, f"README has {len(lines)} lines"
