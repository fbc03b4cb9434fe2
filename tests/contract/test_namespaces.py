"""Coverage generated from the frameworks' namespaces, not from a list someone wrote
(SPEC §3): every public callable of MegEngine's ``megengine.functional`` (all its
submodules) and every ``megengine.Tensor`` method and operator, in-place ones too, is a
spelling of a row of the contract or is listed with the reason it has none
(unified_amp/dtype_contract/pairing.py); every public callable of torch's ``torch``,
``torch.nn.functional``, ``torch.linalg``, ``torch.special`` and ``torch.Tensor`` is a
spelling of a row or one the recorded torch had (a new torch's new op fails until it is
decided on). And every spelling of every row is proved as the row's first is: its
output dtype under ``amp.autocast`` for a float32 and a low-precision input.

Each backend's run enumerates its own framework; fake CUDA and compiled code prove the
torch spellings in tests/native.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import unified_amp as amp
from unified_amp.dtype_contract import pairing, torch_public

from .dtype_table import ROWS, call_of, dtypes, inputs, round_through, row, spelling_calls
from .test_dtype_table import UNSUPPORTED, cell, want

LOWS = ["float16", "bfloat16"]


def _unwrapped(obj):
    return getattr(obj, "__unified_amp_wraps__", obj)


def _public(module, names, prefix, out, keep):
    for name in names:
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if obj is None or inspect.isclass(obj) or inspect.ismodule(obj) or not callable(obj):
            continue
        if keep(obj):
            out.setdefault(f"{prefix}.{name}", obj)


def megengine_callables() -> dict[str, object]:
    """Every public callable of megengine.functional and its submodules (a name without
    a leading underscore, in the module's ``__all__`` or whose function MegEngine
    defines: not typing's or functools'; so deprecated aliases such as
    ``F.elemwise.hsigmoid``, outside ``__all__``, are in), and megengine.Tensor's methods
    and operators (those not object's own), by spelling ("F.nn.relu",
    "Tensor.__itruediv__")."""
    import megengine
    import megengine.functional as F

    modules = {"megengine.functional": F}
    for info in pkgutil.walk_packages(F.__path__, "megengine.functional."):
        modules[info.name] = importlib.import_module(info.name)
    out: dict[str, object] = {}
    for name, module in sorted(modules.items()):
        prefix = "F" + name[len("megengine.functional"):]
        listed = set(getattr(module, "__all__", ()))
        _public(module, dir(module), prefix, out,
                lambda obj, name=None: (getattr(obj, "__module__", None) or ""
                                        ).startswith("megengine."))
        _public(module, sorted(listed), prefix, out, lambda obj: True)
    for name in dir(megengine.Tensor):
        obj = getattr(megengine.Tensor, name)
        if (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))) \
                or not callable(obj) or inspect.isclass(obj) or obj is getattr(object, name, None):
            continue
        out[f"Tensor.{name}"] = obj
    return out


def torch_callables() -> dict[str, object]:
    """Every public callable of torch, torch.nn.functional, torch.linalg, torch.special,
    and torch.Tensor's methods and operators (those not object's own), by spelling."""
    import torch
    import torch.nn.functional as F

    out: dict[str, object] = {}
    for prefix, module in (("torch", torch), ("F", F), ("torch.linalg", torch.linalg),
                           ("torch.special", torch.special)):
        _public(module, dir(module), prefix, out, lambda obj: True)
    for name in dir(torch.Tensor):
        obj = getattr(torch.Tensor, name, None)
        if (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))) \
                or obj is None or not callable(obj) or inspect.isclass(obj) \
                or obj is getattr(object, name, None):
            continue
        out[f"Tensor.{name}"] = obj
    return out


def classify_megengine() -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(spelling -> row name, spelling -> no-row reason, unclassified spellings)."""
    from unified_amp.backends.megengine_backend.dtype_contract import resolve

    found = megengine_callables()
    reasons = pairing.no_row()
    by_object: dict[int, str] = {}
    for r in ROWS:
        for s in r.megengine:
            by_object.setdefault(id(_unwrapped(resolve(s)[2])), r.name)
    spelled = {s: r.name for r in ROWS for s in r.megengine}
    reason_of_object = {id(_unwrapped(found[s])): reason for s, reason in reasons.items()
                        if s in found}
    in_row, without, unclassified = {}, {}, []
    for s, obj in found.items():
        key = id(_unwrapped(obj))
        if s in spelled or key in by_object:
            in_row[s] = spelled.get(s) or by_object[key]
        elif s in reasons or key in reason_of_object:
            without[s] = reasons.get(s) or reason_of_object[key]
        else:
            unclassified.append(s)
    return in_row, without, unclassified


def test_every_public_callable_is_a_row_or_has_a_reason(kit):
    """MegEngine: each public callable is a row's spelling (or the same object as one)
    or is listed with its reason; every listed name exists. torch: each is a row's
    spelling or the recorded torch's (``torch_public``)."""
    if kit.name == "megengine":
        in_row, without, unclassified = classify_megengine()
        assert not unclassified, (
            f"MegEngine callables neither in a row nor listed with a reason in"
            f" unified_amp/dtype_contract/pairing.py: {sorted(unclassified)}")
        stale = sorted(set(pairing.no_row()) - set(megengine_callables()))
        assert not stale, f"pairing.NO_ROW names what MegEngine lacks: {stale}"
        found = megengine_callables()
        objects = {id(_unwrapped(o)) for o in found.values()}
        row_objects = {id(_unwrapped(found[s])) for s in in_row}
        print(f"\nMegEngine: {len(found)} public spellings, {len(objects)} distinct"
              f" callables: {len(in_row)} spellings ({len(row_objects)} callables) in a row,"
              f" {len(without)} ({len(objects - row_objects)}) listed without")
        return
    import torch

    from unified_amp.backends.torch_backend.dtype_contract import resolve
    from unified_amp.dtype_contract.row import release

    found = torch_callables()

    spelled = {s for r in ROWS for s in r.torch}
    objects = {id(resolve(s)) for s in spelled if resolve(s) is not None}
    new = sorted(s for s, obj in found.items() if s not in spelled and id(obj) not in objects
                 and s not in torch_public.WITHOUT_ROW)
    if release(torch.__version__) < release(torch_public.TORCH):
        # an older torch (make test-oldest): what the recorded torch lacks are ops it
        # dropped since, not new ones (the per-spelling tests check what it has)
        return
    assert not new, (
        f"torch callables the recorded torch {torch_public.TORCH} lacked and no row"
        f" spells: {new}; give each a row, or add it to"
        " unified_amp/dtype_contract/torch_public.py")


def test_the_adapter_reaches_every_spelling_of_the_rows_it_keeps(kit):
    """MegEngine: where the adapter wraps a row's function, every public binding of that
    function in MegEngine's namespaces holds the wrapper, not the original (a deprecated
    alias or a re-export under the same object would otherwise keep MegEngine's own
    rule). torch: every spelling of a row the mode keeps on the CPU is one the mode
    handles (its function is a key of the mode's handlers)."""
    if kit.name == "torch":
        from unified_amp.backends.torch_backend import dtype_contract as adapter

        missed = sorted(s for r in ROWS if "cpu" in adapter.handled_devices(r)
                        for s in r.torch if adapter.resolve(s) is not None
                        and adapter.HANDLERS.get(adapter.resolve(s)) is None)
        assert not missed, f"spellings the mode does not see: {missed}"
        return
    with amp.autocast(dtype="float16"):
        pass  # installs the wrappers
    from unified_amp.backends.megengine_backend.dtype_contract import resolve

    wrapped = {id(_unwrapped(resolve(s)[2])) for r in ROWS for s in r.megengine
               if hasattr(resolve(s)[2], "__unified_amp_wraps__")}
    bare = sorted(s for s, obj in megengine_callables().items()
                  if id(_unwrapped(obj)) in wrapped and not hasattr(obj, "__unified_amp_wraps__"))
    assert not bare, f"bindings that hold MegEngine's own function: {bare}"


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("name", [r.name for r in ROWS])
def test_every_spelling_of_a_row_gives_the_rows_dtype(kit, device, name, low):
    """Not only the row's first spelling: each of its spellings on this framework, with
    its own sample call (pairing.call_for), gives the contract's dtype for every input
    kind of the row."""
    r = row(name)
    if call_of(r, kit.name) is None or (kit.name, device, low) in UNSUPPORTED:
        return  # tests/contract/test_dtype_table.py checks the absence / the refusal
    inp = inputs()
    wrong = {}
    for spelling, call in spelling_calls(r, kit.name):
        for kind in r.kinds():
            got, detail = cell(kit, call, device, low, kind, inp)
            wanted = want(r, kind, low, call, device)
            if got != wanted:
                wrong[(spelling, kind)] = (got, wanted, str(detail)[:200] if got == "error"
                                           else "")
    assert not wrong, wrong


if __name__ == "__main__":  # writes unified_amp/dtype_contract/torch_public.py
    import pathlib
    import textwrap

    import torch

    from unified_amp.backends.torch_backend.dtype_contract import resolve

    spelled = {s for r in ROWS for s in r.torch}
    objects = {id(resolve(s)) for s in spelled if resolve(s) is not None}
    groups: dict[str, list[str]] = {}
    for s, obj in sorted(torch_callables().items()):
        if s not in spelled and id(obj) not in objects:
            head, _, name = s.rpartition(".")
            groups.setdefault(head, []).append(name)
    path = pathlib.Path(pairing.__file__).with_name("torch_public.py")
    text = path.read_text()
    head = text[:text.index("TORCH = ")]
    lines = [f"TORCH = {torch.__version__.split('+')[0]!r}", "",
             "_BY_NAMESPACE: dict[str, str] = {"]
    for namespace, names in sorted(groups.items()):
        lines += [f'    "{namespace}": """',
                  textwrap.fill(" ".join(names), 88, initial_indent=" " * 8,
                                subsequent_indent=" " * 8), '    """,']
    lines += ["}", "WITHOUT_ROW: frozenset[str] = frozenset(",
              '    f"{namespace}.{name}" for namespace, names in _BY_NAMESPACE.items()',
              "    for name in names.split())", ""]
    path.write_text(head + "\n".join(lines))
    print(f"wrote {path}: {sum(map(len, groups.values()))} callables")


@pytest.mark.parametrize("low", LOWS)
def test_an_in_place_operator_changes_its_receiver_in_the_receivers_dtype(kit, device, low):
    """``x /= y`` inside the block changes ``x`` itself (an alias sees it), in ``x``'s
    dtype, with the values of ``x / y``: torch's in-place operators cannot change a
    tensor's dtype; MegEngine's rebind the receiver to the result, which its autocast
    computes in float32 for / and ** (issue 43)."""
    if (kit.name, device, low) in UNSUPPORTED:
        return
    r = row("in-place arithmetic")
    inp = {k: round_through(v, low) for k, v in inputs().items()}
    wrong = {}
    for spelling, call in spelling_calls(r, kit.name):
        op = spelling.rpartition(".")[2]
        reference = getattr(inp["pos"].astype(np.float64), op.replace("__i", "__", 1))(
            inp["big"].astype(np.float64))
        for kind in r.kinds():
            types = dtypes(call, kind, low)
            with kit.on_device(device):
                receiver = kit.tensor(inp["pos"], device, types["pos"])
                value = kit.tensor(inp["big"], device, types["big"])
                alias = receiver
                with amp.autocast(dtype=low, device=device):
                    receiver = getattr(receiver, op)(value)
                got = (receiver is alias, kit.dtype_name(alias))
                if got != (True, types["pos"]) or not np.allclose(
                        kit.numpy(alias), reference, rtol=6e-2, atol=6e-2):
                    wrong[(spelling, kind)] = got
    assert not wrong, wrong
