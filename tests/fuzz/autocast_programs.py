"""Random op programs for the autocast fuzz, rebuilt from (seed, index) alone.

A program is straight-line Python source (so that torch.compile sees a frame it can
split at a graph break, as it would a user's training step): ops before a block, an
enabled ``autocast`` block holding ops and nested ``enabled=False`` / re-enabled blocks,
ops after it, and a loss, inside the block or after it. The same program is written
twice, once with unified_amp's blocks and once with the native autocast's, and both
are run on the same inputs. Framework-free: the ops are the dtype contract's rows
(unified_amp/dtype_contract/: a new row enters the fuzz at once), implemented from
their sample calls in ``autocast_ops``.
"""

from __future__ import annotations

import importlib.metadata
import random
from dataclasses import dataclass, field

from unified_amp.dtype_contract import ROWS

# Each op maps the program's (4, 8) activation to a (4, 8) activation: every row of the
# contract the fuzz can feed (Sample.fuzz), by name; a backend draws from those it has
# (autocast_ops.op_names), but not those its own autocast raises on (contract=False
# programs run it). OPS, the default, is torch's ops that hold compiled too (the
# compiled fuzz's: Adapt.compiled names those that do not).
ALL_OPS = tuple(r.name for r in ROWS if r.sample.fuzz and r.rule != "refuse")


def native_raises(r, framework: str) -> bool:
    """Whether ``framework``'s own autocast ("torch-cpu", "megengine") raises on the row
    for a float32 or a low-precision input (a contract=False program cannot hold it:
    the programs' other inputs follow the activation's dtype, so none is mixed)."""
    return "error" in r.native(framework).replace("mixed: error", "")


def on_installed_torch(r) -> bool:
    """Whether the installed torch has the row's op (``Row.torch_since``), read from the
    package's metadata, not by importing torch; with no torch installed, only the rows
    every torch has."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return not r.torch_since
    return r.on_torch(version)


OPS = tuple(r.name for r in ROWS if r.name in ALL_OPS and r.sample.torch and not r.adapt.compiled
            and not native_raises(r, "torch-cpu") and on_installed_torch(r))
LOSSES = ("cross_entropy", "mse", "bce_with_logits", "nll")

# Where torch.compile is made to break the graph or give up on the frame
# (test_autocast_fuzz_compiled): none; dynamo's explicit graph break before, inside or
# after the block; a generator and a dict comprehension before the block (dynamo gives
# up on the frame, and on torch the library's first use may then be there).
SHAPES = ("whole", "break_before", "break_inside", "break_after", "abandon")


@dataclass
class Program:
    seed: int
    index: int
    low: str  # "float16" or "bfloat16"
    before: list[str]
    body: list  # op names, "break", and ("block", enabled, [items]) for nested blocks
    after: list[str]
    loss: str
    loss_inside: bool
    shape: str = "whole"
    made_outside: bool = False  # the outer block object made outside the function
    rules: dict = field(default_factory=dict)  # the outer block's own rules (draw_rules)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"seed={self.seed} index={self.index}"


def _ops(rng: random.Random, lo: int, hi: int, ops=OPS) -> list[str]:
    return [rng.choice(ops) for _ in range(rng.randint(lo, hi))]


def _without(items: list, leave_out: tuple) -> list:
    out: list = []
    for item in items:
        if isinstance(item, tuple):
            out.append((item[0], item[1], _without(item[2], leave_out), *item[3:]))
        elif item not in leave_out:
            out.append(item)
    return out


LOW_MAKERS = ("linear", "matmul", "batched matmul", "conv2d")  # low-precision outputs


def _body(rng: random.Random, depth: int, ops: tuple[str, ...]) -> list:
    items: list = []
    for op in _ops(rng, 1, 4, ops):
        # half the ops get a low-precision input (a matmul or conv before them), as the
        # table's rows are checked with both kinds of input
        if rng.random() < 0.5:
            items.append(rng.choice(LOW_MAKERS))
        items.append(op)
    if depth < 2 and rng.random() < 0.5:
        enabled = depth == 1 and rng.random() < 0.5  # a re-enabled block inside a disabled one
        items.insert(rng.randint(0, len(items)),
                     ("block", enabled, _body(rng, depth + 1, ops)))
    if rng.random() < 0.3:
        items.append(("block", False, _ops(rng, 1, 2, ops)))
    return items


def make(seed: int, index: int, *, ops: tuple[str, ...] = OPS, lows=("bfloat16", "float16"),
         shapes=("whole",), outside=(False,), leave_out=()) -> Program:
    """The program (seed, index) over ``ops``: the same every time, on every machine.
    ``leave_out`` drops ops from it after it is drawn (the rest stays the same program)."""
    rng = random.Random(f"autocast-fuzz:{seed}:{index}")
    return Program(seed=seed, index=index, low=rng.choice(lows),
                   before=_without(_ops(rng, 0, 2, ops), leave_out),
                   body=_without(_body(rng, 1, ops), leave_out),
                   after=_without(_ops(rng, 0, 2, ops), leave_out), loss=rng.choice(LOSSES),
                   loss_inside=rng.random() < 0.5, shape=rng.choice(shapes),
                   made_outside=rng.choice(outside))


def source(p: Program, side: str) -> str:
    """The program as a Python function ``program(x, P, out)``: ``side`` picks the blocks
    (``OUTER()``/``INNER(enabled)`` are bound by the runner to unified_amp's or the
    native autocast). ``out`` collects (op, input dtype, output) for the contract
    checks; the function returns the loss and the last activation."""
    lines = ["def program(x, P, out):", "    h = x"]
    if p.shape == "abandon":
        lines += ["    g = torch.Generator().manual_seed(0)",
                  "    noise = {k: torch.randn(*s, generator=g)"
                  " for k, s in {'n': (4, 8)}.items()}",
                  "    h = h + 0 * noise['n']"]
    for op in p.before:
        lines.append(f"    h = OP[{op!r}](h, P, out, False)")
    if p.shape == "break_before":
        lines.append("    BREAK()")
    lines.append("    with CTX:" if p.made_outside else
                 f"    with OUTER({p.rules!r}):" if p.rules else "    with OUTER():")
    body = list(p.body)
    if p.shape == "break_inside":
        body.insert(len(body) // 2, "break")
    _emit(body, lines, 2, True)
    if p.loss_inside:
        lines.append(f"        loss = LOSS['{p.loss}'](h, P, out, True)")
    lines.append("    h = F32(h)")  # back to float32 after the block, as user code does
    if p.shape == "break_after":
        lines.append("    BREAK()")
    for op in p.after:
        lines.append(f"    h = OP[{op!r}](h, P, out, False)")
    if not p.loss_inside:
        lines.append(f"    loss = LOSS['{p.loss}'](h, P, out, False)")
    lines.append("    return loss, h")
    return "\n".join(lines) + "\n"


def _emit(items: list, lines: list[str], depth: int, on: bool) -> None:
    pad = "    " * depth
    for item in items:
        if item == "break":
            lines.append(f"{pad}BREAK()")
        elif isinstance(item, tuple):
            _, enabled, inner, *rules = item
            if rules and rules[0]:
                lines.append(f"{pad}with INNER({enabled}, {rules[0]!r}):")
            else:
                lines.append(f"{pad}with INNER({enabled}):")
            # a float32 activation going into a disabled block, as user code casts it
            # (a low-precision activation and a float32 weight do not mix without autocast)
            lines.append(f"{pad}    h = F32(h)")
            _emit(inner, lines, depth + 1, enabled)
            lines.append(f"{pad}    h = F32(h)")
        else:
            lines.append(f"{pad}h = OP[{item!r}](h, P, out, {on})")
    if not items:
        lines.append(f"{pad}pass")


def has_nested(items: list) -> bool:
    return any(isinstance(i, tuple) for i in items)


# -- a block's own rules (amp.autocast(rules=...)), for the contract-on programs ---------------

RULE_KINDS = ("low", "float32", "promote", "input", "refuse")


def body_ops(items: list) -> list[str]:
    """The op names a block's items call, nested blocks' included, in order."""
    out: list[str] = []
    for item in items:
        if isinstance(item, tuple):
            out += body_ops(item[2])
        elif item != "break":
            out.append(item)
    return out


def _draw(rng: random.Random, keys: list[str], refuse: float, no_low: tuple) -> dict:
    kinds = [k for k in RULE_KINDS if k != "refuse"]
    return {key: "refuse" if rng.random() < refuse else
            "float32" if key in no_low else rng.choice(kinds)
            for key in rng.sample(keys, min(len(keys), rng.randint(1, 3)))}


def _draw_nested(rng: random.Random, items: list, keys: list[str], refuse: float,
                 no_low: tuple) -> list:
    out: list = []
    for item in items:
        if isinstance(item, tuple):
            inner = _draw_nested(rng, item[2], keys, refuse, no_low)
            mine = [k for k in keys if k in body_ops(item[2])] or keys
            rules = _draw(rng, mine, refuse, no_low) if rng.random() < 0.5 else {}
            out.append((item[0], item[1], inner, rules))
        else:
            out.append(item)
    return out


def draw_rules(p: Program, allowed: tuple[str, ...], refuse: float = 0.1,
               no_low: tuple[str, ...] = ()) -> Program:
    """``p`` with rules drawn for its blocks, from (seed, index) alone (a generator of
    their own, so the program's ops are those ``make`` drew): the outer block most of
    the time, each nested block (enabled or not) half of the time, each naming one to
    three of the ops the program calls inside the block (``allowed``: the rows a rule
    may name, see autocast_ops.rule_keys) with a random kind, "refuse" rarely
    (``no_low``: rows given "float32" or "refuse" only, whose low-precision kernels the
    framework lacks)."""
    rng = random.Random(f"autocast-fuzz-rules:{p.seed}:{p.index}")
    keys = sorted({op for op in body_ops(p.body) if op in allowed})
    if not keys:
        return p
    p.rules = _draw(rng, keys, refuse, no_low) if rng.random() < 0.75 else {}
    p.body = _draw_nested(rng, p.body, keys, refuse, no_low)
    return p


def rules_in_force(p: Program) -> list[dict]:
    """The rules in force at each op and loss call the program records, in the order
    it records them: an enabled block's merged over the enclosing enabled block's
    (inner wins), none in an ``enabled=False`` block or in a re-enabled block's
    enclosing disabled one, none outside the outer block."""
    seen: list[dict] = [{} for _ in p.before]

    def walk(items: list, force: dict, on: bool) -> None:
        for item in items:
            if isinstance(item, tuple):
                _, enabled, inner, *rules = item
                own = rules[0] if rules else {}
                walk(inner, {**force, **own} if enabled else {}, enabled)
            elif item != "break":
                seen.append(force if on else {})

    walk(p.body, dict(p.rules), True)
    if p.loss_inside:
        seen.append(dict(p.rules))
    seen += [{} for _ in p.after]
    if not p.loss_inside:
        seen.append({})
    return seen


def ruled_calls(p: Program) -> list[tuple[str, str]]:
    """(op, kind) of each call the program makes of an op that a rule in force names."""
    calls = p.before + body_ops(p.body) + [p.loss] * p.loss_inside
    return [(op, rules[op]) for op, rules in zip(calls, rules_in_force(p)) if op in rules]


def refused(p: Program) -> bool:
    """Whether the program calls an op that a "refuse" rule in force refuses."""
    calls = p.before + body_ops(p.body) + [p.loss] * p.loss_inside
    return any(rules.get(op) == "refuse" for op, rules in zip(calls, rules_in_force(p)))
