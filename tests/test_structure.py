"""The repository's structure: what the layout promises beyond behaviour."""

import pickle

import unified_amp as amp


def test_a_scaler_pickles_with_its_settings_and_class():
    scaler = amp.GradScaler(init_scale=1024.0, growth_interval=7)
    scaler.set_backoff_factor(0.25)
    loaded = pickle.loads(pickle.dumps(scaler))
    # The class pickled, which the backend makes for a scaler without a device on a
    # machine without CUDA: on torch also a torch.amp.GradScaler.
    assert type(loaded) is type(scaler) and isinstance(loaded, amp.GradScaler)
    assert loaded.state_dict() == scaler.state_dict() == {
        "scale": 1024.0, "scale_factor": 1024.0, "growth_factor": 2.0,
        "backoff_factor": 0.25, "growth_interval": 7, "_growth_tracker": 0, "steps": 0,
        "skipped_steps": 0, "last_step_skipped": False}
    disabled = pickle.loads(pickle.dumps(amp.GradScaler(enabled=False)))
    assert not disabled.is_enabled() and disabled.get_scale() == 1.0


# -- the import graph ----------------------------------------------------------------------
# Read from the source with ast (nothing is imported): every module of the core
# (unified_amp/) and of the adapters (backends/, installed as unified_amp.backends), and
# every import statement in them, at any depth (a function's lazy import counts too).
import ast  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = "unified_amp.backends"
# The length of torch's amp/grad_scaler.py, one class that reads top to bottom. A file is
# split where its concerns part, not at a line count (SPEC); this catches only one grown
# past the longest file we hold up as readable.
MAX_LINES = 714


def _modules() -> dict[str, Path]:
    found = {}
    for base, package in ((ROOT / "unified_amp", "unified_amp"), (ROOT / "backends", ADAPTERS)):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import in ``path`` that reaches a
    module of ours."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            # `from package import module` imports the module
            subs = [n for n in names if f"{target}.{n}" in modules]
            out += [(f"{target}.{n}", []) for n in subs]
            if len(subs) < len(names):
                out.append((target, [n for n in names if n not in subs]))
    return [(m, names) for m, names in out if m in modules]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, _ in _imports(name, path, modules)} - {name}
            for name, path in modules.items()}


def _is_adapter(name: str) -> bool:
    return name == ADAPTERS or name.startswith(ADAPTERS + ".")


def test_the_core_imports_no_adapter():
    """The core reaches an adapter only through the registry (by name, at run time)."""
    arrows = sorted(f"{a} -> {b}" for a, targets in _graph().items() if not _is_adapter(a)
                    for b in targets if _is_adapter(b))
    assert arrows == []


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_adapters_import_no_private_name_of_the_core():
    modules = _modules()
    private = []
    for name, path in modules.items():
        if not _is_adapter(name):
            continue
        for module, names in _imports(name, path, modules):
            if _is_adapter(module):
                continue
            if any(part.startswith("_") for part in module.split(".")):
                private.append(f"{name}: {module}")
            private += [f"{name}: {module}.{n}" for n in names if n.startswith("_")]
    assert private == []


def _core_scaler_private_members() -> set[str]:
    """The underscore members the core's GradScaler defines: methods, class-level
    declarations and ``self._x`` assignments (its state machine is one of them, ``_machine``)."""
    members = set()
    for module in ("scaler/_grad_scaler",):
        tree = ast.parse((ROOT / "unified_amp" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members.add(node.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self" and isinstance(node.ctx, ast.Store):
                members.add(node.attr)
    return {m for m in members if m.startswith("_") and not m.startswith("__")}


def test_adapters_read_no_private_member_of_the_core_scaler():
    """TorchGradScaler goes through scaler.adapter_view; it may define torch.amp's own
    private names (``_scale``, ``_per_optimizer_states``, ...) but read none of the core's,
    in its methods or in the functions it installs as methods (``host_part``), on
    ``self`` or on any other name."""
    core = _core_scaler_private_members()
    assert {"_machine", "_forensics"} <= core  # the reader works
    reads = []
    for path in sorted((ROOT / "backends").rglob("*.py")):
        tree = ast.parse(path.read_text())
        # the names the classes built on the core's GradScaler define themselves
        own = {n.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               and any("GradScaler" in ast.unparse(b) for b in c.bases)
               for n in ast.walk(c) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in core - own:
                reads.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert reads == []


# Modules named for one framework's own machinery, which the other has no counterpart of.
# What only one framework needs: dynamo is torch's compiler. (The swapping of wrappers
# into every binding, which MegEngine's contract and both adapters' rules for a
# program's own functions need, is the core's: unified_amp/rebinding.py.)
FRAMEWORK_OWN = {"autocast_dynamo"}


def test_every_adapter_package_has_the_same_module_names():
    """Keras 3's backend/<name>/ layout (SPEC, Layout): a reader who knows one adapter
    finds each capability under the same name in the other (megengine_backend/scaler.py
    says why MegEngine needs no native scaler class)."""
    packages = [p for p in sorted((ROOT / "backends").iterdir()) if (p / "__init__.py").exists()]
    names = {p.name: {f.stem for f in p.glob("*.py")} - FRAMEWORK_OWN for p in packages}
    assert len(names) == 2
    every = set.union(*names.values())
    assert {name: sorted(every - own) for name, own in names.items()} == \
        {name: [] for name in names}


def test_no_source_file_is_longer_than_torchs_grad_scaler():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _reachable(start: str) -> set[str]:
    graph, seen, todo = _graph(), set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_scaler_imports_no_forensics_and_no_autocast():
    """Forensics listens to what the machine announces; nothing the scaler imports,
    directly or not, is forensics, pinning or autocast (unified_amp/__init__, above
    both, subscribes forensics), and the report's pin hint is a leaf, so forensics
    needs no pinning either."""
    scaler = [m for m in _modules() if m.startswith("unified_amp.scaler")]
    assert len(scaler) > 5
    for module in scaler:
        reached = _reachable(module)
        assert not reached & {"unified_amp.forensics", "unified_amp.pinning",
                              "unified_amp.autocast"}, module
    assert "unified_amp.forensics" in _graph()["unified_amp"]  # who subscribes it
    assert not _reachable("unified_amp.forensics") & {"unified_amp.pinning",
                                                      "unified_amp.autocast"}
    assert _graph()["unified_amp._pin_hint"] == set()


def _layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for one that imports none of the others, else one above
    the highest it imports."""
    floors: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in floors:
            floors[name] = 1 + max((floor(m) for m in graph[name]), default=0)
        return floors[name]

    for name in graph:
        floor(name)
    return floors


def test_the_cores_import_graph_is_at_most_6_layers_deep():
    """unified_amp/'s own modules, a package counted as one (its __init__ and modules
    together, as a reader meets it): 8 layers while the scaler subscribed forensics
    itself (scaler -> forensics -> pinning -> autocast)."""
    core = {m: t for m, t in _graph().items() if not _is_adapter(m)}

    def room(name: str) -> str:
        for package in ("unified_amp.scaler", "unified_amp.apex", "unified_amp.dtype_contract"):
            if name == package or name.startswith(package + "."):
                return package
        return name

    rooms: dict[str, set[str]] = {}
    for name, targets in core.items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if not _is_adapter(t))
    rooms = {r: t - {r} for r, t in rooms.items()}
    assert max(_layers(rooms).values()) <= 6, _layers(rooms)


def test_no_module_of_the_core_makes_its_names_lazily():
    """No module-level __getattr__: a module that needs one to break an import cycle has
    an arrow running back up (the scale rule, used below the scaler, lives below it)."""
    lazy = [name for name, path in _modules().items()
            if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                   for n in ast.parse(path.read_text()).body)]
    assert lazy == []
