"""The dtype contract however a function was imported (issue 43, 3).

``from megengine.functional import softmax`` at the top of a module binds the function
object before any ``amp.autocast`` block ran, often before ``import unified_amp``. Each
function the adapters act on, bound that way -- ``from <namespace> import name`` from each
namespace a row spells it in and from the module that defines it, and
``import <namespace> as F`` then ``F.name`` -- gives inside a block exactly what the call
through the namespace gives, the contract's dtype for the row's own sample call. A
fresh interpreter binds them before ``import unified_amp`` and, in a second run, after
the backend loaded but before the first block: the two moments a user's imports happen.

Each secondary spelling runs the row's sample call with its own name put in; where its
signature does not fit that call (torch's ``torch.stft`` for the FFT row), the namespace
and the early binding are checked to raise alike (proving such a spelling's dtype is
the coverage tests' part, not this one's).

Module globals, class and instance attributes, closures, defaults and the locals of the
functions waiting on the first block's stack get the contract; where no binding can be
replaced (a partial, a list, a tuple or a dict holding the function, a local variable
of another thread), ``amp.ContractWarning`` says so once, naming
the function and the holder. On torch the contract is a function mode, which sees every
call whatever object it came through: every holder gets it there and nothing warns.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from .dtype_table import ROWS, call_of, expected, row

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOW = "float16"

# Where a table spelling's head lives ("F.nn.softmax" is megengine.functional.nn.softmax).
NAMESPACES = {"torch": {"F": "torch.nn.functional", "torch": "torch"},
              "megengine": {"F": "megengine.functional"}}


def _pattern(spelling: str) -> str:
    return r"(?<![\w.])" + re.escape(spelling) + r"(?=\()"


def _module_spellings(r, framework: str) -> list[str]:
    return [s for s in getattr(r, framework) if not s.startswith("Tensor.")]


def _alias(module: str, name: str) -> str:
    return f"{module.replace('.', '_')}__{name}"


def _bindings(framework: str, spelling: str) -> list[tuple[str, str]]:
    """(import statement, the name it binds) for each early binding of ``spelling``:
    from the namespace the table spells it in, and from the module that defines it."""
    head, _, rest = spelling.partition(".")
    *path, name = rest.split(".")
    namespace = ".".join([NAMESPACES[framework][head], *path])
    obj = getattr(importlib.import_module(namespace), name)
    out = [(f"from {namespace} import {name} as {_alias(namespace, name)}",
            _alias(namespace, name))]
    home = getattr(obj, "__module__", None)
    try:
        defined_there = home not in (None, namespace) and \
            getattr(importlib.import_module(home), name, None) is obj
    except ImportError:  # torch's builtins name C modules no import reaches
        defined_there = False
    if defined_there:
        out.append((f"from {home} import {name} as {_alias(home, name)}", _alias(home, name)))
    return out


def early_cases(framework: str) -> tuple[str, list[dict]]:
    """The early module's source, and one case per (row, spelling, binding, input kind):
    the call through the namespace and the same call through the early binding.

    The spellings are every module-level spelling of every row the framework has a call
    for: what the adapters wrap (MegEngine) or their function mode acts on (torch) is
    among them (``test_the_cases_cover_every_function_the_adapter_acts_on``)."""
    lines = [f"import {NAMESPACES[framework]['F']} as F_early"]
    cases, seen = [], set()
    for r in ROWS:
        call = call_of(r, framework)
        spellings = _module_spellings(r, framework)
        if call is None or not spellings:
            continue
        used = [s for s in spellings if re.search(_pattern(s), call)]
        assert used, (f"{r.name!r}: its {framework} call {call!r} names none of its"
                      f" spellings {spellings}")
        for spelling in spellings:
            through = re.sub(_pattern(used[0]), spelling, call)
            early = [(statement, re.sub(_pattern(spelling), name, through))
                     for statement, name in _bindings(framework, spelling)]
            head = spelling.partition(".")[0]
            if head == "F":  # import megengine.functional as F_early; F_early.softmax
                early.append(("", re.sub(_pattern(spelling), "F_early" + spelling[1:],
                                         through)))
            for statement, early_call in early:
                if statement and statement not in lines:
                    lines.append(statement)
                if (r.name, early_call) in seen:  # F.conv3d is F.nn.conv3d's
                    continue
                seen.add((r.name, early_call))
                for kind in r.kinds():
                    cases.append({"row": r.name, "spelling": spelling, "kind": kind,
                                  "binding": statement or "import ... as F_early",
                                  "through": through, "early": early_call,
                                  "sample": through == call})
    return "\n".join(lines) + "\n", cases


# The child: binds the early module (a real file, imported), then runs every case's two
# calls inside amp.autocast and prints what each gave.
_CHILD = textwrap.dedent("""
    import json, sys
    spec = json.loads(sys.stdin.read())
    sys.path.insert(0, spec["dir"])
    if spec["when"] == "before import unified_amp":
        import early_bindings
    import unified_amp as amp
    amp.get_backend()
    if spec["when"] == "before the first block":
        import early_bindings
    from tests.contract.dtype_table import inputs
    from tests.kits import load_kit

    kit = load_kit(amp.get_backend().name)
    inp = inputs()
    scope = vars(early_bindings)

    def outcome(call, kind):
        try:
            with amp.autocast(dtype=spec["low"], device=spec["device"]):
                out = kit.run_call(call, spec["device"], spec["low"], kind, inp, scope)
            values = kit.numpy(out)
            kit.synchronize()
        except Exception as exc:
            return ["error", type(exc).__name__]
        return [kit.dtype_name(out), values.tobytes().hex()]

    found = []
    with kit.on_device(spec["device"]):
        for case in spec["cases"]:
            found.append([outcome(case["through"], case["kind"]),
                          outcome(case["early"], case["kind"])])
    print("EARLY " + json.dumps(found))
""")


def run_child(kit, device, tmp_path, when, source, cases):
    (tmp_path / "early_bindings.py").write_text(source)
    spec = {"dir": str(tmp_path), "when": when, "low": LOW, "device": device,
            "cases": cases}
    env = dict(os.environ, UNIFIED_AMP_BACKEND=kit.name, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(spec),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("EARLY ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("EARLY "):])


@pytest.mark.parametrize("when", ["before import unified_amp", "before the first block"])
def test_a_function_bound_early_gives_what_the_namespace_gives(kit, device, tmp_path, when):
    source, cases = early_cases(kit.name)
    found = run_child(kit, device, tmp_path, when, source, cases)
    parted: dict[str, list] = {}
    wrong = []
    for case, (through, early) in zip(cases, found):
        where = (case["row"], case["binding"], case["kind"])
        if early != through:
            parted.setdefault(case["binding"], []).append(
                (case["row"], case["kind"], f"namespace {through[0]}, early {early[0]}"
                 + (" (values)" if early[0] == through[0] else "")))
        r = row(case["row"])
        if case["sample"]:
            # a row that refuses, or refuses a low-precision input (Row.refuse_low)
            refuses = r.rule == "refuse" or (r.refuse_low and case["kind"] != "float32")
            wanted = "error" if refuses else expected(r, case["kind"], LOW, case["through"])
            if through[0] != wanted:
                wrong.append((*where, through[0], wanted))
    bindings = {case["binding"] for case in cases}
    assert not parted, (f"{len(parted)} of {len(bindings)} early bindings give another"
                        f" outcome than the namespace: {json.dumps(parted, indent=1)}")
    assert not wrong, f"sample calls not the contract's dtype: {wrong}"


def test_the_cases_cover_every_function_the_adapter_acts_on(kit):
    """The early module binds each module-level function the adapter wraps (MegEngine)
    or its modes act on (torch), so no function of the contract is left out."""
    acted_on = _adapter_functions(kit.name)  # first: bound after it, a name holds a wrapper
    source, _ = early_cases(kit.name)
    scope: dict = {}
    exec(source, scope)  # noqa: S102 -- the module the test wrote
    bound = {id(getattr(v, "__unified_amp_wraps__", v)) for v in scope.values()}
    assert acted_on, "the adapter acts on no module-level function"
    missing = [f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)}"
               for fn in acted_on if id(fn) not in bound]
    assert not missing, missing


def _adapter_functions(framework: str) -> list:
    if framework == "megengine":
        from unified_amp.backends.megengine_backend import dtype_contract as adapter

        import unified_amp as amp

        with amp.autocast(dtype=LOW):  # installs the wrappers
            pass
        return [getattr(w, "__unified_amp_wraps__") for _, w in adapter.module_functions()]
    from unified_amp.backends.torch_backend import dtype_contract as adapter

    return [fn for fn in [*adapter.HANDLERS, *adapter.PROMOTED]
            if getattr(fn, "__qualname__", "").partition(".")[0] not in ("Tensor",
                                                                         "TensorBase")]


# -- where the function is held --------------------------------------------------------

_HOLDERS = """\
import functools
import types

from {functional} import softmax


def make_closure():
    act = softmax

    def head(x):
        return act(x, -1)
    return head


def with_default(x, act=softmax):
    return act(x, -1)


def with_keyword_default(x, *, act=softmax):
    return act(x, -1)


class Head:
    act = softmax


INSTANCE = types.SimpleNamespace(act=softmax)
CLOSURE = make_closure()
PARTIAL = functools.partial(softmax)
ACTS = {{"softmax": softmax}}
LIST = [softmax]
PAIR = (softmax,)
"""

# Each way of holding the function, called as the program would.
_CALLS = {
    "module global": "holders.softmax(x, -1)",
    "script global": "script_softmax(x, -1)",
    "closure": "holders.CLOSURE(x)",
    "default argument": "holders.with_default(x)",
    "keyword default": "holders.with_keyword_default(x)",
    "class attribute": "holders.Head.act(x, -1)",
    "instance attribute": "holders.INSTANCE.act(x, -1)",
    "partial": "holders.PARTIAL(x, -1)",
    "dict": "holders.ACTS['softmax'](x, -1)",
    "list": "holders.LIST[0](x, -1)",
    "tuple": "holders.PAIR[0](x, -1)",
    "local variable": "local_call(x)",
    "module imported after the first block": "late.act(x, -1)",
}
# Where MegEngine's contract cannot replace the binding: what the warning names.
_UNREACHABLE = {
    "partial": "a functools.partial bound to holders.PARTIAL",
    "dict": "a dict bound to holders.ACTS",
    "list": "a list bound to holders.LIST",
    "tuple": "a tuple bound to holders.PAIR",
    "another thread's local variable": "the local variable 'act' of waiting()",
}

_HOLDERS_CHILD = textwrap.dedent("""
    import json, sys, threading, warnings
    spec = json.loads(sys.stdin.read())
    sys.path.insert(0, spec["dir"])
    import holders
    from holders import softmax as script_softmax  # a global of the running script
    import unified_amp as amp

    class Raising:  # a proxy in sys.modules whose every attribute lookup raises
        def __getattribute__(self, name):
            raise RuntimeError("outside of its context")

    if amp.get_backend().name == "megengine":  # torch's own lazy imports trip over it
        sys.modules["raising_proxy"] = Raising()
    from tests.contract.dtype_table import inputs
    from tests.kits import load_kit

    kit = load_kit(amp.get_backend().name)
    x = kit.tensor(inputs()["x"], spec["device"], spec["low"])

    def local_call(x):
        act = holders.LIST[0]  # the original, held by this running function
        with amp.autocast(dtype=spec["low"], device=spec["device"]):
            return act(x, -1)

    ready, done = threading.Event(), threading.Event()

    def waiting():  # another thread, holding the original while the first block runs
        act = holders.LIST[0]
        ready.set()
        done.wait()
        return act

    thread = threading.Thread(target=waiting)
    thread.start()
    ready.wait()

    got, said = {}, []
    with kit.on_device(spec["device"]):
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            got["local variable"] = kit.dtype_name(local_call(x))
        done.set()
        thread.join()
        import late  # binds the original it copies out of holders.LIST
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            with amp.autocast(dtype=spec["low"], device=spec["device"]):
                for name, call in spec["calls"].items():
                    if name != "local variable":
                        got[name] = kit.dtype_name(eval(call))
    kit.synchronize()
    print("HOLDERS " + json.dumps({
        "dtypes": got,
        "first": [[w.category.__name__, str(w.message)] for w in first],
        "again": [[w.category.__name__, str(w.message)] for w in again]}))
""")


def test_a_function_held_where_no_binding_can_be_replaced_is_named_once(kit, device,
                                                                         tmp_path):
    """Bound before ``import unified_amp``: module globals, closures, defaults, class and
    instance attributes, and the local variables of the function the first block runs
    in, get the contract; a partial, a dict, a list, a tuple and another thread's local
    variable keep MegEngine's own rule, and the first block says so once for each,
    naming the function and the holder (torch: every one gets the contract, nothing is
    said). A module imported later that copies the function out of such a holder gets
    the contract from the next outermost block. A proxy in ``sys.modules`` whose
    attribute lookups raise (MegEngine's run) fails nothing."""
    functional = NAMESPACES[kit.name]["F"]
    (tmp_path / "holders.py").write_text(_HOLDERS.format(functional=functional))
    (tmp_path / "late.py").write_text("from holders import LIST\n\nact = LIST[0]\n")
    spec = {"dir": str(tmp_path), "low": LOW, "device": device, "calls": _CALLS}
    env = dict(os.environ, UNIFIED_AMP_BACKEND=kit.name, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _HOLDERS_CHILD], input=json.dumps(spec),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HOLDERS ")]
    assert lines, proc.stderr[-3000:]
    found = json.loads(lines[-1][len("HOLDERS "):])
    contract = expected(row("softmax"), "low", LOW)
    native = {"megengine": row("softmax").native("megengine")}.get(kit.name, contract)
    unreachable = _UNREACHABLE if kit.name == "megengine" else {}
    wanted = {name: (LOW if name in unreachable and native != "float32" else contract)
              for name in _CALLS}  # (the other thread makes no call)
    assert found["dtypes"] == wanted
    said = [message for category, message in found["first"] if category == "ContractWarning"]
    holders = sorted(holder for holder in unreachable.values()
                     if any(f" in {holder}" in message for message in said))
    assert len(said) == len(unreachable) and holders == sorted(unreachable.values()), \
        json.dumps(said, indent=1)
    for message in said:
        assert f"{functional}.softmax is held in" in message, message
        assert f"({functional}.softmax(...))" in message, message
    assert not [m for c, m in found["again"] if c == "ContractWarning"], found["again"]
