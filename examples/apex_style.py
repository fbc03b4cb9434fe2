"""apex-style training on either framework: ``amp.initialize`` and ``amp.scale_loss``.

Two patterns from apex-era code, each step written once against unified_amp:

- a generator (an MLP with batch norm) learns a fixed mapping from noise codes to 2-D
  points with a reconstruction loss: ``initialize(model, opt, opt_level=...,
  num_losses=1)`` and ``scale_loss(loss, opt, loss_id=0)``, at any of O0-O3;
- a GAN learns a mixture of Gaussians (the data of ``examples.gan``) with
  ``[D, G], [opt_D, opt_G] = initialize([D, G], [opt_D, opt_G], num_losses=2)``: D's
  loss with ``loss_id=0``, G's with ``loss_id=1``, so each keeps its own loss scale.

The backward pass is ``gm.backward(scaled_loss)``, which both frameworks run; torch
code may keep apex's ``scaled_loss.backward()`` (docs/APEX.md).

    UNIFIED_AMP_BACKEND=megengine python -m examples.apex_style --compare
    python -m examples.apex_style --pattern gan --opt-level O1 --steps 300
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

import unified_amp as amp

from . import frameworks, gan
from .gan import mode_centres, mode_report

LEVELS = ("O0", "O1", "O2", "O3")


def generator_step(*, model: Any, optimizer: Any, gm: amp.GradManager,
                   loss_fn: Callable[[Any, Any], Any], inputs: Any, targets: Any) -> float:
    """One apex-style step: forward, loss, scaled backward, step (skipped on overflow).

    Returns:
        The loss, read on the host.
    """
    with gm:
        loss = loss_fn(model(inputs), targets)  # the model hands back float32
        with amp.scale_loss(loss, optimizer, loss_id=0) as scaled_loss:
            gm.backward(scaled_loss)
    optimizer.step()  # steps the float32 master weights at O2 and copies them back
    gm.zero_grad()
    return loss.item()


def gan_step(*, generator: Any, discriminator: Any, gm_g: amp.GradManager,
             gm_d: amp.GradManager, opt_g: Any, opt_d: Any,
             bce: Callable[[Any, float], Any], real: Any, z_d: Any, z_g: Any
             ) -> tuple[float, float]:
    """One GAN iteration with a loss scale per loss: D with loss_id=0, G with 1.

    An overflow in D's loss backs off only D's scale and skips only D's step.

    Returns:
        (discriminator loss, generator loss).
    """
    with gm_d:
        fake = generator(z_d).detach()
        d_loss = bce(discriminator(real), 1.0) + bce(discriminator(fake), 0.0)
        with amp.scale_loss(d_loss, opt_d, loss_id=0) as scaled_loss:
            gm_d.backward(scaled_loss)
    opt_d.step()
    # A GradManager records one backward pass, so G's step runs D again (torch code
    # may instead reuse d_fake's graph with retain_graph=True: docs/APEX.md).
    with gm_g:
        g_loss = bce(discriminator(generator(z_g)), 1.0)
        with amp.scale_loss(g_loss, opt_g, loss_id=1) as scaled_loss:
            gm_g.backward(scaled_loss)
    opt_g.step()
    gm_d.zero_grad()
    gm_g.zero_grad()
    return d_loss.item(), g_loss.item()


def float16_safe_eps(optimizers: list[Any]) -> None:
    """Where the optimizer steps float16 weights itself (torch's O3: no float32 master
    weights), raises Adam's ``eps`` from 1e-8, which float16 rounds to zero (its
    smallest subnormal is 6e-8), to 1e-4: otherwise an element whose squared gradient
    underflows divides zero by zero on the first step, and the weights become NaN (as
    under apex, docs/APEX.md). Call after ``amp.initialize``; float32 steps (masters,
    or O0/O1) and bfloat16 (float32's exponent range) keep the default."""
    props = amp.opt_properties()
    if props.cast_model_type == "float16" and not props.master_weights:
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["eps"] = max(group["eps"], 1e-4)


def target_mapping(codes: np.ndarray, seed: int = 1234) -> np.ndarray:
    """The fixed mapping the generator learns: 2-D points from noise codes."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(codes.shape[1], 16)) / np.sqrt(codes.shape[1])
    b = rng.normal(size=(16, 2)) / 4.0
    return (np.tanh(codes @ a) @ b).astype(np.float32)


def train_generator(*, opt_level: str = "O1", steps: int = 200, batch_size: int = 64,
                    noise_dim: int = 4, hidden: int = 32, lr: float = 3e-3,
                    low_dtype: str | None = None, seed: int = 0, progress: bool = False
                    ) -> dict[str, Any]:
    """Trains the generator at ``opt_level`` on the active backend.

    Returns:
        A dict: ``losses`` (per step), ``properties`` (``amp.opt_properties()``),
        ``scaler`` (loss scale 0's ``stats()``), ``weight_dtype`` (of the first layer)
        and ``model``.
    """
    fw = frameworks.get()
    rng = np.random.default_rng(seed)
    fw.seed(seed)
    model = fw.mlp([noise_dim, hidden, hidden, 2], batch_norm=True)
    optimizer = fw.adam(model.parameters(), lr=lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      num_losses=1, low_dtype=low_dtype)
    float16_safe_eps([optimizer])
    gm = amp.GradManager(model.parameters())
    losses = []
    bar = tqdm(range(steps), desc=f"{fw.name} generator {opt_level}",
               disable=not progress)
    for _ in bar:
        codes = rng.normal(size=(batch_size, noise_dim)).astype(np.float32)
        losses.append(generator_step(model=model, optimizer=optimizer, gm=gm,
                                     loss_fn=fw.mse, inputs=fw.tensor(codes),
                                     targets=fw.tensor(target_mapping(codes))))
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    bar.close()
    first = next(iter(model.parameters()))
    return {"losses": losses, "properties": amp.opt_properties(),
            "scaler": amp.loss_scaler(0).stats(), "weight_dtype": fw.dtype_name(first),
            "model": model}


def train_gan(*, opt_level: str = "O1", steps: int = 300, batch_size: int = 64,
              noise_dim: int = 4, hidden: int = 32, modes: int = 4, radius: float = 2.0,
              std: float = 0.1, lr: float = 2e-3, low_dtype: str | None = None,
              seed: int = 0, progress: bool = False) -> dict[str, Any]:
    """Trains the GAN at ``opt_level`` with one loss scale per loss.

    Returns:
        A dict: ``d_losses``, ``g_losses``, ``scalers`` (both ``stats()``),
        ``distance_before``/``distance_after`` (mean distance of generated points to
        the nearest mode), ``generator``, ``discriminator``.
    """
    fw = frameworks.get()
    rng = np.random.default_rng(seed)
    centres = mode_centres(modes, radius)
    fw.seed(seed)
    generator, discriminator, opt_g, opt_d = gan.models(fw, noise_dim, hidden, lr)
    [discriminator, generator], [opt_d, opt_g] = amp.initialize(
        [discriminator, generator], [opt_d, opt_g], opt_level=opt_level, num_losses=2,
        low_dtype=low_dtype)
    float16_safe_eps([opt_d, opt_g])
    gm_d = amp.GradManager(discriminator.parameters())
    gm_g = amp.GradManager(generator.parameters())
    probe = fw.tensor(rng.normal(size=(1000, noise_dim)))

    def generated() -> np.ndarray:
        with fw.inference():
            return fw.numpy(generator(probe))

    distance_before, _ = mode_report(generated(), centres, std)
    d_losses, g_losses = [], []
    bar = tqdm(range(steps), desc=f"{fw.name} GAN {opt_level}", disable=not progress)
    for _ in bar:
        d_loss, g_loss = gan_step(
            generator=generator, discriminator=discriminator, gm_g=gm_g, gm_d=gm_d,
            opt_g=opt_g, opt_d=opt_d, bce=fw.bce_with_logits,
            **gan.batches(fw, batch_size, noise_dim, centres, std, rng))
        d_losses.append(d_loss)
        g_losses.append(g_loss)
        bar.set_postfix(d=f"{d_loss:.3f}", g=f"{g_loss:.3f}", refresh=False)
    bar.close()
    distance_after, _ = mode_report(generated(), centres, std)
    return {"d_losses": d_losses, "g_losses": g_losses,
            "scalers": [amp.loss_scaler(i).stats() for i in range(2)],
            "distance_before": distance_before, "distance_after": distance_after,
            "generator": generator, "discriminator": discriminator}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the example and prints a summary; returns the runs' results by name."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pattern", choices=("generator", "gan"), default="generator")
    p.add_argument("--opt-level", choices=LEVELS, default="O1")
    p.add_argument("--compare", action="store_true",
                   help="train the generator at every opt level and compare")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--low-dtype", choices=("float16", "bfloat16"), default=None,
                   help="the low precision (default: the device's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    common = dict(steps=args.steps, batch_size=args.batch_size, low_dtype=args.low_dtype,
                  seed=args.seed, progress=not args.no_progress)
    backend = amp.get_backend().name
    if args.pattern == "gan":
        r = train_gan(opt_level=args.opt_level, **common)
        print(f"GAN on {backend} at {args.opt_level}, {args.steps} iterations: distance"
              f" to the nearest mode {r['distance_before']:.3f} ->"
              f" {r['distance_after']:.3f}")
        for name, s in zip(("D (loss_id=0)", "G (loss_id=1)"), r["scalers"]):
            print(f"  {name}: scale {s['scale']:g}, {s['skipped_steps']} of {s['steps']}"
                  f" steps skipped")
        return {args.opt_level: r}
    levels = LEVELS if args.compare else (args.opt_level,)
    results = {lvl: train_generator(opt_level=lvl, **common) for lvl in levels}
    print(f"generator on {backend}, {args.steps} steps of {args.batch_size}")
    print(f"{'level':<6}{'weights':>10}{'masters':>9}{'loss scale':>12}{'skipped':>9}"
          f"{'first loss':>12}{'last 20 avg':>13}")
    for lvl, r in results.items():
        props, s = r["properties"], r["scaler"]
        scale = f"{s['scale']:g}" if s["enabled"] else "off"
        print(f"{lvl:<6}{r['weight_dtype']:>10}{str(props.master_weights):>9}{scale:>12}"
              f"{s['skipped_steps']:>9}{r['losses'][0]:>12.4f}"
              f"{np.mean(r['losses'][-20:]):>13.4f}")
    return results


if __name__ == "__main__":
    main()
