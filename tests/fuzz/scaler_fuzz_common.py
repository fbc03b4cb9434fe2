"""What the scaler fuzzes share: the list of deliberate differences (read from
docs/DROP_IN.md, the one place it is written), each program's random source, and the
side-by-side runner that compares two worlds call by call.

A program is a list of calls, rebuilt from (seed, index) alone. Each call runs on the
native world, then on ours. Where both go on, every state is compared byte for byte;
where both refuse, ours must raise an instance of the native's error type and the
states must be the same, and the program ends there (a refusal may leave hidden state
behind on either side); where one
side refuses and the other goes on, the refusal's message must match a row of
DROP_IN.md's table of deliberate differences, and the program ends there (the worlds
have parted). Anything else fails, naming the seed, the index and the calls so far.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

DROP_IN = pathlib.Path(__file__).resolve().parents[2] / "docs" / "DROP_IN.md"
HEADING = "## Deliberate differences, call by call"


@dataclass(frozen=True)
class Difference:
    id: str
    framework: str  # "torch", "megengine" or "both"
    refuses: str  # "ours", "native" or "neither" (the numbers differ, on purpose)
    fragment: str  # a piece of the refusing side's message ("" for "neither")


def table(heading: str, width: int) -> list[tuple[str, list[str], str]]:
    """The rows of DROP_IN.md's table under ``heading`` that start with an id in
    backticks: (id, its ``width`` cells, the first backticked piece of the last cell)."""
    text = DROP_IN.read_text()
    if heading not in text:
        raise AssertionError(f"{DROP_IN} has no section {heading!r}: the fuzz reads its"
                             f" list of deliberate differences from there")
    rows = []
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != width:
            raise AssertionError(f"DROP_IN.md: a row of {heading!r} needs {width} cells:"
                                 f" {line!r}")
        fragment = re.findall(r"`([^`]*)`", cells[-1])
        rows.append((cells[0].strip("`"), cells, fragment[0] if fragment else ""))
    return rows


def differences() -> dict[str, Difference]:
    """DROP_IN.md's table under HEADING: | id | framework | refuses | call | message |."""
    return {ident: Difference(ident, cells[1], cells[2], fragment)
            for ident, cells, fragment in table(HEADING, 5)}


def misuse(rng: random.Random, it: list[Any], out_of_place: Callable[[], Any]) -> None:
    """Now and then drops, repeats or moves a call of one iteration ``it``, or inserts
    one out of place (``out_of_place()``): misuse, drawn from ``rng``."""
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        j = rng.randrange(len(it))
        action = rng.choice(["drop", "repeat", "move", "insert"])
        if action == "insert":
            it.insert(j, out_of_place())
        elif action == "drop":
            it.pop(j)
        elif action == "repeat":
            it.insert(j, it[j])
        else:
            it.insert(rng.randrange(len(it)), it.pop(j))


def time_limit(seconds_per_program: float) -> Any:
    """pytest-timeout's limit for a fuzz test: the suite's 300 s, or in a long run
    (make fuzz PROGRAMS=N) four times what N programs take here, so a long run is not cut
    short while a hang still fails with the test's name."""
    n = int(os.environ.get("UNIFIED_AMP_FUZZ_PROGRAMS") or 0)
    return pytest.mark.timeout(max(300, int(4 * n * seconds_per_program)))


def rng_for(seed: int, index: int, salt: str) -> random.Random:
    """The program's random source: (seed, index) alone decide it."""
    return random.Random(f"{salt}:{seed}:{index}")


class Parted(Exception):
    """The worlds parted at a listed deliberate difference: the program ends there."""

    def __init__(self, difference: Any):  # a Difference, or the portable fuzz's Parting
        super().__init__(difference.id)
        self.difference = difference


@dataclass
class Tally:
    programs: int = 0
    calls: int = 0
    compared: int = 0  # calls after which both worlds went on and were compared
    both_refused: int = 0  # programs that ended at a call both refused
    parted: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        parted = ", ".join(f"{k} {v}" for k, v in sorted(self.parted.items())) or "none"
        return (f"{self.programs} programs, {self.calls} calls, {self.compared} compared"
                f" byte for byte, {self.both_refused} ended at a call both refused; parted at:"
                f" {parted}")


def run_call(framework: str, table: dict[str, Difference], native: Callable[[], Any],
             ours: Callable[[], Any], where: Callable[[], str]) -> bool:
    """Runs one call on both worlds. True if both went on (compare them next); False if
    both refused; raises Parted at a listed difference, AssertionError otherwise."""
    native_error = ours_error = None
    try:
        native()
    except Exception as e:  # noqa: BLE001 -- any refusal is an outcome to compare
        native_error = e
    try:
        ours()
    except Exception as e:  # noqa: BLE001
        ours_error = e
    if native_error is None and ours_error is None:
        return True
    if native_error is not None and ours_error is not None:
        # The error type must match, unless the native's refusal is one of its own
        # listed failures (megengine.amp's TypeError from inside _check_non_finite)
        if not isinstance(ours_error, type(native_error)) and \
                _listed(table, framework, "native", str(native_error)) is None:
            raise AssertionError(
                f"{where()}\nboth refused, but ours raised {type(ours_error).__name__}"
                f" ({ours_error}), which is no {type(native_error).__name__} as the"
                f" native's ({native_error})")
        return False
    side, error = ("ours", ours_error) if ours_error is not None else ("native", native_error)
    message = str(error)
    listed = _listed(table, framework, side, message)
    if listed is not None:
        raise Parted(listed)
    raise AssertionError(
        f"{where()}\nonly {side} refused, with {type(error).__name__}: {message}\n"
        f"This is no deliberate difference listed in docs/DROP_IN.md"
        f" ({HEADING!r}): fix the scaler, or list it there.")


def _listed(table: dict[str, Difference], framework: str, side: str,
            message: str) -> Difference | None:
    for d in table.values():
        if d.framework in (framework, "both") and d.refuses == side and d.fragment \
                and d.fragment in message:
            return d
    return None


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first key whose value differs between two snapshots, or None."""
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key
    return None
