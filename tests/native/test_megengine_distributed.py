"""MegEngine's data parallelism through amp.GradManager(callbacks=...): the callbacks go to
MegEngine's own GradManager, so ``dist.make_allreduce_cb("mean")`` works, and the scaler
checks the all-reduced gradients, so every rank skips together.

MegEngine's collectives run on GPUs with NCCL only (megengine.distributed rejects
"cpu"), so on a CPU machine the all-reduce is a stand-in built like
make_allreduce_cb -- it asks for the GradManager running backward, registers a flush
after backward and returns TensorFutures -- that averages with a simulated rank 1. The
same test runs the real NCCL path where a CUDA build of MegEngine sees 2 GPUs.
"""

import weakref

import numpy as np
import pytest

import megengine as mge
import megengine.distributed as dist
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as optim
from megengine.autodiff import GradManager as NativeGradManager
from megengine.autodiff.grad_manager import get_backwarding_grad_manager
from megengine.distributed.helper import TensorFuture

import unified_amp as amp

STEPS, OVERFLOW_AT, INIT = 5, 2, 2.0**8
WORLD = 2
NO_NCCL = ("needs a CUDA build of MegEngine that sees 2 GPUs: megengine.distributed runs"
           " on NCCL only, and this machine has {}")


def make_model():
    rng = np.random.RandomState(0)
    model = M.Sequential(M.Linear(6, 8), M.ReLU(), M.Linear(8, 3))
    for p in model.parameters():
        p._reset(mge.tensor(rng.randn(*p.shape).astype("float32") * 0.3))
    return model


def data(step, rank, overflow=False):
    rng = np.random.RandomState(100 * step + rank)
    x = rng.randn(4, 6).astype("float32")
    if overflow:
        x[0, 0] = np.inf
    return x, rng.randint(0, 3, 4).astype("int32")


def planted(step, rank):
    return rank == 1 and step == OVERFLOW_AT


def loss_of(model, x, y):
    return F.nn.cross_entropy(model(mge.tensor(x)), mge.tensor(y))


def weights(model):
    return [p.numpy().copy() for p in model.parameters()]


def train(rank, callback, before_step=None):
    """The data-parallel loop of one rank: unified_amp's GradManager with an all-reduce
    callback, scaler.backward(gm, loss) (megengine.amp's form), the optimizer's step."""
    model = make_model()
    gm = amp.GradManager(model.parameters(), callbacks=[callback])
    opt = optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_scale=INIT, growth_interval=2)
    history = []
    for step in range(STEPS):
        if before_step is not None:
            before_step(step, model, scaler)
        x, y = data(step, rank, overflow=planted(step, rank))
        with gm:
            scaler.backward(gm, loss_of(model, x, y))
        opt.step().clear_grad()
        stats = scaler.stats()
        history.append((stats["scale"], stats["last_step_skipped"]))
    return history, weights(model)


class StandInAllReduce:
    """make_allreduce_cb("mean")'s protocol with the peer simulated: each gradient is
    averaged with ``self.peer[id(param)]`` when MegEngine flushes after backward."""

    def __init__(self):
        self.peer = {}
        self.pending = []
        self.marked = weakref.WeakSet()
        self.managers = []

    def __call__(self, param, grad):
        gm = get_backwarding_grad_manager()
        assert isinstance(gm, NativeGradManager)  # what make_allreduce_cb asserts too
        self.managers.append(gm)
        if gm not in self.marked:
            gm._register_after_backward_callback(self.flush)
            self.marked.add(gm)
        future = TensorFuture(ack=False)
        self.pending.append((param, grad, future))
        return future

    def flush(self):
        for param, grad, future in self.pending:
            future.set((grad + self.peer[id(param)]) / WORLD)
        self.pending = []


def standin_run():
    """Rank 0, with rank 1's (scaled) gradient computed on the same weights before each
    step: under data parallelism every rank holds the same weights."""
    allreduce = StandInAllReduce()

    def peer_gradients(step, model, scaler):
        peer = NativeGradManager().attach(model.parameters())
        x, y = data(step, 1, overflow=planted(step, 1))
        with peer:
            loss = loss_of(model, x, y)
            peer.backward(loss, F.full_like(loss, scaler.get_scale()))
        allreduce.peer = {id(p): p.grad for p in model.parameters()}
        for p in model.parameters():
            p.grad = None

    history, w = train(0, allreduce, before_step=peer_gradients)
    assert allreduce.managers  # the callback ran inside MegEngine's own backward
    return [(history, w)]


def nccl_rank():
    return train(dist.get_rank(), dist.make_allreduce_cb("mean"))


def global_batch_run():
    """One process over both ranks' data (the mean over the global batch)."""
    model = make_model()
    opt = optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_scale=INIT, growth_interval=2)
    gm = amp.GradManager(model.parameters())
    for step in range(STEPS):
        parts = [data(step, r, overflow=planted(step, r)) for r in range(WORLD)]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        with gm:
            scaler.backward(gm, loss_of(model, x, y))
        opt.step().clear_grad()
    return weights(model)


def expected_history():
    # 256 -> growth after 2 clean steps; the planted step backs off; then grows again.
    return [(INIT, False), (INIT * 2, False), (INIT, True), (INIT, False), (INIT * 2, False)]


def nccl_available():
    if not mge.is_cuda_available():
        return False, "a CPU build (or no GPU)"
    if mge.get_device_count("gpu") < WORLD:
        return False, f"{mge.get_device_count('gpu')} GPU(s)"
    return True, ""


@pytest.mark.parametrize("collective", ["stand-in on CPU", "NCCL on 2 GPUs"])
def test_allreduce_callback_every_rank_skips_and_matches_the_global_batch(collective):
    if collective == "NCCL on 2 GPUs":
        ok, why = nccl_available()
        if not ok:
            pytest.skip(NO_NCCL.format(why))
        ranks = dist.launcher(nccl_rank, n_gpus=WORLD)()
    else:
        ranks = standin_run()
    reference = global_batch_run()
    for history, w in ranks:
        assert history == expected_history()
        for a, b in zip(w, reference):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for history, w in ranks[1:]:
        assert history == ranks[0][0]
        for a, b in zip(w, ranks[0][1]):
            np.testing.assert_array_equal(a, b)


def hand_sharded_rank():
    """Each rank trains its own parameters; rank 1 computes no gradient at the overflow
    step, where rank 0's overflow must still make it back off (process_group)."""
    rank = dist.get_rank()
    model = make_model()
    gm = amp.GradManager(model.parameters())
    opt = optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_scale=INIT, growth_interval=2,
                            process_group=dist.group.WORLD)
    scales = []
    for step in range(STEPS):
        x, y = data(step, rank, overflow=(rank == 0 and step == OVERFLOW_AT))
        with gm:
            if rank == 1 and step == OVERFLOW_AT:
                scaler.backward(gm, mge.tensor(0.0))  # reaches none of its parameters
            else:
                scaler.backward(gm, loss_of(model, x, y))
        opt.step().clear_grad()
        scales.append(scaler.get_scale())
    return scales


def test_process_group_agrees_hand_sharded_parameters_over_nccl():
    ok, why = nccl_available()
    if not ok:
        pytest.skip(NO_NCCL.format(why))
    scales = dist.launcher(hand_sharded_rank, n_gpus=WORLD)()
    assert scales[0] == scales[1] == [s for s, _ in expected_history()]


def test_process_group_needs_megengine_distributed():
    with pytest.raises(RuntimeError, match="megengine.distributed is not initialised"):
        amp.GradScaler(process_group=dist.group.WORLD)
