"""A GAN learns a 2-D mixture of Gaussians, with AMP: two models, two optimizers, two
GradManagers and ONE GradScaler, updated once per iteration.

This is the pattern apex users wrote with ``amp.initialize(..., num_losses=2)`` and
``amp.scale_loss(loss, opt, loss_id=i)``: here each loss is scaled by the same scaler,
each optimizer is stepped through it (so each one's gradients are unscaled and checked
once, and a step whose gradients overflowed is skipped alone), and ``update()`` ends the
iteration, backing the scale off if either model overflowed. ``gan_step`` is written
once against unified_amp; the models, loss and optimizers come from
``examples.frameworks`` for the active backend.

    UNIFIED_AMP_BACKEND=megengine python -m examples.gan --steps 500
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

import unified_amp as amp

from . import frameworks, overflow


def mode_centres(modes: int, radius: float) -> np.ndarray:
    """The means of the mixture: ``modes`` points evenly spaced on a circle."""
    angles = 2 * np.pi * np.arange(modes) / modes
    return radius * np.stack([np.cos(angles), np.sin(angles)], axis=1)


def sample_real(n: int, centres: np.ndarray, std: float, rng: np.random.Generator
                ) -> np.ndarray:
    """``n`` points (n, 2) from the mixture with equal weights."""
    picks = rng.integers(0, len(centres), n)
    return (centres[picks] + rng.normal(0.0, std, (n, 2))).astype(np.float32)


def models(fw: Any, noise_dim: int, hidden: int, lr: float) -> tuple[Any, Any, Any, Any]:
    """The generator, the discriminator (MLPs) and their Adam optimizers.

    Returns:
        (generator, discriminator, generator's optimizer, discriminator's optimizer).
    """
    generator = fw.mlp([noise_dim, hidden, hidden, 2])
    discriminator = fw.mlp([2, hidden, hidden, 1])
    # beta1 = 0.5: the usual GAN choice, less momentum against a moving target.
    opt_g = fw.adam(generator.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = fw.adam(discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
    return generator, discriminator, opt_g, opt_d


def batches(fw: Any, batch_size: int, noise_dim: int, centres: np.ndarray, std: float,
            rng: np.random.Generator) -> dict[str, Any]:
    """One iteration's tensors for ``gan_step``: ``real`` samples and the noise
    ``z_d``, ``z_g`` of its two steps."""
    return {"real": fw.tensor(sample_real(batch_size, centres, std, rng)),
            "z_d": fw.tensor(rng.normal(size=(batch_size, noise_dim))),
            "z_g": fw.tensor(rng.normal(size=(batch_size, noise_dim)))}


def gan_step(*, generator: Any, discriminator: Any, gm_g: amp.GradManager,
             gm_d: amp.GradManager, opt_g: Any, opt_d: Any, scaler: amp.GradScaler,
             bce: Callable[[Any, float], Any], real: Any, z_d: Any, z_g: Any,
             precision: amp.autocast) -> tuple[float, float]:
    """One GAN iteration: a discriminator step, a generator step, one scale update.

    Args:
        generator, discriminator: the two networks.
        gm_g, gm_d: GradManagers attached to the generator's / discriminator's
            parameters only, so each backward fills only its own model's gradients.
        opt_g, opt_d: their optimizers.
        scaler: the one loss scaler both losses share.
        bce: ``bce(logits, label)`` -> mean binary cross-entropy against a constant label.
        real: a batch of real samples; z_d, z_g: noise batches for the two steps.
        precision: the autocast block for the forward passes.

    Returns:
        (discriminator loss, generator loss).
    """
    # Discriminator: real -> 1, generated -> 0. Detaching keeps the generator out of
    # this graph: its gradients are not wanted here.
    with gm_d:
        with precision:
            fake = generator(z_d).detach()
            d_loss = bce(discriminator(real), 1.0) + bce(discriminator(fake), 0.0)
        gm_d.backward(scaler.scale(d_loss))
    scaler.step(opt_d)  # unscales and checks D's gradients; skips D alone on overflow

    # Generator: make the (just updated) discriminator call its samples real. The
    # gradient flows through D, but only G's parameters are attached to gm_g.
    with gm_g:
        with precision:
            g_loss = bce(discriminator(generator(z_g)), 1.0)
        gm_g.backward(scaler.scale(g_loss))
    scaler.step(opt_g)

    scaler.update()  # once per iteration: backs off if either model's gradients overflowed
    gm_d.zero_grad()
    gm_g.zero_grad()
    return d_loss.item(), g_loss.item()


def mode_report(samples: np.ndarray, centres: np.ndarray, std: float
                ) -> tuple[float, int]:
    """How well ``samples`` cover the mixture.

    Returns:
        (mean distance from a sample to its nearest centre, how many modes got at
        least half their fair share of samples within 3 std of the centre).
    """
    dist = np.linalg.norm(samples[:, None, :] - centres[None], axis=2)
    nearest = dist.argmin(1)
    close = dist.min(1) < 3 * std
    counts = np.bincount(nearest[close], minlength=len(centres))
    fair = len(samples) / len(centres)
    return float(dist.min(1).mean()), int((counts >= fair / 2).sum())


def train(*, amp_enabled: bool = True, dtype: str | None = None, steps: int = 1000,
          batch_size: int = 128, noise_dim: int = 4, hidden: int = 64, modes: int = 4,
          radius: float = 2.0, std: float = 0.1, lr: float = 2e-3, seed: int = 0,
          progress: bool = False) -> dict[str, Any]:
    """Trains the GAN on the active backend.

    Returns:
        A dict: ``d_losses`` and ``g_losses`` (per iteration), ``distance_before`` /
        ``distance_after`` (mean distance of 1000 generated points to the nearest mode),
        ``modes_before`` / ``modes_after`` (modes covered), ``scaler`` (its ``stats()``),
        ``generator``, ``discriminator``.
    """
    fw = frameworks.get()
    rng = np.random.default_rng(seed)
    centres = mode_centres(modes, radius)
    fw.seed(seed)
    generator, discriminator, opt_g, opt_d = models(fw, noise_dim, hidden, lr)
    gm_g = amp.GradManager(generator.parameters())
    gm_d = amp.GradManager(discriminator.parameters())
    # One scaler for both models: overflow reports name either's parameters.
    scaler = amp.GradScaler(enabled=amp_enabled).watch(generator).watch(discriminator)
    precision = amp.autocast(enabled=amp_enabled, dtype=dtype)

    probe = fw.tensor(rng.normal(size=(1000, noise_dim)))

    def generated() -> np.ndarray:
        with fw.inference(), precision:
            return fw.numpy(generator(probe))

    distance_before, modes_before = mode_report(generated(), centres, std)
    d_losses, g_losses = [], []
    bar = tqdm(range(steps), desc=f"{fw.name} GAN", disable=not progress)
    for _ in bar:
        d_loss, g_loss = gan_step(
            generator=generator, discriminator=discriminator, gm_g=gm_g, gm_d=gm_d,
            opt_g=opt_g, opt_d=opt_d, scaler=scaler, bce=fw.bce_with_logits,
            precision=precision, **batches(fw, batch_size, noise_dim, centres, std, rng))
        d_losses.append(d_loss)
        g_losses.append(g_loss)
        bar.set_postfix(d=f"{d_loss:.3f}", g=f"{g_loss:.3f}", refresh=False)
    bar.close()
    distance_after, modes_after = mode_report(generated(), centres, std)
    return {
        "d_losses": d_losses,
        "g_losses": g_losses,
        "distance_before": distance_before,
        "distance_after": distance_after,
        "modes_before": modes_before,
        "modes_after": modes_after,
        "scaler": scaler.stats(),
        "generator": generator,
        "discriminator": discriminator,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the example and prints a summary; returns ``train()``'s result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--modes", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                   help="autocast dtype (default: the device's)")
    p.add_argument("--no-amp", action="store_true", help="train in fp32")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    r = train(amp_enabled=not args.no_amp, dtype=args.dtype, steps=args.steps,
              batch_size=args.batch_size, modes=args.modes, hidden=args.hidden,
              lr=args.lr, seed=args.seed, progress=not args.no_progress)
    s = r["scaler"]
    print(f"GAN on {amp.get_backend().name}, {args.steps} iterations,"
          f" {'fp32' if args.no_amp else 'AMP'}")
    print(f"  last 50 iterations: D loss {np.mean(r['d_losses'][-50:]):.3f},"
          f" G loss {np.mean(r['g_losses'][-50:]):.3f}")
    print(f"  distance to the nearest mode: {r['distance_before']:.3f} ->"
          f" {r['distance_after']:.3f}; modes covered: {r['modes_before']} ->"
          f" {r['modes_after']} of {args.modes}")
    print(f"  scaler: {s['steps']} updates for {args.steps} iterations,"
          f" {s['skipped_steps']} with an overflow, final scale {s['scale']:g}")
    if overflow.summary(s):
        print(f"  last overflow: {overflow.summary(s)}")
    return r


if __name__ == "__main__":
    main()
