"""The run's kind of data: what a sample's inputs and target are, and its classes.

Every node builds the model for it and checks what it is sent against it: a device
announces its own data's kind (`Ready`), the coordinator refuses a device whose data is
of another kind, and the plan tells every device the run's (`Plan`). A sample's input
is one tensor (an image, a sequence of token ids) or several (a model of two inputs);
its target is one tensor of any shape (a class index, a class per token, a vector to
regress). ``classes`` is the range of a target of class indices, 0 for any other.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Final

import numpy as np

from aiopipe.data.dataset import Dataset
from aiopipe.errors import ConfigError
from aiopipe.models.crossing import Crossing, Leaf, crossing_of

__all__ = ["CLASS_INDEX", "DataKind", "kind_of"]

#: The target of a classifier: one class index per sample.
CLASS_INDEX: Final[Leaf] = ("int64", ())


@dataclass(frozen=True, slots=True)
class DataKind:
    """A sample's ``inputs`` (per-sample leaves, `aiopipe.models.crossing`), its
    ``target`` (one leaf) and the ``classes`` a target of class indices ranges over
    (0: the target is not class indices, e.g. regression)."""

    inputs: Crossing
    target: Leaf = CLASS_INDEX
    classes: int = 0

    @classmethod
    def classified(cls, in_shape: tuple[int, ...], classes: int) -> DataKind:
        """One float32 input of per-sample ``in_shape``, a class index as its target."""
        return cls((("float32", tuple(in_shape)),), CLASS_INDEX, classes)

    @property
    def in_shape(self) -> tuple[int, ...]:
        """The per-sample shape of the (first) input: what model factories are given."""
        return self.inputs[0][1]

    @property
    def class_indices(self) -> bool:
        """Whether the target is class indices (labels in ``0..classes-1``)."""
        return self.classes > 0 and self.target[0] == "int64"

    def describe(self) -> str:
        """One line for messages: ``inputs float32 (3, 32, 32), target int64 () of 10
        classes``."""
        ins = ", ".join(f"{d} {s}" for d, s in self.inputs)
        classes = f" of {self.classes} classes" if self.classes else ""
        return f"inputs {ins}, target {self.target[0]} {self.target[1]}{classes}"


def kind_of(dataset: Dataset) -> DataKind:
    """The kind of ``dataset``'s samples, read from its first sample (and its
    ``num_classes``, which counts only for a target of int64 class indices).

    Raises:
        ConfigError: it is empty, a sample's input or target is not tensors with the
            samples' rows first, or an input is empty.
    """
    if len(dataset) < 1:
        raise ConfigError(f"dataset {dataset.name}: it holds no samples")
    whole = getattr(dataset, "whole", None)
    if whole is not None:  # a shard (`Shard`): its samples are its whole dataset's kind
        return _whole_kind(whole)
    x, y = dataset.batch(np.zeros(1, dtype=np.int64))
    try:
        inputs, (target, *more) = crossing_of(x), crossing_of(y)
    except ConfigError as exc:
        raise ConfigError(f"dataset {dataset.name}: {exc}") from None
    if more:
        raise ConfigError(f"dataset {dataset.name}: a sample's target must be one tensor")
    for _, shape in inputs:
        if math.prod(shape) < 1 or not shape:
            raise ConfigError(f"dataset {dataset.name}: inputs of shape {shape} are empty")
    classes = int(dataset.num_classes) if target[0] == "int64" else 0
    return DataKind(inputs, target, classes)


#: the kind of each whole dataset shards were cut from, read once: the devices of an
#: in-process simulation each announce their shard's kind, and a synthetic sample takes
#: ~0.4 ms to render (40 s of a 100,000-device start)
_WHOLE_KINDS: weakref.WeakKeyDictionary[Dataset, DataKind] = weakref.WeakKeyDictionary()


def _whole_kind(whole: Dataset) -> DataKind:
    """`kind_of` ``whole``, read once while it lives (every time if it cannot be
    weakly referenced)."""
    try:
        return _WHOLE_KINDS[whole]
    except (KeyError, TypeError):
        pass
    kind = kind_of(whole)
    with contextlib.suppress(TypeError):
        _WHOLE_KINDS[whole] = kind
    return kind
