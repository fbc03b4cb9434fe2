"""apex's flows, fuzzed against a float32 reference, on either backend: random programs of
``amp.initialize`` (O1 or O2, one or two loss scales, SGD or Adam) and iterations of a
GAN step (D's loss on G's output detached, or not: then G's ``scale_loss`` must raise and
the step goes on after ``zero_grad``), D's loss alone, one block over both optimizers,
and D's loss accumulated with ``delay_unscale``; each with an inf planted in D's data
now and then. The reference runs the same program in plain float32 without unified_amp's
scaling, skipping by hand the steps whose data held the inf. After every iteration: each
skipped step left its parameters bit for bit, each other step lands within float16's
error of the reference, and each loss scale skipped exactly the planted overflows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import unified_amp as amp

from ..kits import load_kit
from .scaler_fuzz_common import rng_for, time_limit

FLOWS = ["gan", "gan-stale", "d-only", "shared", "delay"]


def make_program(seed: int, index: int) -> tuple[dict, list[tuple]]:
    rng = rng_for(seed, index, "apex")
    config = {"level": rng.choice(["O1", "O2"]), "num_losses": rng.choice([1, 2]),
              "opt_d": rng.choice(["sgd", "adam"]), "opt_g": rng.choice(["sgd", "adam"])}
    iterations = [(rng.choice(FLOWS), rng.random() < 0.25, rng.randrange(1 << 16))
                  for _ in range(rng.randint(1, 4))]
    return config, iterations


class World:
    """The models, optimizers and GradManager of one side (``amp_level`` None: the
    float32 reference)."""

    def __init__(self, kit: Any, config: dict, amp_level: str | None):
        self.kit = kit
        d = kit.apex_model("cpu", seed=1, sizes=(3, 6, 1), batch_norm=False)
        g = kit.apex_model("cpu", seed=2, sizes=(2, 6, 3), batch_norm=False)
        make = {"sgd": lambda ps: kit.sgd(ps, 0.05), "adam": lambda ps: kit.adam(ps, 1e-2)}
        opt_d = make[config["opt_d"]](list(d.parameters()))
        opt_g = make[config["opt_g"]](list(g.parameters()))
        if amp_level is not None:
            # max_loss_scale keeps float16's own gradients finite: the planted inf is the
            # only overflow, so the reference knows which steps to skip
            [d, g], [opt_d, opt_g] = amp.initialize(
                [d, g], [opt_d, opt_g], opt_level=amp_level,
                num_losses=config["num_losses"], low_dtype="float16", max_loss_scale=2.0**8)
        self.d, self.g, self.opt_d, self.opt_g = d, g, opt_d, opt_g
        self.gm = amp.GradManager(list(d.parameters()) + list(g.parameters()))
        self.is_amp = amp_level is not None
        # At O2 the model's float16 gradients that no scale_loss moved to the masters
        # are dropped at G's block (as apex does): nothing stale reaches a step, and
        # nothing raises; at O1 G's scale_loss refuses them.
        self.level = amp_level

    def weights(self) -> list[bytes]:
        return [self.kit.numpy(p).tobytes() for m in (self.d, self.g) for p in m.parameters()]

    def arrays(self, model: Any) -> list[np.ndarray]:
        return [self.kit.numpy(p) for p in model.parameters()]

    def backward(self, loss_fn: Any, opts: list[Any], loss_id: int, delay: bool = False,
                 overflow: bool = False) -> None:
        """One block: amp's scale_loss, or (the reference) a plain backward whose
        gradients are dropped when the data held the planted inf."""
        with self.gm:
            loss = loss_fn()
            if self.is_amp:
                with amp.scale_loss(loss, opts, loss_id=loss_id, delay_unscale=delay) as s:
                    self.gm.backward(s)
            else:
                self.gm.backward(loss)
        if not self.is_amp and overflow:
            for opt in opts:
                self.kit.zero_grad(opt)

    def step(self, opt: Any, skip: bool) -> None:
        if self.is_amp or not skip:
            opt.step()


def iteration(w: World, flow: str, plant: bool, data: int, ids: tuple[int, int]) -> dict:
    """One iteration; returns which optimizers the planted inf skips."""
    kit, rng = w.kit, np.random.RandomState(data)
    real = rng.randn(4, 3).astype(np.float32)
    if plant:
        real[0, 0] = np.inf
    z = kit.tensor(rng.randn(4, 2).astype(np.float32), "cpu")
    real_t, ones, zeros = (kit.tensor(a, "cpu") for a in (real, np.ones((4, 1), np.float32),
                                                   np.zeros((4, 1), np.float32)))
    d, g = w.d, w.g

    def loss_d(detach: bool = True, scale: float = 1.0) -> Any:
        fake = g(z).detach() if detach else g(z)
        return (kit.mse(d(real_t), ones) + kit.mse(d(fake), zeros)) * scale

    def loss_g() -> Any:
        return kit.mse(d(g(z)), ones)

    kit.zero_grad(w.opt_d)
    kit.zero_grad(w.opt_g)
    w.gm.zero_grad()
    if flow == "shared":  # one block over both optimizers (D's and G's gradients)
        w.backward(lambda: loss_d(detach=False) + loss_g(), [w.opt_d, w.opt_g], ids[0],
                   overflow=plant)
        w.step(w.opt_d, plant)
        w.step(w.opt_g, plant)
        return {"d": plant, "g": plant}
    if flow == "delay":  # D's loss as two halves, unscaled once
        w.backward(lambda: loss_d(scale=0.5), [w.opt_d], ids[0], delay=True)
        w.backward(lambda: loss_d(scale=0.5), [w.opt_d], ids[0], overflow=plant)
    else:
        w.backward(lambda: loss_d(detach=flow != "gan-stale"), [w.opt_d], ids[0],
                   overflow=plant)
    w.step(w.opt_d, plant)
    if flow == "d-only":
        return {"d": plant, "g": False}
    if flow == "gan-stale" and w.level == "O1":
        # D's backward filled G's gradients, scaled by D's scale: G's block refuses them
        with pytest.raises(RuntimeError, match="nothing will unscale them"):
            w.backward(loss_g, [w.opt_g], ids[1])
    kit.zero_grad(w.opt_g)
    w.gm.zero_grad()
    w.backward(loss_g, [w.opt_g], ids[1])
    w.step(w.opt_g, False)
    return {"d": plant, "g": False}


def stepped(w: World, name: str) -> list[np.ndarray]:
    """What the optimizer steps: the float32 masters at O2, else the model's weights."""
    opt = w.opt_d if name == "d" else w.opt_g
    return [w.kit.numpy(p) for group in opt.param_groups for p in group["params"]]


def flipped(ours: list, ref: list) -> bool:
    """Whether a ReLU gate differs between our forwards and the reference's (an input
    within float16's error of zero, rounded to the other side). Where our side ran more
    forwards (O1's refused gan-stale block), any reference input under 2**-10 of its
    largest counts."""
    if len(ours) != len(ref):
        return any(bool(a.size) and a.min() < 2.0**-10 * a.max()
                   for a in (np.abs(h[np.isfinite(h)]) for h in ref))
    for a, b in zip(ours, ref):
        a, b = a.astype(np.float32), b.astype(np.float32)
        both = np.isfinite(a) & np.isfinite(b)  # a planted inf's forward: that step is skipped
        if np.any((a[both] > 0) != (b[both] > 0)):
            return True
    return False


def run_program(kit: Any, seed: int, index: int) -> int:
    config, iterations = make_program(seed, index)
    ours, ref = World(kit, config, config["level"]), World(kit, config, None)
    ids = (0, 1) if config["num_losses"] == 2 else (0, 0)
    planted = [0, 0]
    waived = 0
    lr = {"sgd": 0.05, "adam": 1e-2}
    for i, (flow, plant, data) in enumerate(iterations):
        where = (f"apex fuzz ({kit.name}) seed={seed} index={index}: iteration {i}\n"
                 f"config: {config}\niterations: {iterations}")
        # Each iteration starts the reference from our weights, so that float16's error
        # does not pile up: a ReLU gate near zero could flip, and a step differ by its
        # whole size, however right the scaling.
        for name in ("d", "g"):
            model = getattr(ref, name)
            for p, a in zip(model.parameters(), stepped(ours, name)):
                kit.assign(p, a)
        before = {n: (ours.arrays(getattr(ours, n)), stepped(ours, n)) for n in ("d", "g")}
        for m in (ours.d, ours.g, ref.d, ref.g):
            m.gates = []
        skipped = iteration(ours, flow, plant, data, ids)
        iteration(ref, flow, plant, data, ids)
        gate_flipped = any(flipped(m.gates, r.gates) for m, r in ((ours.d, ref.d), (ours.g, ref.g)))
        waived += gate_flipped
        if plant:
            planted[ids[0]] += 1
        for name in ("d", "g"):
            weights, start = before[name]
            if skipped[name]:
                got = ours.arrays(getattr(ours, name)) + stepped(ours, name)
                assert all(np.array_equal(a, b) for a, b in zip(got, weights + start)), \
                    f"{where}\n{name}'s skipped step changed its weights"
                continue
            ours_step = [a - b for a, b in zip(stepped(ours, name), start)]
            ref_step = [a - b for a, b in zip(stepped(ref, name), start)]
            kind = config[f"opt_{name}"]
            assert all(np.all(np.isfinite(a)) for a in ours_step), \
                f"{where}\n{name}'s weights are not finite"
            if gate_flipped:
                # A ReLU gate of ours and the reference's differ (an input within
                # float16's error of zero, rounded to the other side): the two computed
                # different branches of the function, so no tolerance holds, and through
                # D's backward every element of G's gradient moves (seed 39, index 385:
                # D's pre-activation 2.3e-6 after D's Adam step, G's step 51% off on
                # MegEngine at O1, O2 and O3 alike, 0.07% with D stepped by SGD instead;
                # seed 40, index 281 on both backends). Counted, and left at finiteness.
                continue
            for a, b in zip(ours_step, ref_step):
                # an element may be off by about its tensor's largest step: a ReLU gate
                # within float16's error of zero flips (seed 7, index 154: a
                # pre-activation of 3.9e-5); Adam's steps are about lr each, of either
                # sign for a near-zero gradient
                atol = (2 * np.abs(b).max() if kind == "sgd" else 2.5 * lr[kind]) + 1e-4
                np.testing.assert_allclose(a, b, rtol=2e-2, atol=atol, err_msg=where)
            if kind == "sgd":  # and the step as a whole: a factor 2 fails here
                a, b = np.concatenate([x.ravel() for x in ours_step]), \
                    np.concatenate([x.ravel() for x in ref_step])
                assert np.linalg.norm(a - b) <= 0.5 * np.linalg.norm(b) + 1e-4, (
                    f"{where}\n{name}'s step is {np.linalg.norm(a):.4g} long, the"
                    f" reference's {np.linalg.norm(b):.4g}")
    for k in set(ids):
        assert amp.loss_scaler(k).stats()["skipped_steps"] == planted[k], (
            f"apex fuzz ({kit.name}) seed={seed} index={index}: loss scale {k} skipped"
            f" {amp.loss_scaler(k).stats()['skipped_steps']} steps, {planted[k]} planted")
    return len(iterations), waived


@time_limit(0.5)
def test_apex_flows_against_a_float32_reference(fuzz):
    kit = load_kit(amp.get_backend().name)
    programs = iterations = waived = 0
    for index in fuzz.programs(6):
        with kit.on_device("cpu"):
            ran, gated = run_program(kit, fuzz.seed, index)
        iterations, waived, programs = iterations + ran, waived + gated, programs + 1
    print(f"\napex fuzz ({kit.name}), seed {fuzz.seed}: {programs} programs,"
          f" {iterations} iterations, {waived} with a ReLU gate flipped by float16's rounding"
          f" (their steps checked finite only)")
