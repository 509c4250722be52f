"""`open_dataset`: one name for every dataset aiopipe can train on.

Names are the synthetic datasets in `DATASET_NAMES` (generated, nothing to download),
``"stdlib-text"`` (byte windows of the Python standard library's own source, for
language models: `aiopipe.data.text`) and ``"mnist:DIR"``, ``"cifar10:DIR"``,
``"cifar100:DIR"`` for files in the standard formats (see `aiopipe.data.readers` for the
files and how the splits are carved).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

from aiopipe.data.dataset import SPLITS, Dataset, check_seed, check_size, check_split
from aiopipe.data.kind import DataKind
from aiopipe.data.readers import FileDataset, open_cifar10, open_cifar100, open_mnist
from aiopipe.data.synthetic import SYNTHETIC_SPECS, SyntheticDataset
from aiopipe.data.text import CONTEXT, TEXT_NAME, VOCAB, StdlibText
from aiopipe.errors import ConfigError

__all__ = ["DATASET_NAMES", "FILE_FORMATS", "data_format", "open_dataset"]

DATASET_NAMES: Final = tuple(sorted(SYNTHETIC_SPECS))
"""The synthetic datasets, sorted."""

_READERS: Final[dict[str, Callable[..., FileDataset]]] = {
    "cifar10": open_cifar10,
    "cifar100": open_cifar100,
    "mnist": open_mnist,
}
FILE_FORMATS: Final = tuple(sorted(_READERS))
"""The prefixes of ``"FORMAT:DIR"`` dataset names."""

#: (input shape, classes) of each file format.
_FILE_SHAPES: Final[dict[str, tuple[tuple[int, ...], int]]] = {
    "cifar10": ((3, 32, 32), 10),
    "cifar100": ((3, 32, 32), 100),
    "mnist": ((1, 28, 28), 10),
}


def data_format(name: str) -> DataKind | None:
    """The kind of the dataset called ``name`` (images of classes), known from the name
    alone, without opening a file; None for a name that is not `open_dataset`'s (a
    ``module:function`` entry point: only its data can tell).

    Raises:
        ConfigError: a synthetic-looking name that is not one of `DATASET_NAMES`.
    """
    spec = SYNTHETIC_SPECS.get(name)
    if spec is not None:
        return DataKind.classified(spec.in_shape, spec.num_classes)
    if name == TEXT_NAME:  # token ids in, the next token of each as the target
        return DataKind((("int64", (CONTEXT,)),), ("int64", (CONTEXT,)), VOCAB)
    kind, sep, _ = name.partition(":")
    if sep and kind in _FILE_SHAPES:
        return DataKind.classified(*_FILE_SHAPES[kind])
    if not sep:
        raise ConfigError(
            f"dataset: unknown {name!r}; expected one of {', '.join(DATASET_NAMES)}, "
            f"{TEXT_NAME}, {', '.join(f'{k}:DIR' for k in FILE_FORMATS)} or module:function")
    return None


def open_dataset(
    name: str, *, split: str = "train", size: int | None = None, seed: int = 0
) -> Dataset:
    """Open one split of the dataset called ``name``.

    For a synthetic dataset, ``size`` is the number of samples in the split (default: the
    real dataset's split size, pipar.txt Table 4) and ``seed`` fixes every sample. For
    ``"stdlib-text"`` and ``"FORMAT:DIR"``, ``size`` keeps the first ``size`` samples of
    the split (None: all) and ``seed`` is not used (the splits are carved without
    randomness).

    Raises:
        ConfigError: the name, split, size or seed is invalid, or the files are missing,
            truncated or malformed.
    """
    split = check_split(split)
    size = check_size(size)
    seed = check_seed(seed)
    if not isinstance(name, str):
        raise ConfigError(f"dataset: expected a name, got {name!r}")
    spec = SYNTHETIC_SPECS.get(name)
    if spec is not None:
        default = spec.split_sizes[SPLITS.index(split)]
        return SyntheticDataset(
            spec, split=split, size=default if size is None else size, seed=seed
        )
    if name == TEXT_NAME:
        return StdlibText(split=split, size=size)
    kind, sep, directory = name.partition(":")
    reader = _READERS.get(kind)
    if not sep or reader is None or not directory:
        raise ConfigError(
            f"dataset: unknown {name!r}; expected one of {', '.join(DATASET_NAMES)}, "
            f"{TEXT_NAME} or {', '.join(f'{k}:DIR' for k in FILE_FORMATS)}"
        )
    return reader(name, Path(directory).expanduser(), split=split, size=size)
