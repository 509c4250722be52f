"""What plain PyTorch trains, for tests of equivalence: a model trained on the devices'
batches as an emulated fleet holds them, in their epoch order."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from aiopipe import RunConfig
from aiopipe import data as datasets
from aiopipe.runtime.factories import cross_entropy
from aiopipe.runtime.plan import device_indices, train_dataset


def train_in_turns(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig,
                   devices: Sequence[int], batch: int,
                   own: Sequence[datasets.Dataset] | None = None) -> None:
    """Per epoch, each of ``devices`` in turn: its batches of ``batch`` samples in its
    epoch order, one optimizer step each, with cross-entropy (over the output's last
    dimension: per sample, or per token). ``own``: each device's
    own data (else its shard of the config's dataset); inputs that are a tuple are the
    model's several inputs."""
    dataset = train_dataset(config) if own is None else None
    for epoch in range(config.epochs):
        for k in devices:
            data = own[k] if own is not None else dataset
            assert data is not None
            indices = (np.arange(len(data)) if own is not None
                       else device_indices(config, data, k))
            order = datasets.epoch_order(indices, epoch=epoch, seed=config.seed)
            for first in range(0, len(order) - batch + 1, batch):
                x, y = data.batch(order[first:first + batch])
                optimizer.zero_grad()
                out = model(*x) if isinstance(x, tuple) else model(x)
                cross_entropy(out, y).backward()
                optimizer.step()


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, config: RunConfig,
                    device: int, epoch: int, batch: int) -> None:
    """Device ``device``'s batches of epoch ``epoch`` (its shard of the config's dataset,
    in that epoch's order), one optimizer step each, with cross-entropy."""
    dataset = train_dataset(config)
    order = datasets.epoch_order(device_indices(config, dataset, device), epoch=epoch,
                                 seed=config.seed)
    for first in range(0, len(order) - batch + 1, batch):
        x, y = dataset.batch(order[first:first + batch])
        optimizer.zero_grad()
        cross_entropy(model(x), y).backward()
        optimizer.step()
