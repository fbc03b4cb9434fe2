"""amp.autocast and the scaler under torch.compile, side by side with torch.autocast and
torch.amp.GradScaler (docs/COMPILE.md). Every test runs on every torch in the extra's
range (`make test-matrix`); where torch versions differ, the test says which behaviour
each version must show.

Most cases compile with a recording backend that runs AOTAutograd as ``aot_eager`` does
and keeps every graph it is given, so the tests count graphs and compare the compiled
ops; a few use inductor and its on-disk cache, in this process and across two.

The models are on the CPU, so the blocks say device="cpu": where torch sees a GPU, a
block with no device covers CUDA alone (docs/API.md, "Devices")."""

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import unified_amp as amp
from unified_amp.backends.torch_backend import autocast as torch_autocast


BF16 = torch.bfloat16
CAST = torch.ops.aten._to_copy.default  # a dtype cast, as AOTAutograd traces it
LINEAR = torch.ops.aten.addmm.default  # a linear with bias, as AOTAutograd traces it


class Recorder:
    """A torch.compile backend that keeps dynamo's graphs and the forward and backward
    graphs AOTAutograd traces from them, and runs the latter as aot_eager does."""

    def __init__(self):
        self.dynamo, self.forward, self.backward = [], [], []

        def keep(into):
            def compiler(gm, example_inputs):
                into.append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        self._aot = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)
        return self._aot(gm, example_inputs)


def ops(gm):
    """(op, output dtype) of each call in a traced graph, in order."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            val = node.meta.get("val")
            out.append((node.target, val.dtype if isinstance(val, torch.Tensor) else None))
    return out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data(seed=0, overflow=False):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    if overflow:
        x[0, 0] = float("inf")
    return x, y


def loss_of(model, x, y):
    # log_softmax is where the contract and torch's CPU autocast differ: float32 with the
    # contract, bfloat16 (the linear's output dtype) with torch's rules.
    return F.nll_loss(F.log_softmax(model(x), -1), y)


def native_loss(model, x, y):
    with torch.autocast("cpu", dtype=BF16):
        return loss_of(model, x, y)


# -- every form of amp.autocast, traced whole (fullgraph=True) --------------------------

def _with_unified(contract):
    def f(model, x, y):
        with amp.autocast(dtype=BF16, device="cpu", contract=contract):
            return loss_of(model, x, y)
    return f


def _with_torch_form(contract):
    def f(model, x, y):
        with amp.autocast("cpu", dtype=BF16, contract=contract):
            return loss_of(model, x, y)
    return f


def _with_megengine_form(contract):
    def f(model, x, y):
        with amp.autocast(True, low_prec_dtype="bfloat16", device="cpu", contract=contract):
            return loss_of(model, x, y)
    return f


def _decorated_inside(contract):
    # made outside
    inner = amp.autocast(dtype="bfloat16", device="cpu", contract=contract)(loss_of)

    def f(model, x, y):
        return inner(model, x, y)
    return f


def _decorated_outside(contract):
    return amp.autocast(dtype="bfloat16", device="cpu", contract=contract)(loss_of)


def _reentered(contract):
    def f(model, x, y):
        # one instance, twice
        ctx = amp.autocast(dtype="bfloat16", device="cpu", contract=contract)
        with ctx:
            with ctx:
                h = model(x)
            return F.nll_loss(F.log_softmax(h, -1), y)
    return f


FORMS = {"with": _with_unified, "torch form": _with_torch_form,
         "megengine form": _with_megengine_form, "decorated function inside": _decorated_inside,
         "decorated compiled function": _decorated_outside, "re-entered": _reentered}


@pytest.fixture(scope="module")
def native_graphs():
    torch._dynamo.reset()
    rec = Recorder()
    x, y = data()
    loss = torch.compile(native_loss, backend=rec, fullgraph=True)(net(), x, y)
    loss.backward()
    return rec


@pytest.mark.parametrize("contract", [False, True], ids=["contract off", "contract on"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_compiles_whole_into_torch_autocasts_graphs(form, contract, native_graphs):
    model, x, y = net(), *data()
    fn = FORMS[form](contract)
    eager = fn(model, x, y)
    rec = Recorder()
    loss = torch.compile(fn, backend=rec, fullgraph=True)(model, x, y)
    loss.backward()

    assert torch.equal(loss, eager)
    assert not torch.is_autocast_enabled("cpu")  # every block was left
    assert torch._C._len_torch_function_stack() == 0
    # One graph each way, as torch.autocast's, holding the model's two linears in bfloat16.
    assert (len(rec.dynamo), len(rec.forward), len(rec.backward)) == (1, 1, 1)
    ours, native = ops(rec.forward[0]), ops(native_graphs.forward[0])
    assert [d for op, d in ours if op == LINEAR] == [BF16, BF16]
    if not contract:
        # torch.autocast's graphs, op for op and dtype for dtype, and its numbers.
        assert ours == native
        assert ops(rec.backward[0]) == ops(native_graphs.backward[0])
        assert torch.equal(loss, native_loss(net(), x, y))
        return
    # The same ops, but log_softmax's bfloat16 input is cast to float32 first (the
    # contract's cast), which makes the cast torch.autocast puts before nll_loss moot.
    def without_float32_casts(graph_ops):
        return [op for op, d in graph_ops if not (op == CAST and d == torch.float32)]

    assert without_float32_casts(ours) == without_float32_casts(native)
    at = [op for op, _ in ours].index(torch.ops.aten._log_softmax.default)
    assert ours[at - 2:at + 1] == [(LINEAR, BF16), (CAST, torch.float32),
                                   (torch.ops.aten._log_softmax.default, torch.float32)]
    assert (torch.ops.aten._log_softmax.default, BF16) in native


def test_nested_blocks_trace_whole_and_keep_their_own_rules():
    """A contract block around a contract=False block and an enabled=False block: each
    region computes as it does eagerly, in one graph."""
    model, (x, y) = net(), data()

    def f(model, x, y):
        with amp.autocast(dtype=BF16, device="cpu"):
            h = model(x)
            a = F.log_softmax(h, -1)
            with amp.autocast(dtype=BF16, device="cpu", contract=False):
                b = F.log_softmax(h, -1)
                with amp.autocast(enabled=False):
                    c = F.log_softmax(model(x), -1)
                d = F.log_softmax(h, -1)
            e = F.log_softmax(h, -1)
        return a, b, c, d, e

    eager = f(model, x, y)
    rec = Recorder()
    compiled = torch.compile(f, backend=rec, fullgraph=True)(model, x, y)
    assert [t.dtype for t in compiled] == [torch.float32, BF16, torch.float32, BF16,
                                           torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert len(rec.dynamo) == 1
    assert torch._C._len_torch_function_stack() == 0


# -- graph breaks inside a block --------------------------------------------------------

class Head(torch.nn.Module):
    """A user-defined module (dynamo compiles a user's frames on their own, never
    torch's): where dynamo gives up on the frame holding a block, it still compiles this
    module's forward, called from that frame."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, h):
        return F.log_softmax(self.proj(h), -1)


BREAKS = {
    "logging": lambda: logging.getLogger("unified_amp.tests").warning("a graph break"),
    "print": lambda: print("", end=""),
}


def _broken(block, brk, model, head):
    def f(x):
        with block():
            h = model(x)
            BREAKS[brk]()  # dynamo cannot trace it: the graph breaks here
            return head(h)
    return f


def _graphs_and_loss(fn, x):
    rec = Recorder()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend=rec)(x)
    compile_warnings = [w for w in seen if issubclass(w.category, amp.CompileWarning)]
    return rec, out, compile_warnings


def _linears(rec):
    return [d for g in rec.forward for op, d in ops(g) if op == LINEAR]


@pytest.fixture
def quiet_logging():
    """The breaks' logger silenced, and the adapter's record of functions it has warned
    about forgotten (it warns once per function, and the tests reuse one)."""
    logger = logging.getLogger("unified_amp.tests")
    level, logger.level = logger.level, logging.CRITICAL
    torch_autocast._warned.clear()
    yield
    logger.setLevel(level)
    torch_autocast._warned.clear()


@pytest.mark.parametrize("brk", BREAKS)
def test_a_graph_break_inside_a_block_gives_torch_autocasts_loss_and_dtypes(brk, quiet_logging):
    """Without the contract, on one device, the block is torch.autocast's, and so is
    what a graph break inside it gives: the same loss, dtypes and (on torch >= 2.12,
    where amp.autocast(...) is then a torch.autocast) the same graphs, each holding its
    linears in bfloat16. On older torch, dynamo gives up on the frame holding the block:
    the result is the same and it is said once (CompileWarning)."""
    model, head, x = net()[:1], Head(), data()[0]
    native = _broken(lambda: torch.autocast("cpu", dtype=BF16), brk, model, head)
    unified = _broken(lambda: amp.autocast("cpu", dtype=BF16, contract=False), brk, model, head)
    rec_n, out_n, _ = _graphs_and_loss(native, x)
    torch._dynamo.reset()
    rec_u, out_u, warned = _graphs_and_loss(unified, x)

    assert out_u.dtype == out_n.dtype == BF16 and torch.equal(out_u, out_n)
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_function_stack() == 0
    assert _linears(rec_n) == [BF16, BF16]
    if torch_autocast._NATIVE:
        assert not warned
        assert len(rec_u.dynamo) == len(rec_n.dynamo) == 2
        assert [ops(g) for g in rec_u.forward] == [ops(g) for g in rec_n.forward]
    else:
        assert len(warned) == 1 and torch.__version__ in str(warned[0].message)
        assert _linears(rec_u) == [BF16]  # the head's frame, compiled on its own


def test_a_graph_break_inside_a_contract_block_keeps_dtypes_and_contract_and_says_so(
        quiet_logging):
    """With the contract, dynamo gives up on the frame holding the block (on every
    torch): the frame runs eagerly with the block's state in force, the functions it
    calls are compiled on their own with the block's dtypes and contract, and a
    CompileWarning names the function, the torch version and the fixes -- once."""
    model, head, x = net()[:1], Head(), data()[0]
    unified = _broken(lambda: amp.autocast("cpu", dtype=BF16), "logging", model, head)
    with amp.autocast("cpu", dtype=BF16):
        expected = head(model(x))
    rec, out, warned = _graphs_and_loss(unified, x)
    assert out.dtype == torch.float32 and torch.equal(out, expected)  # the contract's
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "in f (" in message and torch.__version__ in message
    assert "before or inside its amp.autocast block" in message  # dynamo cannot say which
    assert "@amp.autocast" in message and "contract=False" in message
    head_graph = ops(rec.forward[-1])
    assert [d for op, d in head_graph if op == LINEAR] == [BF16]
    assert (CAST, torch.float32) in head_graph  # the contract's cast, compiled
    # the same function again: no second warning, the same numbers
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert torch.equal(torch.compile(unified, backend="aot_eager")(x), expected)
    assert not [w for w in again if issubclass(w.category, amp.CompileWarning)]
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_function_stack() == 0
    leaked = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    assert leaked == 0  # torch's nesting counter is back where it was


@pytest.mark.parametrize("nested", [True, False], ids=["disabled", "enabled"])
def test_a_block_nested_and_left_before_the_break_keeps_the_warning(nested, quiet_logging):
    """A nested block entered and left while dynamo traces, then a graph break in the
    outer block: dynamo still gives up on the frame, and that is said once. (The
    nested block's exit once cleared the frame's record, and the warning was lost.)"""
    model, head, x = net()[:1], Head(), data()[0]

    def f(x):
        with amp.autocast("cpu", dtype=BF16):
            with amp.autocast("cpu", dtype=BF16, enabled=not nested):
                h = model(x)
            BREAKS["logging"]()
            return head(h)

    with amp.autocast("cpu", dtype=BF16):
        with amp.autocast("cpu", dtype=BF16, enabled=not nested):
            h = model(x)
        expected = head(h)
    rec, out, warned = _graphs_and_loss(f, x)
    assert torch.equal(out, expected)
    assert len(warned) == 1 and "in f (" in str(warned[0].message)
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_function_stack() == 0


def test_a_decorated_function_splits_at_a_graph_break_inside_it(quiet_logging):
    """The decorator's wrapper holds nothing but the call, so where dynamo gives up on
    it, the decorated function itself is compiled on its own frame, splitting at the
    break as torch.autocast does, with the contract: no warning."""
    model, head, x = net()[:1], Head(), data()[0]

    @amp.autocast("cpu", dtype=BF16)
    def body(x):
        h = model(x)
        BREAKS["logging"]()
        return head(h)

    with amp.autocast("cpu", dtype=BF16):
        expected = head(model(x))
    rec, out, warned = _graphs_and_loss(lambda x: body(x) * 1, x)
    assert torch.equal(out, expected) and not warned
    assert _linears(rec) == [BF16, BF16]  # both linears compiled
    assert any((CAST, torch.float32) in ops(g) for g in rec.forward)


def test_a_block_object_made_outside_the_compiled_function():
    """An amp.autocast object made outside the compiled region and entered inside it
    is traced as one made inside (backends/torch_backend/autocast_dynamo.py on torch
    2.7-2.13, dynamo itself from 2.14): ``fullgraph=True`` compiles it whole, with the
    eager block's numbers. Until issue 33 it broke the graph at its ``with`` before
    torch 2.14, and ``fullgraph=True`` raised."""
    def made_outside():
        ctx = amp.autocast(dtype=BF16, device="cpu")

        def f(x):
            with ctx:
                return F.log_softmax(x @ x, -1)
        return f

    x = torch.randn(4, 4)
    with amp.autocast(dtype=BF16, device="cpu"):
        expected = F.log_softmax(x @ x, -1)
    assert torch.equal(torch.compile(made_outside(), backend="aot_eager")(x), expected)
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_function_stack() == 0
    torch._dynamo.reset()
    rec = Recorder()
    assert torch.equal(torch.compile(made_outside(), backend=rec, fullgraph=True)(x),
                       expected)
    assert len(rec.dynamo) == 1
    assert not torch.is_autocast_enabled("cpu")


def test_first_use_of_the_library_can_be_inside_a_compiled_function():
    """A fresh interpreter whose first unified_amp call is traced: choosing and loading
    the backend happens outside the trace, and the function still compiles whole."""
    code = textwrap.dedent("""
        import torch, unified_amp as amp

        @torch.compile(fullgraph=True, backend="aot_eager")
        def f(x):
            with amp.autocast(dtype=torch.bfloat16, device="cpu"):
                return torch.log_softmax(x @ x, -1)

        print(f(torch.randn(4, 4)).dtype, f(torch.randn(4, 4)).dtype)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, UNIFIED_AMP_BACKEND="torch"))
    assert proc.stdout.split() == ["torch.float32"] * 2, proc.stderr[-3000:]


# -- the contract in dynamo's, AOTAutograd's and inductor's caches -----------------------

def _kinds(shape):
    """The same compiled function under torch.autocast and under amp.autocast, called
    from outside (the compiled region sees autocast as ambient state) and written inside
    a compiled function; shape keeps tests' graphs apart in a shared inductor cache."""
    w = torch.randn(shape)

    def body(x):
        return F.log_softmax(x @ w, -1)

    def native_inside(x):
        with torch.autocast("cpu", dtype=BF16):
            return body(x)

    def unified_inside(x):
        with amp.autocast(dtype=BF16, device="cpu"):
            return body(x)

    return body, native_inside, unified_inside


EXPECTED = {"native": BF16, "unified": torch.float32}


def _run_in_order(order, backend, reset, shape, forms=("around", "inside", "around again")):
    body, native_inside, unified_inside = _kinds(shape)
    around = torch.compile(body, backend=backend)
    inside = {"native": torch.compile(native_inside, backend=backend),
              "unified": torch.compile(unified_inside, backend=backend)}
    outer = {"native": lambda: torch.autocast("cpu", dtype=BF16),
             "unified": lambda: amp.autocast(dtype=BF16, device="cpu")}
    x = torch.randn(4, shape[0])
    seen = {}
    with torch.no_grad():
        for i, kind in enumerate(order):
            if reset and i:
                torch._dynamo.reset()
                # Compiled anew after the reset: calling a function compiled before it
                # crashes torch 2.7-2.8 on CPython 3.13 (torch's bug; docs/VERSIONS.md).
                around = torch.compile(body, backend=backend)
                inside = {k: torch.compile(f, backend=backend) for k, f in
                          (("native", native_inside), ("unified", unified_inside))}
            with outer[kind]():
                seen[kind, "around"] = around(x).dtype
            if "inside" in forms:
                seen[kind, "inside"] = inside[kind](x).dtype
            if "around again" in forms:
                with outer[kind]():  # once more around, after the other kind ran inside
                    seen[kind, "around again"] = around(x).dtype
    assert seen == {(k, form): EXPECTED[k] for k in order for form in forms}, order


@pytest.mark.parametrize("reset", [False, True], ids=["same caches", "dynamo reset between"])
@pytest.mark.parametrize("order", [("native", "unified"), ("unified", "native")],
                         ids=["native first", "unified first"])
def test_each_side_gets_its_own_dtypes_in_one_process(order, reset):
    _run_in_order(order, Recorder(), reset, (8, 8))


@pytest.mark.filterwarnings("ignore:.*CUDA is not available")
def test_on_a_gpu_machine_the_blocks_cuda_questions_stay_out_of_the_graph(monkeypatch):
    """With a GPU present, entering a block (device None: CUDA there) asks torch.cuda
    whether the device computes bfloat16; dynamo cannot trace that query (it returns a
    bool, not a tensor), and asked inside a compiled function it broke the graph on a
    real GPU. Here the adapter sees a GPU and the query is one dynamo cannot trace: the
    block must still compile whole, and the compiled code must never ask again.

    Only the adapter is told of a GPU, not torch: on a CUDA build of torch without a
    driver, a torch.cuda that says a GPU is there makes dynamo itself start CUDA (its
    stream tracking asks torch.accelerator), which fails. torch.autocast("cuda") then
    warns, while tracing, that CUDA is absent; that is torch's, not the block's."""
    monkeypatch.setattr(torch_autocast, "devices", lambda device, enabled: (
        [device] if device else ["cuda"] if enabled else ["cpu", "cuda"]))
    asked_while_tracing = []

    def untraceable(*args, **kwargs):
        asked_while_tracing.append(torch.compiler.is_compiling())
        torch._dynamo.graph_break()  # what dynamo makes of a torch.cuda query in a graph
        return True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", untraceable)
    model, (x, y) = net(), data()

    def unified_loss(model, x, y):
        # device None: (here) CUDA; the nested block adds the CPU, where the model is
        with amp.autocast(dtype=BF16), amp.autocast(dtype=BF16, device="cpu"):
            return loss_of(model, x, y)

    compiled = torch.compile(unified_loss, backend="aot_eager", fullgraph=True)
    with amp.autocast(dtype=BF16), amp.autocast(dtype=BF16, device="cpu"):
        expected = loss_of(model, x, y).detach()
    asked_while_tracing.clear()
    assert torch.equal(compiled(model, x, y).detach(), expected)  # one graph: no break
    # Asked while compiling (by the block's check, and by torch.autocast("cuda") itself,
    # which dynamo and AOTAutograd build to trace the region); never by the compiled code.
    assert asked_while_tracing
    asked_while_tracing.clear()
    assert torch.equal(compiled(model, x, y).detach(), expected)
    assert asked_while_tracing == []
    assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")


def test_each_side_gets_its_own_dtypes_with_inductor_after_a_reset():
    """inductor keeps compiled graphs on disk (FX graph and AOTAutograd caches), which a
    reset leaves in place: the second side must not be served the first side's graph.
    The same compiled function, called under each side's autocast in turn."""
    _run_in_order(("native", "unified"), "inductor", True, (8, 5), forms=("around",))
    _run_in_order(("unified", "native"), "inductor", True, (8, 7), forms=("around",))


def test_each_side_gets_its_own_dtypes_across_processes_sharing_inductors_cache(tmp_path):
    """Two interpreters, one on-disk inductor cache: the first compiles graph A natively
    and graph B with the contract, the second the other way round, so each side meets a
    graph the other side put in the cache first."""
    script = tmp_path / "side.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch, torch.nn.functional as F
        import unified_amp as amp

        out = []
        for kind, n in zip(sys.argv[1:], (3, 9)):  # graph A is 8x3, graph B 8x9
            w = torch.ones(8, n)
            f = torch.compile(lambda x: F.log_softmax(x @ w, -1), backend="inductor")
            ctx = (amp.autocast(dtype=torch.bfloat16, device="cpu") if kind == "unified"
                   else torch.autocast("cpu", dtype=torch.bfloat16))
            with torch.no_grad(), ctx:
                out.append(str(f(torch.randn(4, 8)).dtype))
        print(*out)
    """))
    env = dict(os.environ, UNIFIED_AMP_BACKEND="torch")

    def side(*kinds):
        proc = subprocess.run([sys.executable, str(script), *kinds], capture_output=True,
                              text=True, timeout=600, env=env)
        return proc.stdout.split() or proc.stderr[-3000:]

    assert side("native", "unified") == ["torch.bfloat16", "torch.float32"]
    assert side("unified", "native") == ["torch.float32", "torch.bfloat16"]


# -- the scaler beside and inside compiled code -------------------------------------------

OPTIMIZERS = {
    "sgd foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adam fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
}


def amp_step(model, opt, scaler, block):
    """torch.amp's training step (forward in the block, scaled backward, step, update)."""
    def step(x, y):
        with block():
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss
    return step


def train(native, compiled, optimizer, steps=4, overflow_at=1):
    """A few steps of torch.amp's loop (unified: contract=False), one of them overflowing;
    ``compiled`` says what torch.compile wraps: the model, opt.step or the whole step."""
    model = net()
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    if native:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
        autocast = lambda: torch.autocast("cpu", dtype=BF16)  # noqa: E731
    else:
        scaler = amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
        autocast = lambda: amp.autocast(dtype=BF16, device="cpu", contract=False)  # noqa: E731
    if compiled == "model":
        model = torch.compile(model, backend="aot_eager")
    if compiled == "opt.step":
        opt.step = torch.compile(opt.step, backend="aot_eager")

    step = amp_step(model, opt, scaler, autocast)
    if compiled == "step":
        step = torch.compile(step, backend="aot_eager")
    history = []
    for i in range(steps):
        loss = step(*data(i, overflow=i == overflow_at))
        history.append((loss.item().hex(), scaler.get_scale()))  # hex: nan == nan
    return history, [p.detach().clone() for p in opt.param_groups[0]["params"]]


@pytest.mark.parametrize("compiled, optimizer", [
    ("model", "sgd foreach"), ("opt.step", "sgd foreach"),
    ("step", "sgd foreach"), ("step", "adam fused")])
def test_training_with_compiled_code_is_bit_identical_to_torch_amp(compiled, optimizer):
    native_history, native_params = train(True, compiled, optimizer)
    history, params = train(False, compiled, optimizer)
    assert history == native_history
    assert history[1][1] == 2.0**15  # the overflow was seen and skipped
    assert all(torch.equal(a, b) for a, b in zip(params, native_params))


def _compiled_step_graph_ops(native):
    """The ops of every graph dynamo made for a compiled function that runs a whole
    torch.amp-style step with a foreach SGD (the model's forward, the scaled backward,
    scaler.step, scaler.update), and the weights after two steps."""
    torch._dynamo.reset()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    if native:
        scaler, block = torch.amp.GradScaler("cpu"), lambda: torch.autocast("cpu", dtype=BF16)
    else:
        scaler = amp.GradScaler("cpu")
        block = lambda: amp.autocast(dtype=BF16, device="cpu", contract=False)  # noqa: E731
    rec = Recorder()
    step = torch.compile(amp_step(model, opt, scaler, block), backend=rec)
    for i in range(2):
        step(*data(i))
    targets = {str(getattr(n.target, "__name__", n.target)) for g in rec.dynamo
               for n in g.graph.nodes if n.op == "call_function"}
    return targets, [p.detach().clone() for p in model.parameters()]


def test_a_compiled_function_that_calls_scaler_step_compiles_the_optimizers_step():
    """dynamo compiles the optimizer's step when torch.amp's GradScaler.step calls it
    inside a compiled function; the unified scaler's host work runs eagerly, and the
    optimizer's step it calls is compiled too (it ran eagerly before: 1.03x the native
    compiled step), with the same weights."""
    native_ops, native_params = _compiled_step_graph_ops(True)
    ours, params = _compiled_step_graph_ops(False)
    foreach = {op for op in native_ops if op.startswith("_foreach_")}
    assert foreach, native_ops  # the control: torch.amp's step compiles SGD's update
    assert foreach <= ours, sorted(ours)
    assert all(torch.equal(a, b) for a, b in zip(params, native_params))


class _UnknownContext:
    """A context manager dynamo does not know: a graph break inside it makes dynamo run
    the rest of the frame eagerly, with its frame evaluator still installed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_scalers_host_side_is_never_compiled_from_an_eagerly_run_compiled_frame(
        monkeypatch):
    """The scaler's public methods skip torch.compiler.disable's wrapper when no compiled
    code is running (it costs microseconds per call); from a compiled frame that dynamo
    runs eagerly they must still go through it, or the core's own frames get compiled."""
    from unified_amp.scaler._machine import ScalerMachine

    seen = []
    update = ScalerMachine.update  # the core's own frame, once per iteration
    monkeypatch.setattr(ScalerMachine, "update", lambda m, *a, **k: (
        seen.append(torch.compiler.is_compiling()), update(m, *a, **k))[1])
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = amp.GradScaler("cpu")

    def step():
        with _UnknownContext():
            loss = (p * 2).sum()
            scaler.scale(loss).backward()
            torch._dynamo.graph_break()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return loss

    compiled = torch.compile(step, backend="eager")
    for _ in range(3):
        compiled()
    assert seen == [False] * 3
    assert scaler.get_scale() == 2.0**16  # three clean steps, each stepped:
    assert torch.allclose(p.detach(), torch.full((3,), 1.0 - 3 * 0.1 * 2))
