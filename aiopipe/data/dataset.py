"""The `Dataset` interface every data source implements, and the argument checks they share.

A dataset is a fixed, indexable set of labelled samples (images, for the built-in
ones). It never holds a decoded copy of its images: `Dataset.batch` decodes (or
generates) exactly the samples it is asked for, so a device opens a dataset of any size
for free and pays per batch.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from aiopipe.errors import ConfigError

__all__ = [
    "SPLITS",
    "Dataset",
    "check_indices",
    "check_seed",
    "check_size",
    "check_split",
    "seed_words",
]

SPLITS: Final = ("train", "val", "test")
"""The split names `aiopipe.data.open_dataset` accepts."""


@runtime_checkable
class Dataset(Protocol):
    """A fixed set of samples with their targets, read or generated on demand.

    ``x`` from `batch` is the samples' input, rows first: one tensor (the built-in
    image sets': float32 ``[b, *in_shape]``, normalized to roughly zero mean and unit
    standard deviation per channel; token ids: int64) or a tuple of them (a model of
    several inputs); ``y`` is their targets, rows first: int64 ``[b]`` class labels in
    ``[0, num_classes)``, or any other tensor (a class per token, values to regress:
    then ``num_classes`` is the tokens' classes, or 0). `aiopipe.data.kind_of` reads a
    dataset's kind of data from its first sample.
    """

    @property
    def name(self) -> str:
        """The name `aiopipe.data.open_dataset` opened this dataset by."""
        ...

    @property
    def num_classes(self) -> int:
        """How many classes the labels range over (0: the targets are not classes)."""
        ...

    @property
    def in_shape(self) -> tuple[int, ...]:
        """The shape of one sample's (first) input (images: channels, height, width):
        what model factories are given."""
        ...

    def __len__(self) -> int:
        """The number of samples."""
        ...

    def labels(self) -> npt.NDArray[np.int64]:
        """One integer label per sample in index order, without decoding any image: what
        a fleet's data is shared out by (`aiopipe.data.partition`); any constant for
        data without classes (IID shares only)."""
        ...

    def batch(
        self, indices: Sequence[int] | npt.NDArray[np.integer]
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """The samples at ``indices`` (in that order; repeats allowed) as ``(x, y)``.

        Raises:
            ConfigError: an index is out of ``[0, len(self))`` or not an integer.
        """
        ...


def check_split(split: object) -> str:
    """Return ``split`` if it is one of `SPLITS`.

    Raises:
        ConfigError: it is not.
    """
    if not isinstance(split, str) or split not in SPLITS:
        raise ConfigError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    return split


def check_size(size: object) -> int | None:
    """Return ``size`` if it is None or a positive integer.

    Raises:
        ConfigError: it is neither.
    """
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"size: expected a positive integer or None, got {size!r}")
    return size


def check_seed(seed: object) -> int:
    """Return ``seed`` if it is an integer (negative seeds are allowed).

    Raises:
        ConfigError: it is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed: expected an integer, got {seed!r}")
    return seed


def seed_words(seed: int) -> list[int]:
    """Spell an integer seed as non-negative words for `numpy.random.SeedSequence`."""
    return [0, seed] if seed >= 0 else [1, -seed]


def check_indices(
    indices: Sequence[int] | npt.NDArray[np.integer], size: int
) -> npt.NDArray[np.int64]:
    """Return ``indices`` as a 1-D int64 array after checking every one is in ``[0, size)``.

    Raises:
        ConfigError: ``indices`` is not a 1-D sequence of integers, or one is out of range.
    """
    if isinstance(indices, np.ndarray):
        if indices.ndim != 1 or not (
            np.issubdtype(indices.dtype, np.integer) or (indices.size == 0)
        ):
            raise ConfigError(
                f"indices: expected a 1-D integer array, got {indices.dtype} {indices.shape}"
            )
        out = indices.astype(np.int64, copy=False)
    else:
        try:
            out = np.fromiter((operator.index(i) for i in indices), dtype=np.int64)
        except (TypeError, OverflowError) as exc:
            raise ConfigError(f"indices: expected integers ({exc})") from None
    if out.size and (int(out.min()) < 0 or int(out.max()) >= size):
        bad = int(out.min()) if int(out.min()) < 0 else int(out.max())
        raise ConfigError(f"indices: {bad} is out of range for a dataset of {size} samples")
    return out
