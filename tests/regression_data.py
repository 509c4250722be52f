"""A regression task for tests of targets that are not class labels (issue 44, item 2):
eight features, a float target of one value per sample that a linear model learns, a
small model, and a metric of the user's own (`module:function`).

The same source serves in-process tests and real processes (`tests/test_targets_processes.py`
writes it where the commands import it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

FEATURES = 8


class Linear:
    """``size`` samples ``x ~ N(0, 1)`` with ``y = x @ w + 0.05 noise`` (``w`` fixed),
    drawn from ``seed``: float32 inputs ``(FEATURES,)`` and targets ``(1,)``."""

    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.default_rng([7, seed])
        weights = np.linspace(-1.0, 1.0, FEATURES).astype(np.float32)
        self.x = rng.standard_normal((size, FEATURES)).astype(np.float32)
        noise = 0.05 * rng.standard_normal(size).astype(np.float32)
        self.y = (self.x @ weights + noise)[:, None].astype(np.float32)

    name = "linear-regression"
    num_classes = 0
    in_shape = (FEATURES,)

    def __len__(self) -> int:
        return len(self.x)

    def labels(self) -> npt.NDArray[np.int64]:
        return np.zeros(len(self.x), dtype=np.int64)  # no classes: IID shares only

    def batch(self, indices: Sequence[int] | npt.NDArray[np.integer]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        index = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(self.x[index]), torch.from_numpy(self.y[index])


def dataset(split: str, seed: int) -> Linear:
    """The entry point: 400 training samples, 100 of each other split."""
    return Linear(400 if split == "train" else 100, seed + ("train", "val", "test").index(split))


def model(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Two units: a hidden layer and the output (num_classes is 0: no classes)."""
    return nn.Sequential(nn.Sequential(nn.Linear(in_shape[0], 16), nn.Tanh()),
                         nn.Linear(16, 1))


def within(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Samples predicted within 0.25 of their target, counted."""
    return ((output - target).abs() < 0.25).sum()


def metric() -> object:
    """The metric factory (``regression_data:metric``)."""
    return within
