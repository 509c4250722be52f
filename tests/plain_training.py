"""What plain PyTorch trains, for tests of equivalence: a model trained on the devices'
batches as an emulated fleet holds them, in their epoch order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aiopipe import RunConfig
from aiopipe import data as datasets
from aiopipe.runtime.plan import device_indices, train_dataset


def train_in_turns(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig,
                   devices: Sequence[int], batch: int) -> None:
    """Per epoch, each of ``devices`` in turn: its batches of ``batch`` samples in its
    epoch order, one optimizer step each, with cross-entropy."""
    dataset = train_dataset(config)
    for epoch in range(config.epochs):
        for k in devices:
            order = datasets.epoch_order(device_indices(config, dataset, k), epoch=epoch,
                                         seed=config.seed)
            for first in range(0, len(order) - batch + 1, batch):
                x, y = dataset.batch(order[first:first + batch])
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
