"""A dataset of two inputs per sample, for tests of models that take two: each
synthetic-mnist image as its top half and its bottom half, flattened (a model of two
towers; `tests/runtime/test_runtime_traced_models.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from aiopipe import data as datasets

HALF = 14 * 28


class TwoViews:
    """``base``'s samples as ``((top, bottom), label)``: two float32 inputs of
    ``(HALF,)``."""

    def __init__(self, base: datasets.Dataset) -> None:
        self.base = base

    @property
    def name(self) -> str:
        return f"two-views-{self.base.name}"

    @property
    def num_classes(self) -> int:
        return self.base.num_classes

    @property
    def in_shape(self) -> tuple[int, ...]:
        return (HALF,)

    def __len__(self) -> int:
        return len(self.base)

    def labels(self) -> npt.NDArray[np.int64]:
        return self.base.labels()

    def batch(self, indices: Sequence[int] | npt.NDArray[np.integer]
              ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        x, y = self.base.batch(indices)
        flat = x.flatten(1)
        return (flat[:, :HALF].contiguous(), flat[:, HALF:].contiguous()), y


def dataset(split: str, seed: int, size: int = 60) -> TwoViews:
    """The entry point a config names (``two_views:dataset``)."""
    return TwoViews(datasets.open_dataset("synthetic-mnist", split=split, size=size,
                                          seed=seed))
