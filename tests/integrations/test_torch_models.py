"""Real models that nobody here wrote, as users build them from their own packages:
torchvision's ``resnet50(num_classes=10)`` at 32x32, timm's ``vit_tiny_patch16_224``
(``img_size=32, patch_size=4``) and Hugging Face transformers' ``GPT2LMHeadModel`` from a
small ``GPT2Config`` (random weights: nothing can be downloaded here). Each trains 6 steps
in a torch.amp loop (``scaler.scale(loss).backward()``, ``step``, ``update``) with two
overflows planted, an inf loss and one inf gradient element:

- with ``torch.autocast`` + ``torch.amp.GradScaler`` (native), with the scaler swapped for
  unified_amp's, and with both swapped (``amp.autocast(..., contract=False)``): weights,
  optimizer state, losses and the scale after every step are equal byte for byte;
- with unified_amp's defaults (the dtype contract on): the same steps skipped, the same
  scales, every loss finite and close to native's;
- GPT-2 under ``torch.compile``: ``amp.autocast`` gives the graphs and graph breaks that
  ``torch.autocast`` gives (transformers' loss path calls a logger, which breaks the
  graph inside the autocast block).

`make test-integrations` runs this file in an environment of its own
(.venv-integrations-models, constraints/integrations-models.txt): the registry's
torchvision wheels are CUDA builds that load only into the CUDA build of the same torch,
which runs on CPU here.
"""

import os

# No network here: transformers and timm must never try the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch._dynamo.testing import AotEagerAndRecordGraphs  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import unified_amp as amp  # noqa: E402

from . import pins  # noqa: E402

# torch's own AotEagerAndRecordGraphs hands AOTAutograd unboxed functions; it says so.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Your compiler for AOTAutograd is returning a function:UserWarning")

INF = float("inf")
STEPS = 6
INF_LOSS_AT, INF_GRAD_AT = 1, 3  # steps counted from 0
SCALER_ARGS = dict(init_scale=2.0**10, growth_interval=2)  # backoffs and a growth in 6 steps
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _images(batch=2):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(STEPS)]


def resnet50():
    model = torchvision.models.resnet50(num_classes=10)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), _images(), \
        lambda m, x, y: F.cross_entropy(m(x), y), model.fc


def vit():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), _images(), \
        lambda m, x, y: F.cross_entropy(m(x), y), model.head


GPT2 = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=256, n_positions=64,
                  bos_token_id=0, eos_token_id=0)


def _tokens(batch=2, length=32):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, GPT2.vocab_size, (batch, length), generator=g) for _ in range(STEPS)]


def gpt2():
    model = GPT2LMHeadModel(GPT2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), \
        [(ids, ids) for ids in _tokens()], lambda m, x, y: m(x, labels=y).loss, model.lm_head


MODELS = {"resnet50": resnet50, "vit": vit, "gpt2": gpt2}
# bfloat16 (torch's CPU autocast dtype) for all three; float16 (a GPU's) for GPT-2 as
# well: float16 convolutions and attention run ~5x slower than bfloat16 on these CPUs.
CASES = [("resnet50", "bfloat16"), ("vit", "bfloat16"), ("gpt2", "bfloat16"),
         ("gpt2", "float16")]


def variant(name, dtype):
    """(autocast factory, scaler) of one variant of the loop."""
    low = DTYPES[dtype]
    native = lambda: torch.autocast("cpu", dtype=low)  # noqa: E731
    return {
        "native": (native, torch.amp.GradScaler("cpu", **SCALER_ARGS)),
        "scaler swapped": (native, amp.GradScaler("cpu", **SCALER_ARGS)),
        "both swapped": (lambda: amp.autocast("cpu", dtype=low, contract=False),
                         amp.GradScaler("cpu", **SCALER_ARGS)),
        "unified defaults": (lambda: amp.autocast("cpu", dtype=low),
                             amp.GradScaler("cpu", **SCALER_ARGS)),
    }[name]


def train(model_name, dtype, name):
    """Trains a fresh model (seed 0: the same weights and dropout in every variant) for
    STEPS steps of a torch.amp loop; returns what it recorded."""
    torch.manual_seed(0)
    model, opt, batches, loss_of, head = MODELS[model_name]()
    model.train()
    autocast, scaler = variant(name, dtype)
    first = next(model.parameters())
    planted = {"now": -1}

    def poison(grad):  # one inf element in one gradient, in one step
        if planted["now"] != INF_GRAD_AT:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = INF
        return grad

    first.register_hook(poison)
    dtypes = set()
    head.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    losses, scales, changed = [], [], []
    for step, (x, y) in enumerate(batches):
        planted["now"] = step
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with autocast():
            loss = loss_of(model, x, y)
        losses.append(loss.item())
        scaler.scale(loss * INF if step == INF_LOSS_AT else loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    state = [(k, torch.as_tensor(v).numpy().tobytes()) for s in opt.state_dict()["state"].values()
             for k, v in sorted(s.items())]
    return {"weights": [p.detach().numpy().tobytes() for p in model.parameters()],
            "optimizer": state, "losses": losses, "scales": scales, "stepped": changed,
            "dtypes": dtypes}


@pytest.fixture(scope="module")
def runs():
    """Each (model, dtype, variant) trained once, on first use."""
    done = {}

    def get(model_name, dtype, name):
        key = (model_name, dtype, name)
        if key not in done:
            done[key] = train(*key)
        return done[key]

    return get


def test_the_pinned_packages_are_the_ones_installed():
    for distribution in ("torch", "torchvision", "timm", "transformers"):
        pins.assert_installed_as_pinned("models", distribution)


@pytest.mark.parametrize("model_name, dtype", CASES)
def test_native_run_really_ran_amp_with_the_planted_overflows(runs, model_name, dtype):
    native = runs(model_name, dtype, "native")
    assert native["dtypes"] == {DTYPES[dtype]}  # the head computed in low precision
    assert native["stepped"] == [s not in (INF_LOSS_AT, INF_GRAD_AT) for s in range(STEPS)]
    # 1024, backed off at each overflow, grown after two clean steps
    assert native["scales"] == [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0]


@pytest.mark.parametrize("swapped", ["scaler swapped", "both swapped"])
@pytest.mark.parametrize("model_name, dtype", CASES)
def test_swapped_in_unified_amp_trains_byte_for_byte_as_torch_amp(runs, model_name, dtype,
                                                                   swapped):
    native, ours = runs(model_name, dtype, "native"), runs(model_name, dtype, swapped)
    for key in ("weights", "optimizer", "losses", "scales", "stepped", "dtypes"):
        assert ours[key] == native[key], f"{key} differs"


@pytest.mark.parametrize("model_name, dtype", CASES)
def test_the_contract_trains_close_to_native(runs, model_name, dtype):
    """The contract runs some ops in float32 that torch's CPU autocast leaves in low
    precision: other bits, the same training."""
    native, ours = runs(model_name, dtype, "native"), runs(model_name, dtype, "unified defaults")
    assert ours["stepped"] == native["stepped"] and ours["scales"] == native["scales"]
    assert ours["dtypes"] == native["dtypes"]
    assert all(map(torch.isfinite, torch.tensor(ours["losses"])))
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]),
                               rtol=0.03, atol=0.0)


# -- GPT-2 under torch.compile ----------------------------------------------------------

def compiled_gpt2(autocast):
    """GPT-2's loss compiled with an ``autocast()`` block inside, one forward and
    backward; the graphs dynamo made (with AOTAutograd's forward graphs) and the graph
    breaks it counted."""
    torch._dynamo.reset()
    counters.clear()
    backend = AotEagerAndRecordGraphs()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2)
    ids = _tokens()[0]

    @torch.compile(backend=backend)
    def loss_of(ids):
        with autocast():
            return model(ids, labels=ids).loss

    loss = loss_of(ids)
    loss.backward()
    ops = [[(str(n.target), n.meta["val"].dtype if isinstance(n.meta.get("val"), torch.Tensor)
             else None) for n in g.graph.nodes if n.op == "call_function"]
           for g in backend.fw_graphs]
    return {"loss": loss.detach(), "grads": [p.grad.clone() for p in model.parameters()],
            "graphs": len(backend.graphs), "ops": ops,
            "breaks": sorted(counters["graph_break"].items())}


@pytest.fixture(scope="module")
def compiled_native():
    # transformers' one-time messages first, eagerly, so both compiled runs see the same
    # state (warning_once has fired already).
    torch.manual_seed(0)
    ids = _tokens()[0]
    GPT2LMHeadModel(GPT2)(ids, labels=ids)
    return compiled_gpt2(lambda: torch.autocast("cpu", dtype=torch.bfloat16))


def test_gpt2_compiled_native_breaks_its_graph_in_the_loss(compiled_native):
    """The control: with torch.autocast, transformers' loss path breaks the graph."""
    assert compiled_native["graphs"] > 1 and compiled_native["breaks"]
    assert any("logging" in reason or "Logger" in reason
               for reason, _ in compiled_native["breaks"])
    assert torch.isfinite(compiled_native["loss"])


def test_gpt2_compiled_with_amp_autocast_gives_torch_autocasts_graphs(compiled_native):
    ours = compiled_gpt2(lambda: amp.autocast("cpu", dtype=torch.bfloat16, contract=False))
    assert ours["graphs"] == compiled_native["graphs"]
    assert ours["breaks"] == compiled_native["breaks"]
    assert ours["ops"] == compiled_native["ops"]  # the same ops, in the same dtypes
    assert torch.equal(ours["loss"], compiled_native["loss"])
    assert all(torch.equal(a, b) for a, b in zip(ours["grads"], compiled_native["grads"]))


def _float32_ops():
    """The aten ops (as graph nodes name them) the contract's table puts in float32."""
    from unified_amp.dtype_contract import ROWS

    names = set()
    for r in ROWS:
        if r.rule == "float32":
            for a in r.aten:
                names.add(f"aten.{a}" if "." in a else f"aten.{a}.default")
    return names


def test_gpt2_compiled_with_the_contract_compiles_torch_autocasts_pieces(compiled_native):
    """With the contract on, dynamo gives up on the compiled function holding the block
    (docs/COMPILE.md, "Graph breaks") and says so once; GPT-2's own forward and loss are
    then compiled on their own, split at the same break: the same non-empty graphs, op
    for op, no more graph breaks than torch.autocast's, and a loss within bfloat16's
    error of its loss. Where a dtype differs it is the contract's table at work, torch's
    CUDA policy on the CPU: a run of float32 ops that starts at an op the table puts in
    float32 (GPT-2's tanh GELU: `pow`, and the elementwise ops that follow it by type
    promotion), with the casts in and out (`_to_copy`) the only ops added."""
    with pytest.warns(amp.CompileWarning, match="loss_of"):
        ours = compiled_gpt2(lambda: amp.autocast("cpu", dtype=torch.bfloat16))
    mine = [g for g in ours["ops"] if g]
    native = [g for g in compiled_native["ops"] if g]

    def computing(graph):
        return [(op, dtype) for op, dtype in graph if op != "aten._to_copy.default"]

    assert [[op for op, _ in computing(g)] for g in mine] == \
        [[op for op, _ in computing(g)] for g in native]
    float32_ops, changed = _float32_ops(), 0
    for a, b in zip(mine, native):
        in_run = False
        for (op, dtype), (_, native_dtype) in zip(computing(a), computing(b)):
            if dtype == native_dtype:
                in_run = False
                continue
            assert dtype == torch.float32 and native_dtype == torch.bfloat16, (op, dtype)
            assert in_run or op in float32_ops, f"{op} went float32 where no row says so"
            in_run, changed = True, changed + 1
    assert changed, "the contract changed no op of GPT-2: its GELU's pow is float32's row"
    assert sum(n for _, n in ours["breaks"]) <= sum(n for _, n in compiled_native["breaks"])
    assert torch.allclose(ours["loss"], compiled_native["loss"], rtol=1e-2)


# -- GPT-2's whole training step compiled -------------------------------------------------

def compiled_gpt2_step(native, steps=3):
    """GPT-2 trained by one compiled function that holds the whole torch.amp step (the
    forward in the block, ``scaler.scale(loss).backward()``, ``scaler.step(opt)`` with a
    foreach AdamW, ``scaler.update()``); the losses, weights and scales, and the graph
    breaks dynamo counted (each reason with its count)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if native:
        scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
        block = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    else:
        scaler = amp.GradScaler("cpu", **SCALER_ARGS)
        block = lambda: amp.autocast("cpu", dtype=torch.bfloat16, contract=False)  # noqa: E731

    @torch.compile(backend="aot_eager")
    def step(ids):
        with block():
            loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    losses, scales = [], []
    for ids in _tokens()[:steps]:
        losses.append(step(ids).detach())
        scales.append(scaler.get_scale())
    breaks = sorted(counters["graph_break"].items())
    return {"losses": losses, "scales": scales, "params": [p.detach() for p in model.parameters()],
            "breaks": sum(n for _, n in breaks), "reasons": breaks}


def test_gpt2_whole_compiled_step_is_torch_amps_with_as_many_graph_breaks():
    """The whole step compiled: byte for byte torch.amp's, and no graph break more (the
    scaler's host work runs eagerly where torch.amp's does, and the optimizer's step is
    compiled where torch.amp's is)."""
    native, ours = compiled_gpt2_step(True), compiled_gpt2_step(False)
    assert all(torch.equal(a, b) for a, b in zip(ours["losses"], native["losses"]))
    assert ours["scales"] == native["scales"]
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], native["params"]))
    assert ours["breaks"] == native["breaks"], (ours["reasons"], native["reasons"])
