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
    """A map-style torch dataset of ``(input, target)`` pairs as a `Dataset`.

    An input is a tensor (or an array) or a tuple of them (a model's several inputs);
    floating ones are read as float32, integer ones (token ids) as int64. A target is an
    integer class label, or a tensor of any shape (a class per token, values to
    regress), read as float32 when floating and int64 otherwise.

    ``num_classes``: the labels' range; by default, for integer labels, the source's
    ``classes`` (as torchvision datasets have them), else the largest label + 1; 0 for
    tensor targets unless given (a class per token: the vocabulary). Integer labels are
    read once, up front (the source's ``targets`` when it has them, else from every
    sample); inputs and tensor targets are read per batch.

    Raises:
        ConfigError: the source is empty, a sample is not an (input, target) pair,
            inputs or targets are not all of one shape, or a label is outside
            0..num_classes-1.
    """

    __slots__ = ("_kinds", "_labels", "_name", "_num_classes", "_source", "_target")

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
        first, target = self._sample(0)
        self._kinds = [(t.dtype, tuple(int(d) for d in t.shape)) for t in first]
        #: a tensor target's dtype and shape (None: integer class labels)
        self._target = None if isinstance(target, int) else (target.dtype,
                                                             tuple(target.shape))
        labels = self._class_labels(count) if self._target is None else np.zeros(
            count, dtype=np.int64)  # no classes to share out by: IID shares only
        if num_classes is None:
            classes = getattr(source, "classes", None)
            num_classes = (0 if self._target is not None else
                           len(classes) if classes is not None else int(labels.max()) + 1)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or (
                num_classes < int(self._target is None)):
            raise ConfigError(f"dataset {name}: num_classes must be an int >= 1 (>= 0 for "
                              f"tensor targets), got {num_classes!r}")
        if self._target is None and int(labels.max()) >= num_classes:
            raise ConfigError(f"dataset {name}: label {int(labels.max())} is outside "
                              f"0..{num_classes - 1}")
        labels.flags.writeable = False
        self._labels, self._num_classes = labels, num_classes

    def _class_labels(self, count: int) -> npt.NDArray[np.int64]:
        targets = getattr(self._source, "targets", None)
        if targets is not None and len(targets) == count:
            labels = np.asarray([int(t) for t in targets], dtype=np.int64)
        else:
            labels = np.asarray([self._sample(i)[1] for i in range(count)], dtype=np.int64)
        if int(labels.min()) < 0:
            raise ConfigError(f"dataset {self._name}: label {int(labels.min())} is negative")
        return labels

    def _sample(self, index: int) -> tuple[tuple[torch.Tensor, ...], int | torch.Tensor]:
        item = self._source[index]
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ConfigError(f"dataset {self._name}: sample {index} is not an (input, "
                              "target) pair")
        x, y = item
        inputs = tuple(_as_tensor(v) for v in (x if isinstance(x, tuple | list) else (x,)))
        if isinstance(y, int) or (isinstance(y, torch.Tensor | np.ndarray | np.integer)
                                  and np.ndim(y) == 0 and not _floating(y)):
            return inputs, int(y)
        try:
            return inputs, _as_tensor(y)
        except (TypeError, ValueError):
            raise ConfigError(f"dataset {self._name}: sample {index}'s target {y!r} is "
                              "neither an integer label nor a tensor") from None

    @property
    def name(self) -> str:
        """The name it was given."""
        return self._name

    @property
    def num_classes(self) -> int:
        """How many classes the labels range over (0: the targets are not labels)."""
        return self._num_classes

    @property
    def in_shape(self) -> tuple[int, ...]:
        """The shape of one (the first) input."""
        return self._kinds[0][1]

    def __len__(self) -> int:
        """The number of samples."""
        return len(self._labels)

    def labels(self) -> npt.NDArray[np.int64]:
        """All class labels in index order (zeros for tensor targets)."""
        return self._labels

    def batch(self, indices: Sequence[int] | npt.NDArray[np.integer]
              ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """The samples at ``indices`` as ``(inputs, targets)``: one batched tensor per
        input (a tuple when the samples have several), and the targets batched.

        Raises:
            ConfigError: an index is out of range, or a sample's input or target has
                another shape than sample 0's.
        """
        idx = check_indices(indices, len(self))
        columns: list[list[torch.Tensor]] = [[] for _ in self._kinds]
        targets = []
        for i in idx.tolist():
            x, y = self._sample(i)
            if [tuple(t.shape) for t in x] != [shape for _, shape in self._kinds]:
                raise ConfigError(f"dataset {self._name}: sample {i} has inputs of shape "
                                  f"{[tuple(t.shape) for t in x]}, sample 0 "
                                  f"{[shape for _, shape in self._kinds]}")
            for column, t in zip(columns, x, strict=True):
                column.append(t)
            if self._target is not None:
                assert isinstance(y, torch.Tensor)
                if tuple(y.shape) != self._target[1]:
                    raise ConfigError(f"dataset {self._name}: sample {i}'s target has shape "
                                      f"{tuple(y.shape)}, sample 0's {self._target[1]}")
                targets.append(y)
        inputs = tuple(torch.stack(c) if c else torch.zeros(0, *shape, dtype=dtype)
                       for c, (dtype, shape) in zip(columns, self._kinds, strict=True))
        x_out = inputs[0] if len(inputs) == 1 else inputs
        if self._target is None:
            return x_out, torch.from_numpy(self._labels[idx])
        dtype, shape = self._target
        return x_out, (torch.stack(targets) if targets else torch.zeros(0, *shape,
                                                                        dtype=dtype))


def _floating(value: object) -> bool:
    return bool(np.issubdtype(np.asarray(value).dtype, np.floating)) or (
        isinstance(value, torch.Tensor) and value.is_floating_point())


def _as_tensor(value: object) -> torch.Tensor:
    """``value`` as a tensor as a batch holds it: float32 if floating, else int64 (bool
    as it is)."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if t.dtype == torch.bool:
        return t
    return t.to(torch.float32 if t.is_floating_point() else torch.int64)


class Shard:
    """Samples ``indices`` of ``dataset``, as a dataset of their own (in that order)."""

    __slots__ = ("_dataset", "_indices")

    def __init__(self, dataset: Dataset, indices: Sequence[int] | npt.NDArray[np.integer]
                 ) -> None:
        self._dataset = dataset
        self._indices = check_indices(indices, len(dataset))

    @property
    def whole(self) -> Dataset:
        """The dataset the shard is cut from."""
        return self._dataset

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
              ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
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
