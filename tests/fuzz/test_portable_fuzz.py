"""Cross-backend differential fuzz of the public API: the same program, written once
against unified_amp (portable_programs.py), run on torch here and on MegEngine in its own
interpreter (portable_runner.py), compared call by call.

Per call both backends must give the same outcome (both go on, or both raise the same
error class), the same dtypes in the forward pass, the same ``stats()`` (scale
trajectory, skip decisions and counters), gradients within float16's error of what was
summed into them (Summed; an overflowed one's inf, -inf and NaN alike), weights within
float16's error, the same skip decisions (weights moved or not), the same
``clip_grad_norm`` (within float16's error; inf and NaN alike), the same state dicts,
which each framework's own scaler loads as its own; where both refuse a bad state dict,
ours is also the type the framework's own scaler raises. A call where they part is one of the rows of
docs/DROP_IN.md's table "Where the backends part, call by call" (the program ends there)
or a failure naming the seed, the index and the call.

Where it runs: in the torch backend's run of the suite, which starts the MegEngine
interpreter that UNIFIED_AMP_MEGENGINE_PYTHON names. `make test` and `make fuzz` set it
when both backends are selected, and then an interpreter that is missing or cannot run
the programs fails the test; where only one backend was selected (``make test
BACKENDS=torch``, ``make test-oldest``) there is no other backend to compare with, and
the test says so as its skip reason.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import unified_amp as amp

from .portable_programs import (ATOL, GRAD_RTOL, RTOL, World, make_program, run_program,
                                summed_magnitudes)
from .scaler_fuzz_common import Parted, table, time_limit

ENV = "UNIFIED_AMP_MEGENGINE_PYTHON"
ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADING = "## Where the backends part, call by call"
CHUNK = 40  # programs per MegEngine process


# -- the table of deliberate differences -------------------------------------------------
@dataclass(frozen=True)
class Parting:
    id: str
    refuses: str  # "torch" or "megengine"
    fragment: str  # a piece of the refusing backend's message


def partings() -> dict[str, Parting]:
    """DROP_IN.md's table under HEADING: | id | refuses | call | message |."""
    return {ident: Parting(ident, cells[1], fragment)
            for ident, cells, fragment in table(HEADING, 4)}


def _fp16_into(call: list[Any], where: tuple[str, ...]) -> bool:
    """A block whose first layer's float16 output goes on uncast in one of ``where``
    (its forward's "second" setting): into the second layer, or (the loss skips it) into
    the loss, computed there in float16."""
    return (call[0] == "block" and call[1] == "f16" and call[2] in where
            and call[3] is None and (call[4] == "both" or not call[5]))


# What must hold of the call where the backends part at a row (beyond its message).
CONDITIONS: dict[str, Callable[[list[Any]], bool]] = {
    "float16-into-disabled-block": lambda c: _fp16_into(c, ("after-off",)),
    "float16-out-of-autocast": lambda c: _fp16_into(c, ("after-none",)),
    "framework-backward-in-gm": lambda c: c[0] == "block" and c[7] == "framework",
}


def test_the_table_is_there_and_each_row_has_a_situation():
    listed = partings()
    assert set(listed) == set(CONDITIONS), (
        f"{HEADING!r} lists {sorted(listed)}; this fuzz knows the situations of"
        f" {sorted(CONDITIONS)}: give each row its condition here")
    for p in listed.values():
        assert p.refuses in ("torch", "megengine"), p
        assert len(p.fragment) >= 15, f"{p.id}: quote a distinctive piece of the message"


# -- comparing two traces ------------------------------------------------------------------
def _numbers_part(listed: dict[str, Parting], call: list[Any]) -> None:
    """The numbers differ: Parted where a row's situation is the call's (the rows say
    what differs there), else nothing (the caller fails)."""
    for p in listed.values():
        if CONDITIONS[p.id](call):
            raise Parted(p)


@dataclass
class Tally:
    programs: int = 0
    calls: int = 0
    compared: int = 0  # calls after which both backends went on and were compared
    both_refused: int = 0  # calls both refused with the same error class (compared too)
    loads: int = 0  # state dicts loaded by a framework's own scaler
    parted: dict[str, int] = field(default_factory=dict)
    # the most of its tolerance a comparison used (_all_used), by what was compared,
    # and where: (used, "index I call K")
    used: dict[str, tuple[float, str]] = field(default_factory=dict)

    def use(self, what: str, used: float, where: str) -> None:
        if self.used.get(what, (0.0, ""))[0] < used <= 1.0:
            self.used[what] = (used, where)

    def line(self) -> str:
        parted = ", ".join(f"{k} {v}" for k, v in sorted(self.parted.items())) or "none"
        used = ", ".join(f"{k} {v:.2f} ({at})" for k, (v, at) in sorted(self.used.items()))
        return (f"{self.programs} programs, {self.calls} calls, {self.compared} compared"
                f" with both going on, {self.both_refused} both refused alike,"
                f" {self.loads} state dicts loaded by the frameworks' own scalers;"
                f" parted at: {parted}; the most of float16's tolerance used: {used}")


def _used(a: Any, b: Any, size: float = 0.0, rtol: float = RTOL,
          overflowed_alike: bool = False) -> float:
    """How much of float16's error the difference uses (0: none, above 1: beyond),
    relative to ``size`` (what the tensor's rounding error scales with) or to the
    values. ``overflowed_alike``: inf, -inf and NaN match one another (_grads_used)."""
    if isinstance(a, str) or isinstance(b, str):  # "inf", "-inf", "nan"
        alike = a == b or (overflowed_alike and isinstance(a, str) and isinstance(b, str))
        return 0.0 if alike else math.inf
    return abs(a - b) / (rtol * max(abs(a), abs(b), size) + ATOL)


def _close(a: Any, b: Any) -> bool:
    return _used(a, b) <= 1.0


def _size(a: list[Any]) -> float:
    return max((abs(v) for v in a if not isinstance(v, str)), default=0.0)


def _all_used(a: list[Any] | None, b: list[Any] | None, size: float,
              rtol: float = RTOL, overflowed_alike: bool = False) -> float:
    """The most of its tolerance an element uses (_used; inf where one side has no
    tensor)."""
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    if len(a) != len(b):
        return math.inf
    return max((_used(x, y, size, rtol, overflowed_alike) for x, y in zip(a, b)),
               default=0.0)


def _weights_used(a: list[Any], b: list[Any], path: float) -> float:
    """Weights within float16's error relative to their largest magnitude plus
    ``path``, the sum of the steps that moved them so far (each step's rounding error
    is relative to the gradient it applied, however large, and the errors add up),
    which no wrong skip, scale or unscale stays within."""
    return _all_used(a, b, max(_size(a), _size(b)) + path)


def _grads_used(a: list[Any] | None, b: list[Any] | None, summed: float) -> float:
    """Gradients within GRAD_RTOL of the magnitudes summed into them: ``summed``
    times their own largest magnitude (Summed). And an overflowed gradient's inf,
    -inf or NaN is the kernels' business: a float16 product that rounds to 0 on one
    side and to a tiny number on the other meets an inf dy as NaN there and as an inf
    here (seed 5, index 282: torch's -inf, MegEngine's NaN). Where a gradient is
    finite on one side, it is on the other."""
    size = max(_size(a), _size(b)) * summed if a is not None and b is not None else 0.0
    return _all_used(a, b, size, GRAD_RTOL, overflowed_alike=True)


def _moved(after: list[Any], before: list[Any]) -> float:
    """How far a step moved a tensor (its largest change; inf/NaN: nothing to add)."""
    steps = [abs(x - y) for x, y in zip(after, before)
             if not isinstance(x, str) and not isinstance(y, str)]
    return max(steps, default=0.0)


SCALED_BACKWARDS = ("auto", "auto-noupdate", "auto-nounscale", "manual", "dy", "framework")
UNSCALING_BACKWARDS = ("auto", "auto-noupdate")  # scaler.backward(gm, loss[, ...])
UNSCALING_CALLS = ("unscale", "unscale_", "step")


class Summed:
    """Per parameter, what its gradient's difference between the backends scales
    with, over the gradient's magnitude (>= 1), call by call.

    A float16 backward's rounding error is relative to the magnitudes it sums, not to
    the sum (summed_magnitudes): a bias's gradient of 0.04 summed from terms of 5
    carries their error, 0.003 on both backends, against float64 (seed 5, index 203).
    Gradients accumulated over backward passes add their errors the same way: where a
    float32 block's 12.44 and a float16 block's -11.28 leave 1.16, the float16 pass's
    error, 0.03, is 2.5% of the gradient (seed 5, index 173). So a block's backward
    adds its magnitudes, times the scale it ran with (2**-13 of that where its forward
    computed in float32 alone), plus how far the backends' weights, within float16's
    error of each other, move that gradient apart, to what was there. The other calls
    (unscale, step, clip_grad_norm) scale the whole gradient, which leaves the ratio
    as it is.
    """

    def __init__(self, config: dict[str, Any], t: dict[str, Any], m: dict[str, Any]):
        self.enabled = config["enabled"]
        self.grads = (t["grads"], m["grads"])
        self.weights = (t["weights"], m["weights"])
        self.scale = t["stats"]["scale"] if self.enabled else 1.0
        self.ratio = [1.0] * len(t["grads"])
        # whether the gradient is in true units: nothing scaled went in, or unscaled
        self.unscaled = [True] * len(t["grads"])

    def after(self, call: list[Any], a: dict[str, Any], b: dict[str, Any]) -> list[float]:
        """The ratios after ``call``, whose records on the two backends are a and b."""
        before, weights, scale = self.grads, self.weights, self.scale
        self.grads, self.weights = (a["grads"], b["grads"]), (a["weights"], b["weights"])
        self.scale = a["stats"]["scale"] if self.enabled else 1.0
        if call[0] == "block":
            self._backward(call, a, b, before, weights, scale)
        elif call[0] in UNSCALING_CALLS and a["outcome"] == "ok":
            self.unscaled = [True] * len(self.unscaled)
        for j, (x, y) in enumerate(zip(a["grads"], b["grads"])):
            if x is None or y is None:
                self.ratio[j], self.unscaled[j] = 1.0, True
        return self.ratio

    def _backward(self, call: list[Any], a: dict[str, Any], b: dict[str, Any],
                  before: tuple[list[Any], list[Any]],
                  weights: tuple[list[Any], list[Any]], scale: float) -> None:
        form = call[7]
        scaled = scale if form in SCALED_BACKWARDS else 1.0
        # scaler.backward() gives the true sum: it brings a gradient it unscaled back
        # to the scale first, so that one unscale serves both (ScalerMachine.backward, scaler/_machine.py)
        unscaling = form in UNSCALING_BACKWARDS and a["outcome"] == "ok"
        precision = 1.0 if "float16" in a["dtypes"] + b["dtypes"] else 2.0**-13
        mt, mm = (summed_magnitudes(w, call) for w in weights)
        apart = summed_magnitudes(weights[0], call, [_moved(*w) for w in zip(*weights)])
        for j, (x, y) in enumerate(zip(a["grads"], b["grads"])):
            bx, by = before[0][j], before[1][j]
            there = 0.0 if bx is None or by is None else \
                self.ratio[j] * max(_size(bx), _size(by))
            if unscaling and not self.unscaled[j]:
                there /= scale
            added = 0.0
            # Where something planted is not finite, neither is what the backward added.
            if form != "none" and mt is not None and mm is not None and apart is not None:
                rounding = max(mt[j], mm[j]) * precision
                moved = (apart[j] - mt[j]) / GRAD_RTOL
                added = (1.0 if unscaling else scaled) * (rounding + moved)
            size = 0.0 if x is None or y is None else max(_size(x), _size(y))
            self.ratio[j] = max(1.0, (there + added) / size) if size else 1.0
            self.unscaled[j] = unscaling or (self.unscaled[j] and scaled == 1.0)


def _native_keys(native: Any, state: dict[str, Any]) -> str | None:
    """What is wrong with a framework's own scaler's state_dict() after loading
    ``state`` (None: it holds the same numbers under its own keys)."""
    if native == "empty (a disabled scaler's)" and not state:
        return None
    if not isinstance(native, dict):
        return f"the framework's own scaler {native}"
    wrong = {k: (v, state.get(k)) for k, v in native.items() if state.get(k) != v}
    return f"the framework's own scaler loaded {wrong} (own, ours)" if wrong else None


def compare(seed: int, index: int, t: dict[str, Any], m: dict[str, Any],
            listed: dict[str, Parting], tally: Tally) -> None:
    config, calls = make_program(seed, index)
    tally.programs += 1

    def where(k: int) -> str:
        return (f"cross-backend fuzz seed={seed} index={index}, call {k}: {calls[k]}\n"
                f"config: {config}\ncalls so far: {calls[:k + 1]}\n"
                f"torch:     {_brief(t['calls'][k])}\nmegengine: {_brief(m['calls'][k])}")

    def same(k: int, what: str, a: Any, b: Any, ok: bool | None = None) -> None:
        if not (a == b if ok is None else ok):
            _numbers_part(listed, calls[k])
            raise AssertionError(f"{where(k)}\nthe backends differ in {what}: torch {a!r},"
                                 f" megengine {b!r}")

    if calls:
        same(0, "the starting weights", t["start"]["weights"], m["start"]["weights"])
    assert len(t["calls"]) == len(m["calls"]) == len(calls), (seed, index)
    prev_t, prev_m = t["start"]["weights"], m["start"]["weights"]
    paths = [0.0] * len(prev_t)  # how far each weight tensor has moved so far
    summed = Summed(config, t["start"], m["start"])
    try:
        for k, (a, b) in enumerate(zip(t["calls"], m["calls"])):
            tally.calls += 1
            if a["outcome"] != b["outcome"]:
                _parting(listed, a, b, calls[k], lambda: where(k))
            if a["outcome"] != "ok":
                tally.both_refused += 1
                same(k, "whether the error is unified_amp's", a["unified"], b["unified"])
            else:
                tally.compared += 1
            if calls[k][0] == "load_bad":
                for side, name in ((a, "torch"), (b, "megengine")):
                    if side["outcome"] != "ok" and side["native_refusal"] != "accepted" \
                            and not side["native_type"]:
                        raise AssertionError(
                            f"{where(k)}\non {name}, ours raised {side['outcome']}, which is"
                            f" no {side['native_refusal']} as the framework's own scaler's")
                    if not side["unchanged"]:
                        raise AssertionError(f"{where(k)}\non {name}, a refused load"
                                             f" changed the scaler")
            same(k, "the forward's dtypes", a["dtypes"], b["dtypes"])
            same(k, "autocast's dtype", a.get("autocast_dtype"), b.get("autocast_dtype"))
            same(k, "stats()", a["stats"], b["stats"])
            same(k, "warnings", a["warnings"], b["warnings"])
            same(k, "which parameters have gradients", [g is None for g in a["grads"]],
                 [g is None for g in b["grads"]])
            ratios = summed.after(calls[k], a, b)
            for j, (x, y) in enumerate(zip(a["grads"], b["grads"])):
                used = _grads_used(x, y, ratios[j])
                tally.use("grads", used, f"index {index} call {k}")
                same(k, f"grads[{j}] (rtol {GRAD_RTOL} of {ratios[j]:.3g} times their"
                     f" size, what was summed into them; atol {ATOL})", x, y, used <= 1.0)
            for j, (x, y) in enumerate(zip(a["weights"], b["weights"])):
                paths[j] += max(_moved(x, prev_t[j]), _moved(y, prev_m[j]))
                used = _weights_used(x, y, paths[j])
                tally.use("weights", used, f"index {index} call {k}")
                same(k, f"weights[{j}] (rtol {RTOL} of their size and path, atol {ATOL})",
                     x, y, used <= 1.0)
            same(k, "whether the weights moved (the skip decision)",
                 a["weights"] != prev_t, b["weights"] != prev_m)
            prev_t, prev_m = a["weights"], b["weights"]
            same(k, "what clip_grad_norm returned", a.get("clip"), b.get("clip"),
                 a.get("clip") is b.get("clip") or
                 ("clip" in a and "clip" in b and _close(a["clip"], b["clip"])))
            same(k, "the state dict", a.get("state"), b.get("state"))
            for side, name in ((a, "torch"), (b, "megengine")):
                if "native" in side:
                    tally.loads += 1
                    loaded = side["state"] if side["loaded_from"] == "own" else None
                    if loaded is None:  # megengine loaded torch's dict: the same one
                        loaded = a["state"]
                    problem = _native_keys(side["native"], loaded)
                    if problem:
                        raise AssertionError(f"{where(k)}\non {name}, {problem}")
    except Parted as parted:
        tally.parted[parted.difference.id] = tally.parted.get(parted.difference.id, 0) + 1


def _parting(listed: dict[str, Parting], a: dict[str, Any], b: dict[str, Any],
             call: list[Any], where: Callable[[], str]) -> None:
    """Raises Parted at a listed row, AssertionError otherwise."""
    for side, record in (("torch", a), ("megengine", b)):
        if record["outcome"] == "ok":
            continue
        for p in listed.values():
            if p.refuses == side and p.fragment in record["message"] and \
                    CONDITIONS[p.id](call):
                raise Parted(p)
    raise AssertionError(
        f"{where()}\nthe outcomes differ: torch {a['outcome']}, megengine {b['outcome']}."
        f" This is no deliberate difference listed in docs/DROP_IN.md ({HEADING!r}):"
        f" fix it, or list it there.")


def _brief(record: dict[str, Any]) -> str:
    keep = ("outcome", "message", "dtypes", "autocast_dtype", "stats", "clip", "state",
            "warnings")
    return json.dumps({k: record[k] for k in keep if k in record})


# -- the MegEngine half ---------------------------------------------------------------------
def megengine_python() -> str:
    python = os.environ.get(ENV)
    if not python:
        pytest.skip(f"the cross-backend fuzz compares torch with MegEngine, and this run has"
                    f" no MegEngine interpreter: {ENV} is unset. `make test` and `make fuzz`"
                    f" set it when both backends are selected (BACKENDS=torch, make"
                    f" test-oldest: torch alone, nothing to compare with)")
    path = pathlib.Path(python)
    if not path.is_absolute():
        path = ROOT / path
    if not path.exists():
        raise AssertionError(f"{ENV}={python!r} names no interpreter ({path} does not exist);"
                             f" make env-megengine makes it")
    return str(path)


def run_megengine(python: str, seed: int, programs: list[tuple[int, Any]]) -> list[Any]:
    env = {**os.environ, "UNIFIED_AMP_BACKEND": "megengine",
           "MEGENGINE_LOGGING_LEVEL": "ERROR"}
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "traces.json"
        proc = subprocess.run(
            [python, "-m", "tests.fuzz.portable_runner", str(out)], cwd=ROOT, env=env,
            input=json.dumps({"seed": seed, "programs": programs}), text=True,
            capture_output=True, timeout=60 + 5 * len(programs))
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"the MegEngine runner failed ({python}, exit"
                                 f" {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["traces"]


def _states(trace: dict[str, Any]) -> dict[str, Any]:
    return {str(k): r["state"] for k, r in enumerate(trace["calls"]) if "state" in r}


def load_megengines_states(seed: int, index: int, m: dict[str, Any], tally: Tally) -> None:
    """The state dicts the MegEngine run saved, loaded here by a torch-backend scaler
    and by torch.amp's own: each holds their numbers (the MegEngine run loaded torch's
    dicts into its own scaler and into megengine.amp's mid-run)."""
    config, _ = make_program(seed, index)
    for k, state in _states(m).items():
        world = World(config)
        if state:
            world.scaler.load_state_dict(state)
            assert json.loads(json.dumps(world.scaler.state_dict())) == state, (
                seed, index, k, "a torch-backend scaler did not load MegEngine's dict as is")
        problem = _native_keys(world.native_load(state), state)
        assert problem is None, (seed, index, k, problem)
        tally.loads += 1


# Run in the MegEngine interpreter: loads the torch run's checkpoint (stdin) into
# megengine.amp's scaler and ours, then saves one of its own run (steps and a skip).
MEGENGINE_SIDE = """
import json, sys
import numpy as np, megengine, megengine.amp
import unified_amp as amp
saved = json.loads(sys.stdin.read())
native = megengine.amp.GradScaler()
native.load_state_dict(saved)
ours = amp.GradScaler()
ours.load_state_dict(saved)
loaded = {"native": native.state_dict(), "ours": ours.state_dict()}
w = megengine.Parameter(np.ones(2, np.float32))
gm, scaler = amp.GradManager([w]), amp.GradScaler(init_scale=2.0**10, growth_interval=2)
for bad in (False, True, False, False):
    with gm:
        scaler.backward(gm, (w * (float("inf") if bad else 1.0)).sum())
    gm.zero_grad()
print(json.dumps({**loaded, "saved": scaler.state_dict()}))
"""


def test_checkpoints_move_between_the_backends_and_into_both_frameworks_scalers():
    """A torch run's checkpoint resumes in megengine.amp's own scaler and in ours on
    MegEngine, and a MegEngine run's in torch.amp's and in ours on torch: each holds the
    numbers (and ours the stats() counters) of the run that saved it."""
    python = megengine_python()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_scale=2.0**12, growth_interval=3)
    for bad in (False, True, False, False, True):
        loss = model(torch.ones(2, 3)).sum() * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    saved = scaler.state_dict()
    assert (saved["steps"], saved["skipped_steps"], saved["scale"]) == (5, 2, 2.0**10)
    env = {**os.environ, "UNIFIED_AMP_BACKEND": "megengine",
           "MEGENGINE_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([python, "-c", MEGENGINE_SIDE], input=json.dumps(saved),
                          text=True, capture_output=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    there = json.loads(proc.stdout.strip().splitlines()[-1])
    assert there["ours"] == saved
    assert there["native"] == {k: saved[k] for k in there["native"]}
    assert there["native"]["scale_factor"] == 2.0**10
    theirs = there["saved"]
    assert (theirs["steps"], theirs["skipped_steps"], theirs["scale"]) == (4, 1, 2.0**10)
    native = torch.amp.GradScaler("cpu")
    native.load_state_dict(theirs)
    assert native.state_dict() == {k: theirs[k] for k in native.state_dict()}
    ours = amp.GradScaler()
    ours.load_state_dict(theirs)
    assert ours.state_dict() == theirs


@time_limit(0.5)
def test_the_same_program_gives_the_same_outcome_on_both_backends(fuzz):
    python = megengine_python()
    assert amp.get_backend().name == "torch"
    listed = partings()
    tally = Tally()
    indices = list(fuzz.programs(60))
    for start in range(0, len(indices), CHUNK):
        chunk = indices[start:start + CHUNK]
        ours = {i: run_program(fuzz.seed, i) for i in chunk}
        theirs = run_megengine(python, fuzz.seed, [(i, _states(ours[i])) for i in chunk])
        for i, m in zip(chunk, theirs):
            compare(fuzz.seed, i, ours[i], m, listed, tally)
            load_megengines_states(fuzz.seed, i, m, tally)
    print(f"\ncross-backend fuzz, seed {fuzz.seed}: {tally.line()}", file=sys.stderr)
    assert tally.compared > tally.calls // 3, tally.line()  # the programs do get far
    # and forward blocks with rules in force are among them (portable_programs.block_rules)
    ruled = sum(ruled_blocks(make_program(fuzz.seed, i)[1]) for i in indices)
    assert ruled > 0 or not indices, ruled


def ruled_blocks(calls: list[list[Any]]) -> int:
    """How many of a program's forward blocks have rules in force: an enabled block's
    (f16) own rules, or the first block's in a block nested in it."""
    count = 0
    for call in calls:
        if call[0] != "block":
            continue
        first, second, rules = call[1], call[2], call[8]
        count += first == "f16" and bool(rules["first"])
        count += second in ("nested-f16", "after-f16") and bool(rules["second"])
    return count


def _off_by(trace: dict[str, Any], factor: float) -> dict[str, Any]:
    """A copy of ``trace`` whose gradients are all ``factor`` times the recorded ones:
    what a backend whose scale or unscale is off by that factor records."""
    other = json.loads(json.dumps(trace))
    for record in other["calls"]:
        record["grads"] = [None if g is None else
                           [v if isinstance(v, str) else v * factor for v in g]
                           for g in record["grads"]]
    return other


@time_limit(0.2)
def test_the_tolerance_still_catches_gradients_5_percent_off(fuzz):
    """The gradients' tolerance follows what was summed into them (Summed), which is
    larger than the gradients: it must stay tight enough that gradients 5% off, a
    scale or unscale gone wrong on one backend, part the programs (GRAD_RTOL says
    how many did with a backend broken so). A program compared with itself never
    fails (nothing in the comparison is random)."""
    listed, reached, caught, missed = partings(), 0, 0, []
    for i in fuzz.programs(60):
        trace = run_program(fuzz.seed, i)
        compare(fuzz.seed, i, trace, json.loads(json.dumps(trace)), listed, Tally())
        if not any(g is not None and _size(g) > 0.1
                   for record in trace["calls"] for g in record["grads"]):
            continue
        reached += 1
        try:
            compare(fuzz.seed, i, trace, _off_by(trace, 0.95), listed, Tally())
        except AssertionError as e:
            assert "the backends differ in grads" in str(e), str(e)
            caught += 1
        else:
            missed.append(i)
    assert reached and caught >= 0.95 * reached, (
        f"seed {fuzz.seed}: gradients 5% off parted only {caught} of the {reached}"
        f" programs whose gradients reach 0.1 (missed: {missed})")
