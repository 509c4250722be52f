"""Datasets, and how their samples are shared among devices.

`open_dataset` opens a learnable synthetic dataset (`DATASET_NAMES`) or real files in
their standard formats (``"mnist:DIR"``, ``"cifar10:DIR"``, ``"cifar100:DIR"``) as a
`Dataset`; `open_device_data` also takes ``module:function`` entry points, and
`as_dataset` any map-style torch dataset (a device's own data); `DataKind` says what a
run's samples are (`kind_of` reads it from a dataset); `partition` gives each
device of an emulated fleet its sample indices (IID or Dirichlet label skew, equal or
unequal sizes), `Shard` its view; `epoch_order` shuffles a device's samples per epoch.
"""

from __future__ import annotations

from aiopipe.data.catalog import DATASET_NAMES, FILE_FORMATS, data_format, open_dataset
from aiopipe.data.dataset import SPLITS, Dataset
from aiopipe.data.kind import DataKind, kind_of
from aiopipe.data.partition import SCHEMES, epoch_order, partition
from aiopipe.data.readers import FileDataset
from aiopipe.data.sources import Shard, TorchDataset, as_dataset, open_device_data
from aiopipe.data.synthetic import SyntheticDataset

__all__ = [
    "DATASET_NAMES",
    "FILE_FORMATS",
    "SCHEMES",
    "SPLITS",
    "DataKind",
    "Dataset",
    "FileDataset",
    "Shard",
    "SyntheticDataset",
    "TorchDataset",
    "as_dataset",
    "data_format",
    "epoch_order",
    "kind_of",
    "open_dataset",
    "open_device_data",
    "partition",
]
