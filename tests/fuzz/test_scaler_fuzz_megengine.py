"""Differential fuzz of GradScaler against megengine.amp.GradScaler, in megengine.amp's
call forms: random programs of up to 24 calls (automatic mode ``scaler.backward(gm, loss,
unscale_grad=..., update_scale=...)``, manual mode ``gm.backward(loss,
dy=tensor(scaler.scale_factor))`` + ``unscale(gm.attached_tensors())``, planted inf/NaN
losses and gradients, accumulation, ``update()`` and ``update(new_scale)``, clipping,
``opt.step()`` and ``clear_grad()`` of one or two optimizers, state_dict round trips).
Tiny tensors: MegEngine's CPU build is slow. See scaler_fuzz_common.py for what is
compared."""

from __future__ import annotations

from typing import Any

import megengine as mge
import megengine.amp
import megengine.module as MM
import megengine.optimizer as MO
import numpy as np
from megengine.autodiff import GradManager

import unified_amp as amp

from .scaler_fuzz_common import (Parted, Tally, differences, first_difference, misuse,
                                 rng_for, run_call, time_limit)

OPTIMIZERS = {
    "sgd": lambda ps: MO.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: MO.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: MO.Adam(ps, lr=0.01),
    "adamw": lambda ps: MO.AdamW(ps, lr=0.01),
}


def make_program(seed: int, index: int) -> tuple[dict, list[tuple]]:
    rng = rng_for(seed, index, "megengine-scaler")
    n_opt = rng.choice([1, 2])
    config = {
        "init_scale": rng.choice([2.0**3, 2.0**10, 2.0**16]),
        # growth_interval=0 turns megengine.amp's checks off (a listed difference in
        # prose: an overflow then reaches the weights), so it is not drawn
        "growth_interval": rng.choice([1, 2, 3, 2000]),
        "optimizers": [rng.choice(sorted(OPTIMIZERS)) for _ in range(n_opt)],
    }
    calls: list[tuple] = []
    while len(calls) < 24:
        it: list[tuple] = []
        manual = rng.random() < 0.4
        n_back = rng.choice([1, 1, 2])
        for i in range(n_back):
            plant = rng.choice([None] * 6 + ["inf", "nan", "loss-inf"])
            which = rng.choice(["both"] * 9 + ["first"])
            data = rng.randrange(1 << 16)
            if manual:
                it.append(("manual", which, plant, data))
            else:
                last = i == n_back - 1
                it.append(("auto", which, plant, data, last or rng.random() < 0.2,
                           rng.random() < 0.85))
        if rng.random() < 0.1:
            it.append(("poison", rng.choice(["inf", "nan"])))
        if manual:
            it.append(("unscale",))
            if rng.random() < 0.3:
                it.append(("clip", rng.choice([0.1, 10.0])))
            it.append(("update", None) if rng.random() < 0.85 else
                      ("update", rng.choice([2.0**5, 3.0])))
        elif not [c for c in it if c[0] == "auto"][-1][5]:  # no update of its own
            it.append(("update", None))
        for k in range(n_opt):
            it.append(("step", k))
        if rng.random() < 0.15:
            it.append(("roundtrip",))
        for k in range(n_opt):
            it.append(("clear_grad", k))
        misuse(rng, it, lambda: rng.choice([("unscale",), ("update", None), ("step", 0),
                                            ("clear_grad", 0)]))
        calls.extend(it)
    return config, calls[: rng.randint(1, 24)]


class World:
    def __init__(self, cls: Any, config: dict):
        self.cls, self.config = cls, config
        rng = np.random.RandomState(0)
        self.first, self.second = MM.Linear(3, 4), MM.Linear(4, 2)
        for m in (self.first, self.second):
            m.weight._reset(mge.tensor(rng.randn(*m.weight.shape).astype(np.float32)))
            m.bias._reset(mge.tensor(rng.randn(*m.bias.shape).astype(np.float32)))
        groups = [list(self.first.parameters()), list(self.second.parameters())]
        if len(config["optimizers"]) == 1:
            groups = [groups[0] + groups[1]]
        self.opts = [OPTIMIZERS[n](ps) for n, ps in zip(config["optimizers"], groups)]
        self.gm = GradManager().attach(self.params())
        self.scaler = self.new_scaler()

    def new_scaler(self) -> Any:
        c = self.config
        return self.cls(init_scale=c["init_scale"], growth_interval=c["growth_interval"])

    def params(self) -> list:
        return [*self.first.parameters(), *self.second.parameters()]

    def loss(self, which: str, plant: Any, data: int) -> Any:
        x = np.random.RandomState(data).randn(3, 3).astype(np.float32)
        if plant in ("inf", "nan"):
            x[0, 0] = float(plant)
        h = self.first(mge.tensor(x))
        out = self.second(h) if which == "both" else h
        loss = (out ** 2).mean()
        return loss * float("inf") if plant == "loss-inf" else loss

    def call(self, call: tuple) -> None:
        kind, s = call[0], self.scaler
        if kind == "auto":
            _, which, plant, data, unscale_grad, update_scale = call
            with self.gm:
                s.backward(self.gm, self.loss(which, plant, data), unscale_grad=unscale_grad,
                           update_scale=update_scale)
        elif kind == "manual":
            _, which, plant, data = call
            with self.gm:
                self.gm.backward(self.loss(which, plant, data), dy=mge.tensor(s.scale_factor))
        elif kind == "poison":
            grads = [p for p in self.params() if p.grad is not None]
            if grads:
                g = grads[0].grad.numpy().copy()
                g.flat[0] = float(call[1])
                grads[0].grad._reset(mge.tensor(g))
        elif kind == "unscale":
            s.unscale(self.gm.attached_tensors())
        elif kind == "clip":
            MO.clip_grad_norm(self.params(), call[1])
        elif kind == "update":
            s.update() if call[1] is None else s.update(new_scale=call[1])
        elif kind == "step":
            self.opts[call[1]].step()
        elif kind == "clear_grad":
            self.opts[call[1]].clear_grad()
        elif kind == "roundtrip":
            state = s.state_dict()
            self.scaler = self.new_scaler()
            self.scaler.load_state_dict(state)
        else:
            raise AssertionError(f"unknown call {call!r}")

    def snapshot(self) -> dict[str, Any]:
        state = self.scaler.state_dict()
        snap: dict[str, Any] = {"scale_factor": float(self.scaler.scale_factor),
                                "growth_tracker": int(state["_growth_tracker"])}
        for i, p in enumerate(self.params()):
            snap[f"param {i}"] = p.numpy().tobytes()
            snap[f"grad {i}"] = None if p.grad is None else p.grad.numpy().tobytes()
        for k, opt in enumerate(self.opts):
            for pid, st in sorted(opt.state_dict()["state"].items()):
                for key, v in sorted(st.items()):
                    v = v.numpy() if isinstance(v, mge.Tensor) else np.asarray(v)
                    snap[f"optimizer {k} state {pid}.{key}"] = (str(v.dtype), v.tobytes())
        return snap


def auto_accumulation(calls: list[tuple], held: bool, n_opt: int) -> bool:
    """The call is scaler.backward(gm, loss) into gradients (``held``: some were there
    before it) that were already unscaled, by an earlier automatic backward or by
    unscale(): megengine.amp unscales the mix, ours the true sum."""
    if calls[-1][0] != "auto" or not held:
        return False
    for call in reversed(calls[:-1]):
        if call[0] == "manual" or (call[0] == "clear_grad" and n_opt == 1):
            return False
        if call[0] == "unscale" or (call[0] == "auto" and call[4]):
            return True
    return False


# What must hold where the worlds part at a listed difference (beyond its message).
CONDITIONS = {
    "megengine-missing-gradient": lambda world: any(p.grad is None for p in world.params()),
}


def run_program(seed: int, index: int, table: dict, tally: Tally) -> None:
    config, calls = make_program(seed, index)
    native, ours = World(megengine.amp.GradScaler, config), World(amp.GradScaler, config)
    done: list[tuple] = []

    def where() -> str:
        return (f"scaler fuzz (megengine) seed={seed} index={index}: after {len(done)}"
                f" calls\nconfig: {config}\ncalls: {done}")

    tally.programs += 1
    try:
        for call in calls:
            done.append(call)
            tally.calls += 1
            held = any(p.grad is not None for p in ours.params())
            went_on = run_call("megengine", table, lambda: native.call(call),
                               lambda: ours.call(call), where)
            a, b = native.snapshot(), ours.snapshot()
            key = first_difference(a, b)
            if key is None and not went_on:
                tally.both_refused += 1
                return
            if key is None:
                tally.compared += 1
                continue
            if went_on and auto_accumulation(done, held, len(config["optimizers"])):
                raise Parted(table["auto-accumulation-true-sum"])
            raise AssertionError(f"{where()}\nthe worlds differ at {key}: megengine.amp"
                                 f" {a.get(key)!r}, ours {b.get(key)!r}")
    except Parted as parted:
        check = CONDITIONS.get(parted.difference.id)
        if check is not None and not check(ours):
            raise AssertionError(f"{where()}\nparted at {parted.difference.id!r}, but not in"
                                 f" the situation DROP_IN.md lists it for") from None
        tally.parted[parted.difference.id] = tally.parted.get(parted.difference.id, 0) + 1


@time_limit(0.2)
def test_scaler_against_megengine_amp(fuzz):
    table = differences()
    tally = Tally()
    for index in fuzz.programs(30):
        run_program(fuzz.seed, index, table, tally)
    print(f"\nscaler fuzz (megengine), seed {fuzz.seed}: {tally.line()}")
    assert tally.compared > tally.calls // 3, tally.line()
