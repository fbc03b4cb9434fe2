"""Whole training steps under ``megengine.jit.trace``, run in a process of their own by
test_megengine_trace.py (``python megengine_trace_scenarios.py NAME...``), because a
host read inside a trace can kill the process (SIGSEGV) rather than raise.

Each scenario runs the same loop eagerly and traced (``symbolic=False`` and ``True``),
with overflows planted in the inputs, and prints one JSON line per mode: either the
traced run's weights, scale history and skipped steps next to the eager run's, or the
error the traced run raised and whether the weights and the scale were left as they were.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import numpy as np

import megengine as mge
import megengine.functional as F
import megengine.module as M
import megengine.optimizer as optim
from megengine.autodiff import GradManager
from megengine.jit import trace as jit_trace
from megengine.jit.tracing import is_tracing

import unified_amp as amp

STEPS = 6
OVERFLOW_AT = (1, 4)  # the second step, so that a replay (not the recording) meets one
INIT, INTERVAL = 2.0**4, 2


class Flatten(M.Module):
    def forward(self, x):
        return F.flatten(x, 1)


def model_and_data(kind="mlp"):
    """The scenarios' model and batches: an MLP, or ("conv_bn") a conv net with
    BatchNorm, whose traced SGD step with weight decay once differed from eager."""
    rng = np.random.RandomState(0)
    if kind == "conv_bn":
        model = M.Sequential(M.Conv2d(2, 4, 3, padding=1), M.BatchNorm2d(4), M.ReLU(),
                             Flatten(), M.Linear(64, 4))
        shape = (8, 2, 4, 4)
    else:
        model = M.Sequential(M.Linear(8, 16), M.ReLU(), M.Linear(16, 4))
        shape = (8, 8)
    for p in model.parameters():
        p._reset(mge.tensor(rng.randn(*p.shape).astype("float32") * 0.3))
    batches = [(rng.randn(*shape).astype("float32"), rng.randint(0, 4, 8).astype("int32"))
               for _ in range(STEPS)]
    return model, batches


def batch(batches, i, overflow):
    x, y = batches[i]
    x = x.copy()
    if overflow:
        x[0, 0] = np.inf
    return mge.tensor(x), mge.tensor(y)


def weights(model):
    return [p.numpy().tobytes().hex() for p in model.parameters()]


# -- the step bodies: (model, gm, opt, scaler, x, y) -> loss ----------------------------
def loss_of(model, x, y):
    with amp.autocast():
        return F.nn.cross_entropy(model(x), y)


def torch_form(model, gm, opt, scaler, x, y):
    """torch.amp's loop: scale, backward, step (which unscales and skips), update."""
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(scaler.scale(loss))
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    return loss


def unscale_then_step(model, gm, opt, scaler, x, y):
    """Manual mode with torch.amp's explicit unscale_ before the step."""
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(scaler.scale(loss))
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    return loss


def clip_native(model, gm, opt, scaler, x, y):
    """unscale_, then MegEngine's own clip (it returns the norm as a tensor)."""
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(scaler.scale(loss))
    scaler.unscale_(opt)
    optim.clip_grad_norm(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    return loss


def clip_unified(model, gm, opt, scaler, x, y):
    """unscale_, then amp.clip_grad_norm, which returns the norm as a Python float."""
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(scaler.scale(loss))
    scaler.unscale_(opt)
    amp.clip_grad_norm(opt, 0.5)
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    return loss


def backward_then_step(model, gm, opt, scaler, x, y):
    """Automatic mode, the scaler's own backward, unscaled by step()."""
    with gm:
        loss = loss_of(model, x, y)
        scaler.backward(gm, loss, unscale_grad=False)
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    return loss


def watched(model, gm, opt, scaler, x, y):
    """torch_form with the overflow report's hooks: watch() and trace_forward()."""
    return torch_form(model, gm, opt, scaler, x, y)


def automatic(model, gm, opt, scaler, x, y):
    """megengine.amp's automatic mode: backward unscales, drops and updates."""
    with gm:
        loss = loss_of(model, x, y)
        scaler.backward(gm, loss)
    opt.step().clear_grad()
    return loss


def automatic_then_traced(model, gm, opt, scaler, x, y):
    """automatic eagerly (its backward writes the trace copy ahead of the update), and
    backward_then_step inside the trace, which starts from that copy. The two forms
    train alike: an overflow leaves the weights and the optimizer state as they were."""
    if is_tracing():
        return backward_then_step(model, gm, opt, scaler, x, y)
    return automatic(model, gm, opt, scaler, x, y)


def manual_unscale(model, gm, opt, scaler, x, y):
    """megengine.amp's manual mode with unscale(gm), which drops overflowed grads."""
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(scaler.scale(loss))
    scaler.unscale(gm)
    opt.step().clear_grad()
    scaler.update()
    return loss


def scale_factor_dy(model, gm, opt, scaler, x, y):
    """megengine.amp's manual mode: the scale read as a number and passed as dy."""
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(loss, dy=mge.tensor(scaler.scale_factor))
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    return loss


def new_scale(model, gm, opt, scaler, x, y):
    """update(new_scale=...): a host number that a trace would freeze."""
    loss = torch_form_without_update(model, gm, opt, scaler, x, y)
    scaler.update(new_scale=8.0)
    return loss


def torch_form_without_update(model, gm, opt, scaler, x, y):
    with gm:
        loss = loss_of(model, x, y)
        gm.backward(scaler.scale(loss))
    scaler.step(opt)
    opt.clear_grad()
    return loss


def read_state(model, gm, opt, scaler, x, y):
    """state_dict() inside the step: a host read of the scale."""
    loss = torch_form(model, gm, opt, scaler, x, y)
    scaler.state_dict()
    return loss


# name -> (step body, options): "adam" (Adam, whose state holds a step count),
# "model" (model_and_data's kind), "weight_decay" and "momentum" (SGD's),
# "eager_at" (steps run eagerly between traced ones: the scale moves between the host and
# the device both ways), "trace" (keyword arguments of trace), "backoff" (the factor),
# "modes" (the values of symbolic to trace with).
SCENARIOS = {f.__name__: (f, {}) for f in (
    torch_form, unscale_then_step, clip_native, clip_unified, backward_then_step, watched,
    automatic, manual_unscale,
    scale_factor_dy, new_scale, read_state)}
SCENARIOS.update({
    # MegEngine's graph optimizer (opt_level=2, the default) fuses Adam's elementwise
    # ops and rounds differently from eager, amp or not; at opt_level=0 the traced and
    # eager steps agree bit for bit, so that is where the scaler's part is compared.
    "adam": (torch_form, {"adam": True, "trace": {"opt_level": 0}}),
    "eager_between": (torch_form, {"eager_at": (0, 1, 4)}),
    # SGD with weight decay on a conv net with BatchNorm, at the default opt_level:
    # MegEngine's graph optimizer reorders the update's sum (momentum, gradient, decay)
    # by the age of its terms, so any op of the scaler's before it changed the bits
    # until the step ran the update's inputs through one kernel (device_scale.py).
    "weight_decay": (torch_form, {"model": "conv_bn", "weight_decay": 1e-2}),
    "weight_decay_clip": (clip_native, {"model": "conv_bn", "weight_decay": 1e-2}),
    # Clipping before plain SGD: MegEngine alone traces this to other bits than eager
    # at the default opt_level (test_megengine_trace.py), the scaler's step does not.
    "clip_sgd": (clip_native, {"momentum": 0.0}),
    # Eager automatic steps, the last of them an overflow, then traced steps that start
    # from the copy that overflow corrected.
    "automatic_first": (automatic_then_traced, {"eager_at": (0, 1)}),
    # MegEngine leaves its without_host hooks installed after an error (making the next
    # model fails), so this one traces once, and MegEngine's own AssertionError on the
    # step's missing outputs follows ours: the result names the whole chain.
    "without_host": (torch_form, {"trace": {"without_host": True}, "modes": (False,)}),
    "inexact_backoff": (torch_form, {"backoff": 0.3}),
    # MegEngine's optimizers update in place under this variable (read at each step).
    "inplace_update": (torch_form, {"inplace": True}),
})


def run(body, symbolic, adam=False, eager_at=(), trace=None, backoff=0.5, inplace=False,
        model="mlp", weight_decay=0.0, momentum=0.9):
    """The loop, eager (symbolic None) or traced. Returns a dict of what it did."""
    if inplace:
        os.environ["MEGENGINE_INPLACE_UPDATE"] = "1"
        try:
            return run(body, symbolic, adam, eager_at, trace, backoff)
        finally:
            del os.environ["MEGENGINE_INPLACE_UPDATE"]
    model, batches = model_and_data(model)
    gm = GradManager().attach(model.parameters())
    if adam:
        opt = optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=momentum,
                        weight_decay=weight_decay)
    scaler = amp.GradScaler(init_scale=INIT, growth_interval=INTERVAL,
                            backoff_factor=backoff)
    forward = contextlib.nullcontext()
    if body is watched:
        scaler.watch(model)
        forward = amp.trace_forward(model)

    # The model and optimizer go in as arguments, as trace(without_host=True) needs.
    def step(x, y, model, opt):
        return body(model, gm, opt, scaler, x, y)

    traced = step if symbolic is None else jit_trace(step, symbolic=symbolic,
                                                     **(trace or {}))
    with forward:
        return loop(model, opt, scaler, batches, step, traced, eager_at)


def loop(model, opt, scaler, batches, step, traced, eager_at):
    history, losses = [], []
    for i in range(STEPS):
        fn = step if i in eager_at else traced
        before = (weights(model), scaler.get_scale())
        try:
            loss = fn(*batch(batches, i, i in OVERFLOW_AT), model, opt)
        except Exception as exc:  # the result says which, and what it left behind
            chain, cause = [], exc
            while cause is not None:
                chain.append((type(cause).__name__, str(cause)))
                cause = cause.__context__
            first = chain[-1]  # the error raised first
            return {"step": i, "error": first[0], "message": first[1], "chain": chain,
                    "weights_unchanged": weights(model) == before[0],
                    "scale_unchanged": scaler.get_scale() == before[1],
                    }
        history.append(scaler.get_scale())
        losses.append(float(loss.numpy().reshape(-1)[0]))
    stats = scaler.stats()
    return {"weights": weights(model), "history": history, "losses": repr(losses),
            "skipped": stats["skipped_steps"], "steps": stats["steps"],
            "report": scaler.last_overflow() is not None}


def main(name):
    """Prints one JSON line per traced mode of scenario ``name``."""
    body, options = SCENARIOS[name]
    options = dict(options)
    modes = options.pop("modes", (False, True))
    eager = run(body, None, **{k: v for k, v in options.items() if k != "trace"})
    for symbolic in modes:
        traced = run(body, symbolic, **options)
        print(json.dumps({"name": name, "symbolic": symbolic, "eager": eager,
                          "traced": traced}), flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        main(arg)
