"""A block's own rules: ``amp.autocast(rules={op: kind})``, checked here, framework-free.

A rule names an op and one of the contract's rule kinds. The op is a row of the dtype
contract (its name, ``"softmax"``), a framework function (``torch.softmax``,
``megengine.functional.softmax``), a ``torch.library`` custom op, or a Python function
of the program's own. Each adapter resolves the keys to the callables its framework
calls and applies the kinds (docs/API.md, "Your own rules"); this module checks what
the user wrote and says what the kinds mean, once for both.
"""

from __future__ import annotations

import difflib
import types
from typing import Any, Mapping

# The contract's rule kinds (dtype_contract.RULES, which a test holds this to: the table
# is imported only by the first block that names a row, not by ``import unified_amp``).
KINDS = ("low", "float32", "promote", "input", "refuse")
_KIND_LIST = ", ".join(map(repr, KINDS))
_ACCEPTED = (
    "a row of docs/DTYPE_CONTRACT.md by name ('softmax'), a framework function"
    " (torch.softmax, F.softmax, megengine.functional.softmax), a torch.library custom op,"
    " or a Python function of your own")

# What each kind does to a call inside an enabled block: the floating inputs go to this
# dtype, the op runs with autocast off, and its floating outputs come back in it.
MEANING = {
    "low": "the block's low dtype",
    "float32": "float32",
    "promote": "the widest of its floating inputs",
    "input": "the dtype of its first floating input",
    "refuse": "an error",
}


def describe(key: Any) -> str:
    """How an error names a rule's key: ``'softmax'``, ``torch.softmax``, ``attention``."""
    if isinstance(key, str):
        return repr(key)
    module = getattr(key, "__module__", None) or ""
    name = getattr(key, "__qualname__", None) or getattr(key, "__name__", None)
    if name is None:
        return repr(key)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def check(rules: Any) -> tuple[tuple[Any, str], ...]:
    """``rules`` as (key, kind) pairs, row names first, so that a function of a row
    named in the same block wins over its row; raises on anything else.

    Raises:
        TypeError: ``rules`` is not a mapping, or a key is neither a string nor a
            function.
        ValueError: a kind that is not one of ``KINDS``, or a string that names no row.
    """
    if rules is None:
        return ()
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"autocast rules must be a dict of op -> rule kind, e.g."
            f" {{'softmax': 'low'}}; got {type(rules).__name__} {rules!r}.")
    rows, functions = [], []
    for key, kind in rules.items():
        if not (isinstance(kind, str) and kind in KINDS):
            raise ValueError(
                f"autocast rules: the rule for {describe(key)} must be one of"
                f" {_KIND_LIST}; got {kind!r}.")
        if isinstance(key, str):
            names = _row_names()
            if key not in names:
                close = difflib.get_close_matches(key, list(names), n=3)
                hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"autocast rules: {key!r} names no row of the dtype contract.{hint}"
                    f" A rule's key is {_ACCEPTED}.")
            rows.append((key, kind))
        elif isinstance(key, type) or not callable(key) or not (
                is_own_function(key) or framework_of(key)):
            raise TypeError(
                f"autocast rules: {describe(key)} ({type(key).__name__}) is no op a rule"
                f" can name: a rule's key is {_ACCEPTED}. A module's precision is set"
                f" with amp.keep_float32(module).")
        else:
            functions.append((key, kind))
    return tuple(rows + functions)


_ROW_NAMES: dict[str, None] = {}  # the table's, immutable once read


def _row_names() -> dict[str, None]:
    """The table's row names, in its order (read on the first rule that names a row)."""
    if not _ROW_NAMES:
        from .dtype_contract import ROWS

        _ROW_NAMES.update(dict.fromkeys(r.name for r in ROWS))
    return _ROW_NAMES


def framework_of(key: Any) -> str:
    """"torch" or "megengine" for one of that framework's functions, methods or ops
    (a ``torch.library`` custom op is torch's), else ""."""
    # (A Python function's own module only: dynamo 2.7 cannot trace the function type's
    # __module__ descriptor, and a block may be made inside a compiled function.)
    owners = (key,) if isinstance(key, types.FunctionType) else (
        key, getattr(key, "__objclass__", None), type(key))
    for owner in owners:
        module = str(getattr(owner, "__module__", None) or "").partition(".")[0]
        if module in ("torch", "megengine"):
            return module
    return ""


def is_own_function(key: Any) -> bool:
    """A Python function that is neither framework's: a call to it is only seen where
    a name holds the adapter's wrapper, so the adapter swaps one in. (Any other
    callable -- a builtin, a class, another library's function -- is refused: swapping
    it into every binding would change that library for the whole process.)"""
    return isinstance(key, types.FunctionType) and not framework_of(key)


def foreign(key: Any, framework: str) -> bool:
    """Whether ``key`` is the other framework's function (``torch.softmax`` in a block
    on MegEngine): it can never be called there, so it is refused, not ignored."""
    return framework_of(key) not in ("", framework)


def foreign_error(key: Any, framework: str) -> ValueError:
    return ValueError(
        f"autocast rules: {describe(key)} is not a {framework} function, and the active"
        f" backend is {framework}. Name the op by its row of docs/DTYPE_CONTRACT.md"
        f" (the same key on both frameworks), or by {framework}'s own function.")


def refusal(name: str) -> str:
    """The error of a call that a ``"refuse"`` rule of the block refuses."""
    return (f"amp.autocast: {name} is refused inside this block by its rules"
            f" ({{...: 'refuse'}}). Call it outside the block, inside"
            f" amp.autocast(enabled=False), or give it another rule kind.")
