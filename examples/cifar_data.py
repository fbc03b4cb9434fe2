"""CIFAR-10 from a local folder, read with numpy and pickle; and a synthetic stand-in.

The data set is the "CIFAR-10 python version" of https://www.cs.toronto.edu/~kriz/cifar.html
(``cifar-10-python.tar.gz``, 163 MB), unpacked: a folder ``cifar-10-batches-py`` holding
``data_batch_1`` .. ``data_batch_5`` (10000 training images each), ``test_batch`` (10000
held out) and ``batches.meta`` (the class names). Each batch file is a pickled dict whose
``b"data"`` is a uint8 array of shape (n, 3072) (a 32x32 image's red, green and blue
planes, row by row) and whose ``b"labels"`` lists n class indices 0-9. Nothing here
downloads: the data must already be on disk.

:func:`write_synthetic` writes a folder in the same layout with images a network can
learn (a pattern per class, a weaker pattern of another class on top, shifts and noise),
for tests and CPU trials.

Errors: a missing folder or batch file is a ``FileNotFoundError`` that says where the
data comes from and where to put it; a batch file that is not a CIFAR-10 batch is a
:class:`CifarDataError` (a ``ValueError``) that names the file.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

SOURCE = "https://www.cs.toronto.edu/~kriz/cifar.html"
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")
SHAPE = (3, 32, 32)
PIXELS = 3 * 32 * 32


class CifarDataError(ValueError):
    """A file in the CIFAR-10 folder is not what the data set's layout holds."""


def _fix() -> str:
    return (f"download cifar-10-python.tar.gz (the CIFAR-10 python version) from {SOURCE},"
            f" unpack it with `tar xzf cifar-10-python.tar.gz`, and pass the folder it makes"
            f" ({FOLDER}) with --data; or make a synthetic folder in the same layout with"
            f" --synthetic N")


def find_folder(path: str | Path) -> Path:
    """The folder that holds the batch files: ``path`` itself, or ``path/cifar-10-batches-py``.

    Raises:
        FileNotFoundError: neither holds ``data_batch_1``; the message says where the
            data comes from and where to put it.
    """
    path = Path(path)
    for candidate in (path, path / FOLDER):
        if (candidate / TRAIN_FILES[0]).is_file():
            return candidate
    what = "does not exist" if not path.exists() else f"holds no {TRAIN_FILES[0]}"
    raise FileNotFoundError(
        f"CIFAR-10 not found: {str(path)!r} {what}. This example reads the data set from a"
        f" local folder and downloads nothing: {_fix()}.")


class _BatchUnpickler(pickle.Unpickler):
    """Loads what a CIFAR-10 batch holds (dicts, lists, bytes, numbers, numpy arrays)
    and refuses any other global, so a file cannot run code when it is read. numpy
    arrays are found under numpy 1's and numpy 2's module names alike (files written
    with either load with either)."""

    _ALLOWED = {("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                ("numeric", "_frombuffer"), ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str) -> Any:
        last = module.rsplit(".", 1)[-1]
        if module.split(".")[0] == "numpy" and (last, name) in self._ALLOWED:
            if last == "numpy":
                return getattr(np, name)
            core = "numpy._core" if hasattr(np, "_core") else "numpy.core"
            return getattr(importlib.import_module(f"{core}.{last}"), name)
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, which a CIFAR-10 batch never holds")


def _load_pickle(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(
            f"CIFAR-10 batch file {str(path)!r} is missing from the folder {str(path.parent)!r}"
            f" (the data set has {', '.join(TRAIN_FILES)}, {TEST_FILE} and {META_FILE}): {_fix()}.")
    try:
        with open(path, "rb") as f:
            # The data set was pickled by Python 2: its strings load as bytes.
            return _BatchUnpickler(io.BufferedReader(f), encoding="bytes").load()
    except Exception as e:  # truncated, damaged, or not a pickle at all
        raise CifarDataError(
            f"{str(path)!r} is not a readable CIFAR-10 batch file ({type(e).__name__}: {e});"
            f" it may be truncated or damaged. Unpack the archive again: {_fix()}.") from e


def read_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file's images as uint8 (n, 3, 32, 32) and labels as int64 (n,).

    Raises:
        FileNotFoundError: the file is missing.
        CifarDataError: it is not a CIFAR-10 batch (not a pickle, a dict without
            ``b"data"``/``b"labels"``, wrong shapes or labels out of range).
    """
    path = Path(path)
    batch = _load_pickle(path)

    def bad(what: str) -> CifarDataError:
        return CifarDataError(f"{str(path)!r} is not a CIFAR-10 batch file: {what}."
                              f" Unpack the archive again: {_fix()}.")

    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise bad(f"expected a dict with b'data' and b'labels', got {keys}")
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != PIXELS:
        shape = getattr(data, "shape", None)
        raise bad(f"b'data' must be uint8 of shape (n, {PIXELS}); got"
                  f" {getattr(data, 'dtype', type(data).__name__)} of shape {shape}")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer) \
            or (len(labels) and not 0 <= labels.min() <= labels.max() < len(CLASSES)):
        raise bad(f"b'labels' must list {len(data)} class indices in 0..{len(CLASSES) - 1}")
    return data.reshape(-1, *SHAPE), labels.astype(np.int64)


def read_meta(folder: Path) -> dict[str, Any]:
    """``batches.meta``: the class names, and what made a synthetic folder (or None)."""
    meta = _load_pickle(folder / META_FILE)
    if not isinstance(meta, dict) or b"label_names" not in meta:
        raise CifarDataError(f"{str(folder / META_FILE)!r} is not CIFAR-10's batches.meta:"
                             f" it has no b'label_names'. Unpack the archive again: {_fix()}.")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[b"label_names"]]
    synthetic = meta.get(b"synthetic")
    return {"classes": names,
            "synthetic": None if synthetic is None else
            {k.decode(): v for k, v in synthetic.items()}}


def load(path: str | Path, train_size: int | None = None, test_size: int | None = None
         ) -> dict[str, Any]:
    """The data set in ``path`` (the folder, or the folder above it).

    Args:
        train_size, test_size: keep only the first that many images (None: all).

    Returns:
        A dict: ``train_x``/``test_x`` uint8 (n, 3, 32, 32), ``train_y``/``test_y``
        int64, ``classes`` (names), ``folder`` (str) and ``synthetic`` (the
        parameters that made a synthetic folder, or None for the real data).
    """
    folder = find_folder(path)
    meta = read_meta(folder)
    train = [read_batch(folder / name) for name in TRAIN_FILES]
    train_x = np.concatenate([x for x, _ in train])[:train_size]
    train_y = np.concatenate([y for _, y in train])[:train_size]
    test_x, test_y = read_batch(folder / TEST_FILE)
    return {"train_x": train_x, "train_y": train_y, "test_x": test_x[:test_size],
            "test_y": test_y[:test_size], "classes": meta["classes"],
            "folder": str(folder), "synthetic": meta["synthetic"]}


# -- the synthetic stand-in ------------------------------------------------------------
def synthetic_images(n: int, seed: int, rng: np.random.Generator
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` learnable 32x32 images and their labels (balanced over the 10 classes).

    Each class has a fixed pattern (coarse 8x8-pixel blocks of colour, made from
    ``seed``); an image is its class's pattern plus a weaker one of another class (at
    20-70% of the strength), shifted by up to 4 pixels, maybe mirrored, in noise.
    Telling the stronger pattern apart takes a few hundred steps of a ResNet, and
    a few images stay ambiguous, so held-out accuracy climbs rather than jumps.
    """
    patterns = np.random.default_rng(seed).normal(size=(len(CLASSES), 3, 4, 4))
    patterns = np.kron(patterns, np.ones((1, 1, 8, 8))).astype(np.float32)  # 4x4 -> 32x32
    labels = np.arange(n) % len(CLASSES)
    rng.shuffle(labels)
    images = np.empty((n, *SHAPE), np.uint8)
    for start in range(0, n, 4096):  # in chunks: a CIFAR-sized set in floats is 1.5 GB
        y = labels[start:start + 4096]
        other = (y + rng.integers(1, len(CLASSES), len(y))) % len(CLASSES)
        weight = rng.uniform(0.2, 0.7, len(y)).astype(np.float32)[:, None, None, None]
        chunk = patterns[y] + weight * patterns[other]
        for i, (dy, dx) in enumerate(rng.integers(-4, 5, (len(y), 2))):
            chunk[i] = np.roll(chunk[i], (dy, dx), axis=(1, 2))
        flip = rng.random(len(y)) < 0.5
        chunk[flip] = chunk[flip][..., ::-1]
        chunk = 128 + 32 * chunk + rng.normal(0, 48, chunk.shape).astype(np.float32)
        images[start:start + len(y)] = np.clip(chunk, 0, 255)
    return images, labels


def _dump(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        # Protocol 4: protocol 2 (the data set's, from Python 2) stores Python 3 bytes
        # through a call of _codecs.encode, which the reader refuses as it refuses any call.
        pickle.dump(obj, f, protocol=4)


def write_synthetic(path: str | Path, n_train: int, n_test: int | None = None,
                    seed: int = 0) -> Path:
    """Writes a synthetic CIFAR-10 folder at ``path`` (made if missing) and returns it.

    ``n_train`` images go into the five data batches (as evenly as they divide),
    ``n_test`` (default: ``n_train // 5``, at least 10) into the test batch; the file
    names, keys, dtypes and shapes are the data set's. A folder this function already
    wrote with the same arguments is reused as it is.

    Raises:
        ValueError: ``n_train`` below 5 or ``n_test`` below 1.
        FileExistsError: ``path`` holds files of something else (the real data set,
            say), which this will not overwrite.
    """
    n_test = max(10, n_train // 5) if n_test is None else n_test
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < len(TRAIN_FILES):
        raise ValueError(f"--synthetic needs at least {len(TRAIN_FILES)} training images"
                         f" (one per data batch); got {n_train!r}.")
    if n_test < 1:
        raise ValueError(f"a synthetic folder needs at least 1 test image; got {n_test!r}.")
    folder = Path(path)
    made = {b"train": n_train, b"test": n_test, b"seed": seed}
    if folder.exists() and any(folder.iterdir()):
        try:
            same = read_meta(folder)["synthetic"] == {k.decode(): v for k, v in made.items()}
        except (OSError, ValueError):
            same = False
        if same:
            return folder
        raise FileExistsError(
            f"{str(folder)!r} already holds files that are not a synthetic CIFAR-10 folder"
            f" of {n_train} training and {n_test} test images from seed {seed}; it is left"
            f" as it is. Pass another --data folder for the synthetic data, or remove it.")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    x, y = synthetic_images(n_train + n_test, seed, rng)
    for i, part in enumerate(np.array_split(np.arange(n_train), len(TRAIN_FILES))):
        _dump(folder / TRAIN_FILES[i], {
            b"batch_label": f"synthetic training batch {i + 1} of 5".encode(),
            b"labels": [int(v) for v in y[part]], b"data": x[part].reshape(len(part), -1),
            b"filenames": [f"synthetic_{j:06d}.png".encode() for j in part]})
    _dump(folder / TEST_FILE, {
        b"batch_label": b"synthetic testing batch 1 of 1",
        b"labels": [int(v) for v in y[n_train:]], b"data": x[n_train:].reshape(n_test, -1),
        b"filenames": [f"synthetic_{j:06d}.png".encode() for j in range(n_train, len(x))]})
    # The meta file last: a folder is complete (and reusable) once it is there.
    _dump(folder / META_FILE, {b"label_names": [c.encode() for c in CLASSES],
                               b"num_cases_per_batch": -(-n_train // len(TRAIN_FILES)),
                               b"num_vis": PIXELS, b"synthetic": made})
    return folder
