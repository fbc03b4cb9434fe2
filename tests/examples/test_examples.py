"""Smoke tests of the examples on the backend this process runs (UNIFIED_AMP_BACKEND).

Each example runs in-process, through its ``main()``, at a tiny size: these check that
the examples train and use the API as they claim, not how well they train.
"""

import ast
import functools
import importlib
import inspect
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import unified_amp as amp
from examples import (apex_style, cifar, cifar_data, cifar_plot, cnn_classifier,
                      fp32_baseline, frameworks, gan, grad_accumulation, overflow, resnet)

ROOT = Path(__file__).resolve().parents[2]
SHARED = (cnn_classifier, gan, grad_accumulation, fp32_baseline, apex_style, overflow,
          cifar, cifar_data, cifar_plot, resnet)
# What autocast(dtype=None) means on CPU; float16 on CUDA, where the examples run if
# the framework sees a GPU.
CPU_DEFAULT_DTYPE = {"torch": "bfloat16", "megengine": "float16"}

# 3 epochs of 8 steps on the first 256 training digits; all 599 held out are scored.
TINY_CNN = ["--epochs", "3", "--batch-size", "32", "--train-size", "256", "--lr", "0.03",
            "--width", "8", "--no-progress"]


@pytest.fixture(scope="module")
def fw():
    return frameworks.get()


def count_calls(monkeypatch, owner, name):
    """Replaces ``owner.name`` with a wrapper that records each call's arguments."""
    calls = []
    original = getattr(owner, name)

    @functools.wraps(original)
    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def weights(fw, model):
    return [fw.numpy(p).copy() for p in model.parameters()]


@pytest.fixture
def reproducible_kernels(monkeypatch):
    """GPU kernels that give the same bits on every run, so that two runs of the same
    computation can be compared exactly there too. CPU kernels already do; on CUDA,
    convolution's weight gradient may sum partial results in whatever order its threads
    finish, and cuDNN may pick its algorithms by timing them (a benchmark in the same
    process turns that on): so only deterministic algorithms, picked by heuristics.
    torch's deterministic mode is warn-only: an op without a deterministic kernel (NLL
    loss on CUDA) warns instead of failing."""
    if amp.get_backend().name == "torch":
        import torch

        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # asked for by that mode
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
        before = (torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True, warn_only=True)
        yield
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    else:
        import megengine

        monkeypatch.setattr(megengine.config, "benchmark_kernel", False)
        monkeypatch.setattr(megengine.config, "deterministic_kernel", True)
        yield


def assert_learned(losses, factor):
    assert all(math.isfinite(x) for x in losses), losses
    assert np.mean(losses[-5:]) < factor * losses[0], losses


def test_training_steps_are_written_once_in_framework_free_modules():
    """Each step lives in its example module, which imports no framework; the other
    tests spy on these very functions to check that the training loops call them."""
    steps = {cnn_classifier: [cnn_classifier.train_step], gan: [gan.gan_step],
             grad_accumulation: [grad_accumulation.accumulation_step],
             apex_style: [apex_style.generator_step, apex_style.gan_step]}
    for module, fns in steps.items():
        assert all(step.__module__ == module.__name__ for step in fns)
    # Neither the framework kits, the fp32 baseline nor the CIFAR experiment (which
    # trains with the demo's and apex_style's steps) bring a step of their own.
    for module in (frameworks, fp32_baseline, cifar, resnet):
        assert not [n for n in vars(module) if "step" in n.lower()], module.__name__
    assert not [n for kit in (frameworks.TorchKit, frameworks.MegEngineKit)
                for n in vars(kit) if "step" in n.lower()]
    for module in SHARED:
        tree = ast.parse(inspect.getsource(module))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}
        assert not imported & {"torch", "megengine"}, module.__name__


def test_importing_the_examples_imports_no_framework():
    code = ("import sys, examples.cnn_classifier, examples.gan, examples.grad_accumulation,"
            " examples.fp32_baseline, examples.apex_style, examples.overflow, examples.cifar\n"
            "print(sorted(m for m in ('torch', 'megengine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tests_and_benchmarks_build_on_the_examples_kit(fw):
    """One construction kit: the contract tests' and the benchmarks' kits for this backend
    are the examples' kit plus their own pieces, and what they write once for both
    frameworks imports no framework."""
    for package in ("tests.kits", "benchmarks"):
        kit = importlib.import_module(f"{package}.{fw.name}_kit").Kit
        assert issubclass(kit, frameworks.KITS[fw.name]), package
    code = ("import sys, examples.frameworks, benchmarks.workloads, tests.kits.base\n"
            "print(sorted(m for m in ('torch', 'megengine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_digits_are_scikit_learns_split_stratified():
    train_x, train_y, test_x, test_y = cnn_classifier.load_digits()
    assert train_x.shape == (1198, 1, 8, 8) and test_x.shape == (599, 1, 8, 8)
    assert train_x.dtype == np.float32 and 0.0 <= train_x.min() and train_x.max() <= 1.0
    # Every digit is held out in proportion: a third of its images, give or take one.
    per_digit = np.bincount(np.concatenate([train_y, test_y]), minlength=10)
    assert np.abs(np.bincount(test_y, minlength=10) - per_digit / 3).max() <= 1
    again = cnn_classifier.load_digits()
    np.testing.assert_array_equal(again[3], test_y)  # the split is fixed by the seed


def test_cnn_demo_trains_fp32_and_amp_in_turn_and_plots(monkeypatch, capsys, tmp_path):
    calls = count_calls(monkeypatch, cnn_classifier, "train_step")
    plot = tmp_path / "curves.png"
    results = cnn_classifier.main(TINY_CNN + ["--demo", "--plot", str(plot)])
    backend = amp.get_backend()
    default_dtype = "float16" if backend.cuda_available() else CPU_DEFAULT_DTYPE[backend.name]

    # Both runs went through the one step function, 3 epochs of 256 // 32 steps each,
    # alternating by epoch: fp32 first in epoch 1, AMP first in epoch 2.
    assert len(calls) == 2 * 3 * 8
    scalers = [c[0][3] for c in calls]
    fp32, mixed = results["fp32"], results["AMP"]
    assert [s.is_enabled() for s in scalers[::8]] == [False, True, True, False, False, True]
    for r in (fp32, mixed):
        assert_learned(r["losses"], 0.6)
        assert len(r["accuracies"]) == 3 and len(r["epoch_seconds"]) == 3
        assert r["accuracy"] > 0.5
    # The same start and the same batches: the first losses agree to AMP's precision.
    assert abs(fp32["losses"][0] - mixed["losses"][0]) < 0.02 * fp32["losses"][0]
    assert fp32["compute_dtype"] == "float32"
    assert mixed["compute_dtype"] == default_dtype
    assert fp32["scaler"]["enabled"] is False
    assert mixed["scaler"]["enabled"] is True
    assert mixed["scaler"]["steps"] == 24
    assert mixed["scaler"]["skipped_steps"] < 24
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "skipped steps" in out
    assert "throughput vs fp32" in out
    ratio = cnn_classifier.throughput_ratio(results)
    assert f"AMP trained at {ratio['median']:.2f}x the throughput of fp32" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_ratio_is_per_epoch_and_skips_the_first():
    results = {"fp32": {"epoch_seconds": [9.0, 2.0, 2.0, 3.0]},
               "AMP": {"epoch_seconds": [1.0, 1.0, 4.0, 1.0]}}
    ratio = cnn_classifier.throughput_ratio(results)
    # fp32 time / AMP time for epochs 2..4: 2.0, 0.5, 3.0
    assert ratio["n"] == 3 and ratio["median"] == 2.0
    assert ratio["q1"] == 1.25 and ratio["q3"] == 2.5


@pytest.mark.parametrize("q1, q3, verdict", [
    (1.1, 1.3, "AMP was faster here."),
    (0.6, 0.9, "AMP was slower here."),
    (0.9, 1.1, "neither was clearly faster"),
])
def test_throughput_verdict_follows_from_the_quartiles(q1, q3, verdict):
    text = cnn_classifier.throughput_verdict(
        {"median": (q1 + q3) / 2, "q1": q1, "q3": q3, "n": 9})
    assert verdict in text
    assert f"quartiles {q1:.2f}-{q3:.2f}" in text
    assert sum(v in text for v in ("faster here", "slower here", "neither")) == 1


@pytest.mark.parametrize("kind, says", [
    ("overflow", "first non-finite forward output: 9 (Linear, "),
    ("nan", "the model's input holds inf/NaN in sample(s) 0: bad data, not precision"),
])
def test_cnn_planted_overflow_is_skipped_and_explained(capsys, kind, says):
    r = cnn_classifier.main(["--epochs", "2", "--batch-size", "16", "--train-size", "48",
                             "--width", "2", "--no-progress",
                             "--plant", kind, "--plant-step", "3"])
    out = capsys.readouterr().out
    planted = [line for line in out.splitlines()
               if line.startswith("unified_amp: step 4 skipped")]
    assert len(planted) == 1 and says in planted[0], out
    assert r["scaler"]["skipped_steps"] >= 1
    assert "Last skipped step, as the scaler explains it:" in out


def test_cnn_float16_on_request(fw):
    r = cnn_classifier.train(dtype="float16", epochs=1, batch_size=8, train_size=24,
                             width=2)
    assert r["compute_dtype"] == "float16"
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["scaler"]["steps"] == 3


def test_gan_one_scaler_one_update_per_iteration(monkeypatch, fw):
    before = {}
    real_step = gan.gan_step

    def snapshot_then_step(**kwargs):
        if not before:
            before["G"] = weights(fw, kwargs["generator"])
            before["D"] = weights(fw, kwargs["discriminator"])
        return real_step(**kwargs)

    monkeypatch.setattr(gan, "gan_step", snapshot_then_step)
    scaler_steps = count_calls(monkeypatch, amp.GradScaler, "step")
    updates = count_calls(monkeypatch, amp.GradScaler, "update")
    r = gan.main(["--steps", "20", "--batch-size", "32", "--hidden", "16",
                  "--no-progress"])

    assert r["scaler"]["enabled"] is True
    assert r["scaler"]["steps"] == 20  # one update per iteration, not one per loss
    assert len(updates) == 20 and len(scaler_steps) == 40  # both optimizers, each iteration
    assert r["scaler"]["skipped_steps"] < 20
    assert all(math.isfinite(x) for x in r["d_losses"] + r["g_losses"])
    for name, model in (("G", r["generator"]), ("D", r["discriminator"])):
        after = weights(fw, model)
        assert any(not np.array_equal(a, b) for a, b in zip(before[name], after)), name


def test_grad_accumulation_unscales_and_steps_once_per_step(monkeypatch):
    step_calls = count_calls(monkeypatch, grad_accumulation, "accumulation_step")
    backwards = count_calls(monkeypatch, amp.GradManager, "backward")
    unscales = count_calls(monkeypatch, amp.GradScaler, "unscale")
    scaler_steps = count_calls(monkeypatch, amp.GradScaler, "step")
    r = grad_accumulation.main(["--steps", "20", "--micro-batches", "3",
                                "--micro-batch-size", "8", "--hidden", "16",
                                "--lr", "0.2", "--no-progress"])

    assert len(step_calls) == 20
    assert len(backwards) == 60
    assert len(unscales) == 20 and len(scaler_steps) == 20
    assert r["scaler"]["steps"] == 20
    assert len(r["grad_norms"]) == 20 and all(n >= 0 for n in r["grad_norms"])
    assert_learned(r["losses"], 0.8)


def test_grad_accumulation_equals_one_big_batch_in_fp32(fw):
    """4 micro-batches of 8 give the step one batch of 32 gives (loss divided by N)."""
    common = dict(amp_enabled=False, steps=5, hidden=16, max_norm=0.25, test_size=10)
    split = grad_accumulation.train(micro_batches=4, micro_batch_size=8, **common)
    whole = grad_accumulation.train(micro_batches=1, micro_batch_size=32, **common)
    np.testing.assert_allclose(split["losses"], whole["losses"], rtol=1e-5)
    np.testing.assert_allclose(split["grad_norms"], whole["grad_norms"], rtol=1e-4)
    assert max(whole["grad_norms"]) > 0.25  # so clipping took part
    for a, b in zip(weights(fw, split["model"]), weights(fw, whole["model"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_fp32_baseline_is_the_cnn_step_with_amp_off_and_equals_a_plain_loop(
        monkeypatch, fw, reproducible_kernels):
    argv = ["--epochs", "2", "--batch-size", "16", "--train-size", "80", "--width", "4",
            "--no-progress"]
    r = fp32_baseline.main(argv)
    assert r["train_step"] is cnn_classifier.train_step
    assert r["scaler"]["enabled"] is False and r["scaler"]["steps"] == 0
    assert r["scaler"]["scale"] == 1.0
    assert r["compute_dtype"] == "float32"

    def plain_step(model, gm, optimizer, scaler, loss_fn, images, labels, precision):
        with gm:
            loss = loss_fn(model(images), labels)
            gm.backward(loss)
        optimizer.step()
        gm.zero_grad()
        return loss.item()

    monkeypatch.setattr(cnn_classifier, "train_step", plain_step)
    plain = fp32_baseline.main(argv)
    assert plain["train_step"] is plain_step
    # Bit for bit, on a GPU too (reproducible_kernels).
    np.testing.assert_array_equal(plain["losses"], r["losses"])
    for a, b in zip(weights(fw, plain["model"]), weights(fw, r["model"])):
        np.testing.assert_array_equal(a, b)


# The device's default low dtype and, where that is not float16, float16 too: the
# dtype a GPU defaults to, whose narrow range (Adam's eps at O3) bfloat16 never meets.
LOW_DTYPES = [None] + (["float16"] if CPU_DEFAULT_DTYPE[amp.get_backend().name] != "float16"
                       else [])


@pytest.mark.parametrize("low_dtype", LOW_DTYPES,
                         ids=lambda d: "device default" if d is None else d)
def test_apex_generator_pattern_at_every_level_and_o2_matches_o1(monkeypatch, low_dtype):
    """initialize(..., num_losses=1) + scale_loss(..., loss_id=0) at O0-O3; on this model
    O2 (low-precision weights, float32 masters, forward under autocast) reaches O1's
    loss."""
    scale_calls = count_calls(monkeypatch, amp, "scale_loss")
    final = {}
    for level in apex_style.LEVELS:
        r = apex_style.train_generator(opt_level=level, steps=40, batch_size=32,
                                       hidden=16, low_dtype=low_dtype)
        assert_learned(r["losses"], 0.3)
        assert r["properties"].opt_level == level
        final[level] = np.mean(r["losses"][-10:])
    assert len(scale_calls) == 4 * 40
    assert all(kwargs.get("loss_id") == 0 for _, kwargs in scale_calls)
    np.testing.assert_allclose(final["O2"], final["O1"], rtol=1e-2)
    np.testing.assert_allclose(final["O1"], final["O0"], rtol=5e-2)


def test_apex_gan_pattern_keeps_a_loss_scale_per_loss(monkeypatch, capsys):
    steps = count_calls(monkeypatch, apex_style, "gan_step")
    ids = count_calls(monkeypatch, amp, "scale_loss")
    results = apex_style.main(["--pattern", "gan", "--steps", "12", "--batch-size", "32",
                               "--no-progress"])
    r = results["O1"]
    assert len(steps) == 12
    assert [kwargs["loss_id"] for _, kwargs in ids] == [0, 1] * 12
    assert [s["steps"] for s in r["scalers"]] == [12, 12]  # one update per loss
    assert all(math.isfinite(x) for x in r["d_losses"] + r["g_losses"])
    assert "D (loss_id=0)" in capsys.readouterr().out
