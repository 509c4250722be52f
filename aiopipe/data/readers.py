"""Readers for the standard on-disk formats of MNIST, CIFAR-10 and CIFAR-100.

Nothing is unpickled: MNIST is read from its idx files (plain or ``.gz``), CIFAR from its
*binary* versions (fixed-size records). Plain files are memory-mapped, so opening a
dataset reads only its labels; ``.gz`` files are decompressed into memory once.

Splits (pipar.txt Table 4 uses 2,000 validation samples): ``"test"`` is the official
test file(s); ``"val"`` is the *last* ``min(2000, n // 10)`` samples of the official
training file(s) (n = their sample count); ``"train"`` is the rest of the training files.
Full MNIST is therefore 58,000 / 2,000 / 10,000 and CIFAR 48,000 / 2,000 / 10,000.
``size`` then keeps the first ``size`` samples of the split.

Every problem with the files is a `ConfigError` that names the file and what is wrong.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from aiopipe.data.dataset import check_indices
from aiopipe.errors import ConfigError

__all__ = ["VAL_SIZE", "FileDataset", "open_cifar10", "open_cifar100", "open_mnist"]

VAL_SIZE: Final = 2_000
"""Validation samples carved from the end of a real training set (at most 10% of it)."""

_MNIST_FILES: Final = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_IDX_UBYTE: Final = 0x08
_CIFAR_PIXELS: Final = 3 * 32 * 32


@dataclass(frozen=True, slots=True)
class _Normalization:
    """Per-channel mean and standard deviation of pixel values scaled to [0, 1]."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


# The usual published statistics of each training set.
_MNIST_NORM: Final = _Normalization((0.1307,), (0.3081,))
_CIFAR10_NORM: Final = _Normalization((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
_CIFAR100_NORM: Final = _Normalization((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


class FileDataset:
    """A window of uint8 images read from files, normalized per channel on `batch`.

    The images live in one or more segments (one per file, memory-mapped where possible)
    that are logically concatenated; the dataset is samples ``[start, stop)`` of that.
    """

    __slots__ = ("_labels", "_mean", "_name", "_num_classes", "_offsets", "_segments", "_std")

    def __init__(
        self,
        name: str,
        *,
        segments: Sequence[npt.NDArray[np.uint8]],
        labels: npt.NDArray[np.int64],
        num_classes: int,
        norm: _Normalization,
        start: int,
        stop: int,
    ) -> None:
        """Wrap ``segments`` (each ``[n_i, C, H, W]`` uint8) and their concatenated labels.

        Raises:
            ConfigError: the window ``[start, stop)`` is empty.
        """
        if stop <= start:
            raise ConfigError(f"{name}: this split has no samples")
        self._name = name
        self._segments = tuple(segments)
        offsets = np.cumsum([0, *(len(s) for s in segments)])
        self._offsets = offsets.astype(np.int64) - start
        self._labels = labels[start:stop].copy()
        self._num_classes = num_classes
        channels = len(norm.mean)
        self._mean = torch.tensor(norm.mean, dtype=torch.float32).view(1, channels, 1, 1)
        self._std = torch.tensor(norm.std, dtype=torch.float32).view(1, channels, 1, 1)

    @property
    def name(self) -> str:
        """The name this dataset was opened by, e.g. ``"cifar10:/data/cifar"``."""
        return self._name

    @property
    def num_classes(self) -> int:
        """How many classes the labels range over."""
        return self._num_classes

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """The shape of one sample: (channels, height, width)."""
        _, channels, height, width = self._segments[0].shape
        return (channels, height, width)

    def __len__(self) -> int:
        """The number of samples."""
        return len(self._labels)

    def __repr__(self) -> str:
        return f"FileDataset({self._name!r}, samples={len(self)})"

    def labels(self) -> npt.NDArray[np.int64]:
        """All labels in index order (a copy)."""
        return self._labels.copy()

    def batch(
        self, indices: Sequence[int] | npt.NDArray[np.integer]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and normalize the samples at ``indices`` as ``(x, y)``.

        Raises:
            ConfigError: an index is out of range or not an integer.
        """
        idx = check_indices(indices, len(self._labels))
        raw = np.empty((idx.size, *self.in_shape), dtype=np.uint8)
        segment_of = np.searchsorted(self._offsets, idx, side="right") - 1
        for seg in np.unique(segment_of).tolist():
            rows = np.flatnonzero(segment_of == seg)
            raw[rows] = self._segments[seg][idx[rows] - self._offsets[seg]]
        x = torch.from_numpy(raw).float().div_(255.0).sub_(self._mean).div_(self._std)
        return x, torch.from_numpy(self._labels[idx])


def open_mnist(name: str, directory: Path, *, split: str, size: int | None) -> FileDataset:
    """Open MNIST from its idx files in ``directory`` (each may also be ``.gz``).

    Raises:
        ConfigError: a file is missing, truncated or malformed, or a label is not a digit.
    """
    prefix = "t10k" if split == "test" else "train"
    stems = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    folder = _existing_dir(name, directory)
    paths = []
    for stem in stems:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                paths.append(candidate)
                break
        else:
            raise ConfigError(
                f"{name}: missing {stem} (or {stem}.gz) in {folder}; expected "
                f"{', '.join(_MNIST_FILES)} (each may end in .gz)"
            )
    images = _read_idx(paths[0], ndim=3)
    labels = _read_idx(paths[1], ndim=1).astype(np.int64)
    if len(images) != len(labels):
        raise ConfigError(
            f"{name}: {paths[0].name} holds {len(images)} images but {paths[1].name} holds "
            f"{len(labels)} labels"
        )
    _check_labels(name, paths[1], labels, 10)
    count, height, width = images.shape
    segment = images.reshape(count, 1, height, width)
    return _window(name, [segment], labels, 10, _MNIST_NORM, split=split, size=size)


def open_cifar10(name: str, directory: Path, *, split: str, size: int | None) -> FileDataset:
    """Open CIFAR-10 from its binary version (``data_batch_1.bin``... ``test_batch.bin``).

    ``directory`` may hold the files or be the parent of ``cifar-10-batches-bin``.

    Raises:
        ConfigError: a file is missing, truncated or malformed, or a label is out of range.
    """
    train = [f"data_batch_{i}.bin" for i in range(1, 6)]
    files = ["test_batch.bin"] if split == "test" else train
    folder = _cifar_dir(name, directory, "cifar-10-batches-bin", files, [*train, "test_batch.bin"])
    segments, labels = [], []
    for file in files:
        records = _read_records(folder / file, 1 + _CIFAR_PIXELS)
        segments.append(records[:, 1:].reshape(len(records), 3, 32, 32))
        file_labels = records[:, 0].astype(np.int64)
        _check_labels(name, folder / file, file_labels, 10)
        labels.append(file_labels)
    return _window(
        name, segments, np.concatenate(labels), 10, _CIFAR10_NORM, split=split, size=size
    )


def open_cifar100(name: str, directory: Path, *, split: str, size: int | None) -> FileDataset:
    """Open CIFAR-100 from its binary version (``train.bin``, ``test.bin``; fine labels).

    ``directory`` may hold the files or be the parent of ``cifar-100-binary``.

    Raises:
        ConfigError: a file is missing, truncated or malformed, or a label is out of range.
    """
    file = "test.bin" if split == "test" else "train.bin"
    folder = _cifar_dir(name, directory, "cifar-100-binary", [file], ["train.bin", "test.bin"])
    records = _read_records(folder / file, 2 + _CIFAR_PIXELS)
    _check_labels(name, folder / file, records[:, 0].astype(np.int64), 20, what="coarse label")
    labels = records[:, 1].astype(np.int64)
    _check_labels(name, folder / file, labels, 100, what="fine label")
    segment = records[:, 2:].reshape(len(records), 3, 32, 32)
    return _window(name, [segment], labels, 100, _CIFAR100_NORM, split=split, size=size)


def _window(
    name: str,
    segments: Sequence[npt.NDArray[np.uint8]],
    labels: npt.NDArray[np.int64],
    num_classes: int,
    norm: _Normalization,
    *,
    split: str,
    size: int | None,
) -> FileDataset:
    """The split's window over the files' samples (see the module docstring)."""
    total = len(labels)
    start, stop = 0, total
    if split != "test":
        val = min(VAL_SIZE, total // 10)
        start, stop = (total - val, total) if split == "val" else (0, total - val)
    if size is not None:
        stop = min(stop, start + size)
    return FileDataset(
        name,
        segments=segments,
        labels=labels,
        num_classes=num_classes,
        norm=norm,
        start=start,
        stop=stop,
    )


def _existing_dir(name: str, directory: Path) -> Path:
    """``directory`` if it is one.

    Raises:
        ConfigError: it is not.
    """
    if not directory.is_dir():
        raise ConfigError(f"{name}: {directory} is not a directory")
    return directory


def _cifar_dir(
    name: str, directory: Path, subdir: str, needed: Sequence[str], expected: Sequence[str]
) -> Path:
    """``directory`` or ``directory/subdir``, whichever holds every file in ``needed``.

    Raises:
        ConfigError: neither does; the message names the first missing file.
    """
    folder = _existing_dir(name, directory)
    for candidate in (folder, folder / subdir):
        if all((candidate / file).is_file() for file in needed):
            return candidate
    base = folder / subdir if (folder / subdir).is_dir() else folder
    missing = next(file for file in needed if not (base / file).is_file())
    raise ConfigError(
        f"{name}: missing {missing} in {base}; expected {', '.join(expected)} in {folder} "
        f"or in {folder / subdir}"
    )


def _read_bytes(path: Path) -> npt.NDArray[np.uint8]:
    """The bytes of ``path``: memory-mapped, or decompressed if it ends in ``.gz``.

    Raises:
        ConfigError: it cannot be read or decompressed.
    """
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as stream:
                return np.frombuffer(stream.read(), dtype=np.uint8)
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, EOFError, zlib.error) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _read_idx(path: Path, *, ndim: int) -> npt.NDArray[np.uint8]:
    """The unsigned-byte array in idx file ``path``, which must have ``ndim`` dimensions.

    Raises:
        ConfigError: the file is unreadable, has a bad magic number, or its size does not
            match its header.
    """
    data = _read_bytes(path)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ConfigError(f"{path}: truncated idx file ({len(data)} bytes, header needs {header})")
    magic = bytes(data[:4])
    if magic[:2] != b"\x00\x00" or magic[2] != _IDX_UBYTE or magic[3] != ndim:
        raise ConfigError(
            f"{path}: bad idx magic number {magic.hex()} (expected 0000{_IDX_UBYTE:02x}{ndim:02x}: "
            f"unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})"
        )
    dims = tuple(int(d) for d in np.frombuffer(bytes(data[4:header]), dtype=">u4"))
    expected = header + math.prod(dims)
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "too long"
        raise ConfigError(
            f"{path}: {state}: header says {'x'.join(map(str, dims))} "
            f"({expected} bytes) but the file has {len(data)} bytes"
        )
    return data[header:].reshape(dims)


def _read_records(path: Path, record: int) -> npt.NDArray[np.uint8]:
    """The fixed-size records of ``path`` as a ``[n, record]`` uint8 array.

    Raises:
        ConfigError: the file is unreadable, empty, or not a whole number of records.
    """
    data = _read_bytes(path)
    if len(data) == 0 or len(data) % record:
        raise ConfigError(
            f"{path}: truncated or malformed: {len(data)} bytes is not a positive multiple "
            f"of the {record}-byte record"
        )
    return data.reshape(len(data) // record, record)


def _check_labels(
    name: str, path: Path, labels: npt.NDArray[np.int64], classes: int, *, what: str = "label"
) -> None:
    """Check every label is in ``[0, classes)``.

    Raises:
        ConfigError: one is not; the message names the file and the record.
    """
    bad = np.flatnonzero(labels >= classes)
    if bad.size:
        raise ConfigError(
            f"{name}: {path}: record {int(bad[0])} has {what} {int(labels[bad[0]])}, "
            f"expected 0..{classes - 1}"
        )
