"""A lab's own data and model, named from aiopipe's command lines as ``module:function``.

Run from this directory (so that ``mylab`` is importable):

    # the server: this model, evaluated on the lab's test split (no training data)
    python -m aiopipe.server --model mylab:net --dataset mylab:data --devices 2 \\
        --batch-size 16 --split-point 1 --parallel-batches 2 --epochs 5
    # each device on its own records (here: different draws, and unequal sizes)
    python -m aiopipe.device --server ws://127.0.0.1:8765/ws --device-id 0 \\
        --data mylab:data --seed 1 --samples 200
    python -m aiopipe.device --server ws://127.0.0.1:8765/ws --device-id 1 \\
        --data mylab:data --seed 2

`data` stands for whatever reads a lab's records: it returns any map-style torch dataset
of ``(input tensor, integer label)``. `net` returns the model as an ``nn.Sequential``
whose top-level children are the units aiopipe may split between device and server.
`loss` and `adam` show the other two factories (``--loss mylab:loss --optimizer
mylab:adam``, or ``loss = "mylab:loss"`` in a config file).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

FEATURES = 12
CLASSES = 3


def data(split: str = "train", seed: int = 0) -> torch.utils.data.TensorDataset:
    """Readings of ``FEATURES`` sensors, each record one of ``CLASSES`` conditions; each
    condition raises its own sensors. ``split`` "train" (400 records) or "test" (200),
    ``seed``: which records (each device passes its own)."""
    generator = torch.Generator().manual_seed(seed if split == "train" else 10_000 + seed)
    count = 400 if split == "train" else 200
    labels = torch.arange(count) % CLASSES
    signal = nn.functional.one_hot(labels * 4, FEATURES).float() * 1.5
    inputs = torch.randn(count, FEATURES, generator=generator) + signal
    return torch.utils.data.TensorDataset(inputs, labels)


def net(num_classes: int, in_shape: tuple[int, ...], width: int = 32) -> nn.Sequential:
    """Three units: two hidden layers and the classifier."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(in_shape[0], width), nn.ReLU()),
        nn.Sequential(nn.Linear(width, width), nn.ReLU()),
        nn.Linear(width, num_classes),
    )


def loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy with label smoothing (the mean over a micro-batch)."""
    return nn.CrossEntropyLoss(label_smoothing=0.1)


def adam(params: Iterable[nn.Parameter], learning_rate: float) -> torch.optim.Optimizer:
    """Adam at the run's learning rate (the run's momentum is not Adam's: not taken)."""
    return torch.optim.Adam(params, lr=learning_rate)
