"""Datasets, and how their samples are shared among devices.

`open_dataset` opens a learnable synthetic dataset (`DATASET_NAMES`) or real files in
their standard formats (``"mnist:DIR"``, ``"cifar10:DIR"``, ``"cifar100:DIR"``) as a
`Dataset`; `partition` gives each device its sample indices (IID or Dirichlet label
skew); `epoch_order` shuffles a device's indices per epoch.
"""

from __future__ import annotations

from aiopipe.data.catalog import DATASET_NAMES, FILE_FORMATS, open_dataset
from aiopipe.data.dataset import SPLITS, Dataset
from aiopipe.data.partition import SCHEMES, epoch_order, partition
from aiopipe.data.readers import FileDataset
from aiopipe.data.synthetic import SyntheticDataset

__all__ = [
    "DATASET_NAMES",
    "FILE_FORMATS",
    "SCHEMES",
    "SPLITS",
    "Dataset",
    "FileDataset",
    "SyntheticDataset",
    "epoch_order",
    "open_dataset",
    "partition",
]
