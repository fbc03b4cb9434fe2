"""examples/cifar.py (ResNet on CIFAR-10, fp32 vs AMP) on the backend this process runs,
at a tiny size: a synthetic folder of a few dozen images, ResNet-18 at width 4, a few
batches. These check that the experiment trains both runs through the example steps on
the same batches and writes what it says, and that its data errors are clear; not how
well it trains."""

import json
import math
import pickle
import struct

import numpy as np
import pytest

import unified_amp as amp
from examples import apex_style, cifar, cifar_data, cnn_classifier, frameworks, resnet

from .test_examples import CPU_DEFAULT_DTYPE, count_calls

# 3 steps of 8 per epoch, 2 epochs; 10 held-out images.
TINY = ["--model", "resnet18", "--width", "4", "--batch-size", "8", "--epochs", "2",
        "--train-size", "24", "--test-size", "10", "--eval-batch-size", "10",
        "--no-progress"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fw():
    return frameworks.get()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return cifar_data.write_synthetic(tmp_path_factory.mktemp("cifar") / "synthetic", 40, 10)


@pytest.fixture(scope="module")
def demo(folder, tmp_path_factory):
    """One tiny run of the experiment through its command line, with every call of the
    demo's step recorded (a module fixture: the run is the slow part)."""
    calls = []
    original = cnn_classifier.train_step

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    out = tmp_path_factory.mktemp("out")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cnn_classifier, "train_step", spy)
        result = cifar.main(TINY + ["--data", str(folder), "--out", str(out)])
    return result, calls, out


def default_dtype():
    backend = amp.get_backend()
    return "float16" if backend.cuda_available() else CPU_DEFAULT_DTYPE[backend.name]


def test_fp32_and_amp_train_in_turn_through_the_demos_step(demo):
    result, calls, _ = demo
    # 2 runs x 2 epochs x 3 steps, alternating by epoch: fp32 first in epoch 1, AMP in 2.
    assert len(calls) == 12
    assert [c[3].is_enabled() for c in calls[::3]] == [False, True, True, False]
    fp32, mixed = result["runs"]["fp32"], result["runs"]["AMP"]
    for run in (fp32, mixed):
        assert len(run["losses"]) == len(run["times"]) == 6
        assert all(math.isfinite(x) for x in run["losses"])
        assert np.all(np.diff(run["times"]) > 0)  # each run's own clock only moves on
        assert run["epoch_end_steps"] == [3, 6] and len(run["accuracies"]) == 2
        assert run["data"] == {"train": 24, "test": 10, "steps_per_epoch": 3}
    # The same initial weights and the same first batch: the first losses agree to
    # the low precision's accuracy.
    assert abs(fp32["losses"][0] - mixed["losses"][0]) < 0.05 * fp32["losses"][0]
    assert fp32["precision"] == "float32" and mixed["precision"] == default_dtype()
    assert fp32["scaler"]["enabled"] is False and mixed["scaler"]["steps"] == 6
    assert result["parameters"] == resnet.parameter_count(resnet.resnet(
        frameworks.get(), "resnet18", 10, 4))
    assert result["epochs_run"] == 2 and result["stopped_early"] is None
    ratio = result["throughput_ratio"]
    assert ratio["n"] == 1 and ratio["median"] > 0


def test_it_prints_accuracy_per_epoch_and_writes_json_and_png(demo, capsys):
    result, _, out = demo
    stem = out / f"{amp.get_backend().name}-resnet18"
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["runs"]["AMP"]["losses"] == result["runs"]["AMP"]["losses"]
    assert saved["data"]["synthetic"] == {"train": 40, "test": 10, "seed": 0}
    assert stem.with_suffix(".png").read_bytes()[:8] == PNG
    # GPU memory where there is a GPU; on CPU neither framework reports any.
    on_gpu = amp.get_backend().cuda_available()
    for run in saved["runs"].values():
        assert (run["peak_memory_bytes"] is not None) == on_gpu
        assert (run["step_memory_bytes"] is not None) == on_gpu


def test_the_printed_summary(folder, tmp_path, capsys):
    cifar.main(TINY + ["--epochs", "1", "--train-size", "8", "--data", str(folder),
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for text in ("epoch   1: held-out accuracy fp32", "samples/s", "throughput vs fp32",
                 "skipped steps", "Held-out accuracy: fp32", "AMP trained at",
                 "Results:"):
        assert text in out, text


def test_plot_draws_saved_results_as_rows_of_one_png(demo, tmp_path, capsys):
    _, _, out = demo
    (saved,) = out.glob("*.json")
    png = tmp_path / "both.png"
    results = cifar.main(["--plot", str(saved), str(saved), "--png", str(png)])
    assert len(results) == 2
    assert png.read_bytes()[:8] == PNG
    one = tmp_path / "one.png"
    cifar.main(["--plot", str(saved), "--png", str(one)])
    assert png.stat().st_size > one.stat().st_size  # two rows of panels, not one
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": {"fp32": {}}}))
    with pytest.raises(SystemExit) as stop:
        cifar.main(["--plot", str(bad), "--png", str(one)])
    assert stop.value.code == 2
    assert "is not a result of examples.cifar" in capsys.readouterr().err


def test_opt_level_trains_through_apex_api_with_o0_as_fp32(folder, tmp_path, monkeypatch):
    steps = count_calls(monkeypatch, apex_style, "generator_step")
    initialized = count_calls(monkeypatch, amp, "initialize")
    result = cifar.main(TINY + ["--epochs", "1", "--train-size", "16", "--opt-level", "O2",
                                "--data", str(folder), "--out", str(tmp_path)])
    assert len(steps) == 4
    assert [kwargs["opt_level"] for _, kwargs in initialized] == ["O0", "O2"]
    runs = result["runs"]
    assert runs["fp32"]["precision"] == "O0, float32"
    assert runs["AMP"]["precision"] == f"O2, {default_dtype()}"
    assert runs["AMP"]["scaler"]["enabled"] and runs["AMP"]["scaler"]["steps"] == 2
    assert not runs["fp32"]["scaler"]["enabled"]
    assert all(math.isfinite(x) for r in runs.values() for x in r["losses"])
    assert (tmp_path / f"{amp.get_backend().name}-resnet18-O2.json").is_file()


def test_channels_last_where_the_backend_has_it(fw, folder, tmp_path, capsys):
    # Width 8: at width 4 oneDNN's AVX2 backward hangs (the test below), and this test
    # must finish on any x86-64 CPU.
    argv = TINY + ["--width", "8", "--epochs", "1", "--train-size", "8", "--channels-last",
                   "--data", str(folder), "--out", str(tmp_path)]
    if fw.name == "megengine":  # no memory formats: refused before anything trains
        with pytest.raises(SystemExit) as stop:
            cifar.main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "--channels-last" in err and "megengine has none" in err
        assert not list(tmp_path.iterdir())
        with pytest.raises(ValueError, match="Drop --channels-last"):
            cifar.train_runs(cifar_data.load(folder),
                             cifar.Options(batch_size=8, channels_last=True))
        return
    import torch

    made = []
    original = resnet.resnet

    def keep(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(resnet, "resnet", keep)
        result = cifar.main(argv)
    assert all(math.isfinite(x) for x in result["runs"]["AMP"]["losses"])
    for model in made[-2:]:  # the two runs' (the first one made is the CPU check's)
        conv = model.stem[0].weight
        assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()


def test_channels_last_is_refused_where_onednn_would_hang(fw, folder, tmp_path, capsys,
                                                          monkeypatch):
    """On a CPU whose oneDNN has no AVX-512 kernels, a strided 1x1 convolution with
    fewer than 8 input channels hangs in its channels-last backward: the example says
    so before anything trains, on every CPU (the CPU's answer is planted)."""
    if fw.name == "megengine":  # refused for having no memory formats (the test above)
        return
    monkeypatch.setattr(frameworks, "_onednn_avx2_at_most", lambda torch: True)
    argv = TINY + ["--epochs", "1", "--train-size", "8", "--channels-last",
                   "--data", str(folder), "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        cifar.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--channels-last would hang or crash this CPU" in err
    assert "(stages.2.shortcut.0: 4 in)" in err
    assert "Use --width 8 or more" in err
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="would hang"):
        cifar.train_runs(cifar_data.load(folder),
                         cifar.Options(model="resnet18", width=4, batch_size=8,
                                       channels_last=True))
    # Width 8 has no such convolution; ResNet-50's first strided shortcut has 4 x width.
    assert cifar.channels_last_refusal(fw, "resnet18", 8) is None
    assert cifar.channels_last_refusal(fw, "resnet50", 2) is None
    assert "(stages.3.shortcut.0: 4 in)" in cifar.channels_last_refusal(fw, "resnet50", 1)
    # With AVX-512 kernels there is nothing to refuse.
    monkeypatch.setattr(frameworks, "_onednn_avx2_at_most", lambda torch: False)
    assert cifar.channels_last_refusal(fw, "resnet18", 4) is None


@pytest.mark.parametrize("cap, capability, affected", [
    ("", "AVX2", True), ("", "AVX512", False), ("AVX2", "AVX512", True),
    ("avx512_core", "AVX2", False), ("ALL", "AVX2", True), ("SSE41", "AVX512", True)])
def test_which_cpus_take_onednns_avx2_kernels(fw, monkeypatch, cap, capability, affected):
    if fw.name == "megengine":
        return
    import torch

    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert frameworks._onednn_avx2_at_most(torch) is affected


def test_a_time_budget_stops_between_epochs(folder, tmp_path):
    result = cifar.main(TINY + ["--epochs", "5", "--train-size", "8", "--time-budget",
                                "0.001", "--data", str(folder), "--out", str(tmp_path)])
    assert result["epochs_run"] == 1 and result["epochs"] == 5
    assert "after 1 of 5 epochs" in result["stopped_early"]
    assert len(result["runs"]["AMP"]["accuracies"]) == 1


@pytest.mark.parametrize("name, count", [("resnet18", 11_173_962), ("resnet50", 23_520_842)])
def test_resnets_have_the_usual_cifar_parameter_counts(fw, name, count):
    """The counts every CIFAR ResNet-18/50 (3x3 stem, 10 classes) has: the same layers
    on either framework."""
    assert resnet.parameter_count(resnet.resnet(fw, name)) == count


def test_bad_model_arguments_are_named():
    with pytest.raises(ValueError, match="unknown model 'resnet34'"):
        resnet.resnet(None, "resnet34")
    with pytest.raises(ValueError, match="width must be a positive int"):
        resnet.resnet(None, "resnet18", width=0)


def test_batch_larger_than_the_training_set_is_refused(folder, capsys):
    with pytest.raises(SystemExit) as stop:
        cifar.main(TINY + ["--batch-size", "64", "--data", str(folder)])
    assert stop.value.code == 2
    assert "batch size 64 must be between 1 and the 24 training images" in \
        capsys.readouterr().err


def test_epoch_batches_are_crops_and_mirrors_of_the_shuffled_images():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 3, 32, 32), dtype=np.uint8)
    labels = np.arange(20)
    plain = cifar.epoch_batches(images, labels, 6, 0, 0, augment=False)
    assert len(plain) == 3 and all(len(x) == 6 for x, _ in plain)  # full batches only
    seen = np.concatenate([y for _, y in plain])
    assert len(set(seen)) == 18
    for x, y in plain:
        np.testing.assert_array_equal(x, images[y])
    again = cifar.epoch_batches(images, labels, 6, 0, 0, augment=True)
    same = cifar.epoch_batches(images, labels, 6, 0, 0, augment=True)
    for (a, ya), (b, yb) in zip(again, same):  # what each run of an epoch gets
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(cifar.epoch_batches(images, labels, 6, 0, 1, True)[0][1],
                              again[0][1])
    pad = cifar.PAD
    for x, y in again:
        for image, label in zip(x, y):
            padded = np.pad(images[label], ((0, 0), (pad, pad), (pad, pad)))
            crops = [c for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)
                     for c in (padded[:, dy:dy + 32, dx:dx + 32],
                               padded[:, dy:dy + 32, dx:dx + 32][..., ::-1])]
            assert any(np.array_equal(image, c) for c in crops)


# -- the data folder -------------------------------------------------------------------

def test_synthetic_folder_has_the_data_sets_layout(folder):
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([*cifar_data.TRAIN_FILES, cifar_data.TEST_FILE,
                            cifar_data.META_FILE])
    with open(folder / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (8, 3072)
    assert isinstance(batch[b"labels"], list) and len(batch[b"labels"]) == 8
    data = cifar_data.load(folder)
    assert data["train_x"].shape == (40, 3, 32, 32) and data["test_x"].shape == (10, 3, 32, 32)
    assert data["classes"][0] == "airplane" and data["classes"][-1] == "truck"
    # A folder written with the same arguments is reused; other arguments are refused.
    assert cifar_data.write_synthetic(folder, 40, 10) == folder
    with pytest.raises(FileExistsError, match="left as it is"):
        cifar_data.write_synthetic(folder, 50, 10)


def test_synthetic_images_are_learnable_not_noise():
    """Most images lie nearer their own class's mean image than any other's (there is
    something to learn), and no two images are alike (shifts, mirroring, noise)."""
    x, y = cifar_data.synthetic_images(1000, 0, np.random.default_rng(1))
    flat = x.reshape(len(x), -1).astype(np.float64)
    means = np.stack([flat[y == c].mean(0) for c in range(10)])
    distances = (means ** 2).sum(1)[None] - 2 * flat @ means.T  # + |x|^2, the same per row
    accuracy = (distances.argmin(1) == y).mean()
    assert accuracy > 0.5, accuracy
    assert np.bincount(y, minlength=10).min() == 100
    assert len(np.unique(flat, axis=0)) == len(flat)
    same_class = flat[y == 0]
    assert np.abs(same_class - same_class.mean(0)).mean() > 30  # pixel values, of 255


def _py2_pickle(obj):
    """``obj`` pickled as the data set's files were, by Python 2 with numpy 1: strings
    as byte strings (protocol 2's STRING opcodes), numpy under ``numpy.core``."""
    class Py2Pickler(pickle._Pickler):
        dispatch = dict(pickle._Pickler.dispatch)

        def save_py2_str(self, s):
            raw = s.encode("latin-1") if isinstance(s, str) else s
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw if len(raw) < 256
                       else pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
            self.memoize(s)

        dispatch[bytes] = save_py2_str
        dispatch[str] = save_py2_str

    import io

    buffer = io.BytesIO()
    Py2Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def test_reads_batches_pickled_as_the_real_data_set_is(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    raw = _py2_pickle({"batch_label": "training batch 1 of 5", "labels": [3, 0, 9],
                       "data": x, "filenames": ["a.png", "b.png", "c.png"]})
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in raw and b"X\x00" not in raw[:40]
    (tmp_path / "data_batch_1").write_bytes(raw)
    images, labels = cifar_data.read_batch(tmp_path / "data_batch_1")
    np.testing.assert_array_equal(images.reshape(3, -1), x)
    np.testing.assert_array_equal(labels, [3, 0, 9])


def test_missing_folder_says_where_the_data_comes_from_and_goes(tmp_path, capsys):
    where = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as raised:
        cifar_data.load(where)
    for text in (str(where), "does not exist", "https://www.cs.toronto.edu/~kriz/cifar.html",
                 "cifar-10-python.tar.gz", "cifar-10-batches-py", "--data", "--synthetic N"):
        assert text in str(raised.value), text
    with pytest.raises(SystemExit) as stop:  # the command line: the message, no traceback
        cifar.main(TINY + ["--data", str(where)])
    assert stop.value.code == 2
    assert "CIFAR-10 not found" in capsys.readouterr().err
    # A folder that holds something else names what it lacks.
    with pytest.raises(FileNotFoundError, match="holds no data_batch_1"):
        cifar_data.load(tmp_path)


def _copy(folder, to):
    to.mkdir()
    for p in folder.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


@pytest.mark.parametrize("damage, says", [
    (lambda b: b[:len(b) // 2], "is not a readable CIFAR-10 batch file"),
    (lambda b: b"\x00" * 64, "is not a readable CIFAR-10 batch file"),
    (lambda b: pickle.dumps({b"data": [1, 2], b"labels": [0, 1]}), "b'data' must be uint8"),
    (lambda b: pickle.dumps({b"labels": []}), "expected a dict with b'data' and b'labels'"),
    (lambda b: pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}),
     "b'labels' must list 2 class indices in 0..9"),
], ids=["truncated", "zeros", "data-not-an-array", "no-data", "label-out-of-range"])
def test_a_damaged_batch_file_is_named(folder, tmp_path, capsys, damage, says):
    copy = _copy(folder, tmp_path / "copy")
    bad = copy / "data_batch_3"
    bad.write_bytes(damage(bad.read_bytes()))
    with pytest.raises(cifar_data.CifarDataError) as raised:
        cifar_data.load(copy)
    assert isinstance(raised.value, ValueError)
    assert str(bad) in str(raised.value) and says in str(raised.value)
    assert "Unpack the archive again" in str(raised.value)
    with pytest.raises(SystemExit) as stop:
        cifar.main(TINY + ["--data", str(copy)])
    assert stop.value.code == 2 and str(bad) in capsys.readouterr().err


def test_a_missing_batch_file_is_named(folder, tmp_path):
    copy = _copy(folder, tmp_path / "copy")
    (copy / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch.* is missing from the folder"):
        cifar_data.load(copy)


def test_a_batch_file_cannot_run_code_when_read(folder, tmp_path):
    """pickle runs whatever a file names; the reader accepts only what a batch holds."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    copy = _copy(folder, tmp_path / "copy")
    (copy / "data_batch_2").write_bytes(pickle.dumps({b"data": Payload(), b"labels": []}))
    with pytest.raises(cifar_data.CifarDataError, match="refers to .*open"):
        cifar_data.load(copy)
    assert not marker.exists()


def test_native_amp_trains_in_turn_and_matches_unified_amp_byte_for_byte(fw, folder, tmp_path,
                                                                          monkeypatch):
    """--native: a third copy trains in the same turns with the framework's own AMP
    (torch.autocast + torch.amp.GradScaler, or megengine.amp's). With the native
    autocast's dtypes (--no-contract), unified_amp's run and the native one end with the
    same weights, byte for byte, compared here on the models themselves."""
    made, order = {}, []
    make = cifar._make_run

    def spy(fw_, mode, opts):
        run = made[mode] = make(fw_, mode, opts)
        step = run.step

        def recorded(*args):
            order.append(mode)
            return step(*args)

        run.step = recorded
        return run

    monkeypatch.setattr(cifar, "_make_run", spy)
    result = cifar.main(TINY + ["--width", "8", "--train-size", "16", "--native",
                                "--no-contract", "--data", str(folder), "--out", str(tmp_path)])
    # 2 steps an epoch; the turn moves on by one run each epoch.
    assert order == ["fp32"] * 2 + ["AMP"] * 2 + ["native"] * 2 + \
        ["AMP"] * 2 + ["native"] * 2 + ["fp32"] * 2
    runs = result["runs"]
    native_name = {"torch": "torch.amp", "megengine": "megengine.amp"}[fw.name]
    assert runs["native"]["precision"] == f"{native_name}, {default_dtype()}"
    assert runs["native"]["compute_dtype"] == runs["AMP"]["compute_dtype"] == default_dtype()
    assert runs["native"]["scaler"] == {"enabled": True, "scale": 2.0**16, "steps": 4,
                                        "skipped_steps": 0}
    assert runs["native"]["losses"] == runs["AMP"]["losses"] != runs["fp32"]["losses"]
    params = {mode: [fw.numpy(p) for p in run.model.parameters()] for mode, run in made.items()}
    assert [a.tobytes() for a in params["AMP"]] == [b.tobytes() for b in params["native"]]
    assert [a.tobytes() for a in params["AMP"]] != [b.tobytes() for b in params["fp32"]]
    assert result["weights_identical_to_native"] is True
    assert set(result["throughput_ratios"]) == {"AMP", "native"}
    assert result["throughput_vs_native"]["n"] == 1
