"""A device's own data: any map-style torch dataset, a shard of a shared one, or a spec.

A device trains on whatever it holds (`open_device_data` opens it by name, ``Device(...,
dataset=...)`` takes it as an object); the server never opens training data. Three
kinds of source become a `Dataset`:

- `TorchDataset`: a map-style ``torch.utils.data.Dataset`` of ``(tensor, label)`` pairs,
  the form users' data takes;
- `Shard`: a device's share of a dataset every node can open alike, the emulated fleets
  of the launcher (``python -m aiopipe``) and of `aiopipe.simulate`;
- a spec string: a dataset name of `open_dataset` (its training split) or
  ``module:function``, an entry point that returns a dataset (`aiopipe.entrypoints`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from aiopipe.data.catalog import FILE_FORMATS, open_dataset
from aiopipe.data.dataset import Dataset, check_indices
from aiopipe.errors import ConfigError

__all__ = ["Shard", "TorchDataset", "as_dataset", "open_device_data"]


class TorchDataset:
    """A map-style torch dataset of ``(tensor, label)`` pairs as a `Dataset`.

    ``num_classes``: the labels' range; by default the source's ``classes`` (as
    torchvision datasets have them), else the largest label + 1. Labels are read once, up
    front (the source's ``targets`` when it has them, else from every sample); inputs
    are read per batch.

    Raises:
        ConfigError: the source is empty, a sample is not a (tensor, integer label) pair,
            inputs are not all of one shape, or a label is outside 0..num_classes-1.
    """

    __slots__ = ("_in_shape", "_labels", "_name", "_num_classes", "_source")

    def __init__(self, source: Any, *, name: str = "custom", num_classes: int | None = None
                 ) -> None:
        self._source, self._name = source, name
        try:
            count = len(source)
        except TypeError:
            raise ConfigError(f"dataset {name}: expected a map-style dataset (with len() "
                              f"and [i]), got {type(source).__name__}") from None
        if count < 1:
            raise ConfigError(f"dataset {name}: it holds no samples")
        first, _ = self._sample(0)
        self._in_shape = tuple(int(d) for d in first.shape)
        targets = getattr(source, "targets", None)
        if targets is not None and len(targets) == count:
            labels = np.asarray([int(t) for t in targets], dtype=np.int64)
        else:
            labels = np.asarray([self._sample(i)[1] for i in range(count)], dtype=np.int64)
        if int(labels.min()) < 0:
            raise ConfigError(f"dataset {name}: label {int(labels.min())} is negative")
        classes = getattr(source, "classes", None)
        if num_classes is None:
            num_classes = len(classes) if classes is not None else int(labels.max()) + 1
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or (
                num_classes < 1):
            raise ConfigError(f"dataset {name}: num_classes must be an int >= 1, "
                              f"got {num_classes!r}")
        if int(labels.max()) >= num_classes:
            raise ConfigError(f"dataset {name}: label {int(labels.max())} is outside "
                              f"0..{num_classes - 1}")
        labels.flags.writeable = False
        self._labels, self._num_classes = labels, num_classes

    def _sample(self, index: int) -> tuple[torch.Tensor, int]:
        item = self._source[index]
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ConfigError(f"dataset {self._name}: sample {index} is not an (input, "
                              "label) pair")
        x, y = item
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x))
        try:
            label = int(y)
        except (TypeError, ValueError):
            raise ConfigError(f"dataset {self._name}: sample {index}'s label {y!r} is not "
                              "an integer") from None
        return x, label

    @property
    def name(self) -> str:
        """The name it was given."""
        return self._name

    @property
    def num_classes(self) -> int:
        """How many classes the labels range over."""
        return self._num_classes

    @property
    def in_shape(self) -> tuple[int, ...]:
        """The shape of one input."""
        return self._in_shape

    def __len__(self) -> int:
        """The number of samples."""
        return len(self._labels)

    def labels(self) -> npt.NDArray[np.int64]:
        """All labels in index order."""
        return self._labels

    def batch(self, indices: Sequence[int] | npt.NDArray[np.integer]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices`` as ``(float32 inputs, int64 labels)``.

        Raises:
            ConfigError: an index is out of range, or a sample's input has another shape.
        """
        idx = check_indices(indices, len(self))
        inputs = []
        for i in idx.tolist():
            x, _ = self._sample(i)
            if tuple(x.shape) != self._in_shape:
                raise ConfigError(f"dataset {self._name}: sample {i} has shape "
                                  f"{tuple(x.shape)}, sample 0 {self._in_shape}")
            inputs.append(x.to(torch.float32))
        x = torch.stack(inputs) if inputs else torch.zeros(0, *self._in_shape)
        return x, torch.from_numpy(self._labels[idx])


class Shard:
    """Samples ``indices`` of ``dataset``, as a dataset of their own (in that order)."""

    __slots__ = ("_dataset", "_indices")

    def __init__(self, dataset: Dataset, indices: Sequence[int] | npt.NDArray[np.integer]
                 ) -> None:
        self._dataset = dataset
        self._indices = check_indices(indices, len(dataset))

    @property
    def name(self) -> str:
        """The whole dataset's name."""
        return self._dataset.name

    @property
    def num_classes(self) -> int:
        """The whole dataset's classes."""
        return self._dataset.num_classes

    @property
    def in_shape(self) -> tuple[int, ...]:
        """The shape of one input."""
        return tuple(self._dataset.in_shape)

    def __len__(self) -> int:
        """The number of samples in the shard."""
        return len(self._indices)

    def labels(self) -> npt.NDArray[np.int64]:
        """The shard's labels in its order."""
        return self._dataset.labels()[self._indices]

    def batch(self, indices: Sequence[int] | npt.NDArray[np.integer]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's samples at ``indices``.

        Raises:
            ConfigError: an index is outside the shard.
        """
        return self._dataset.batch(self._indices[check_indices(indices, len(self))])


def as_dataset(source: Any, *, name: str = "custom") -> Dataset:
    """``source`` as a `Dataset`: itself when it is one, else a `TorchDataset` of it.

    Raises:
        ConfigError: it is neither (see `TorchDataset`).
    """
    if isinstance(source, Dataset):
        return source
    return TorchDataset(source, name=name)


def open_device_data(spec: str, *, split: str = "train", seed: int = 0,
                     size: int | None = None) -> Dataset:
    """The data ``spec`` names on this node: a device's training data, or (``split =
    "test"``) the coordinator's evaluation data.

    ``spec``: a name of `aiopipe.data.open_dataset` (its ``split``: ``mnist:DIR``,
    ``cifar10:DIR``, ``cifar100:DIR``, or a synthetic dataset of ``size`` samples drawn
    with ``seed``), or ``module:function``, an entry point (called with ``split`` and
    ``seed`` if it takes them) that returns a `Dataset` or a map-style torch dataset;
    ``size`` keeps the first samples of what it returns.

    Raises:
        ConfigError: the spec names nothing usable (the message says why).
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"data: expected a dataset name or module:function, got {spec!r}")
    kind, sep, _ = spec.partition(":")
    if sep and kind not in FILE_FORMATS:
        from aiopipe.entrypoints import call_factory, load_entry_point

        made = as_dataset(call_factory(load_entry_point(spec, what="data"), spec,
                                       what="data", split=split, seed=seed), name=spec)
        if size is not None and size < len(made):
            return Shard(made, np.arange(size))
        return made
    return open_dataset(spec, split=split, size=size, seed=seed)
