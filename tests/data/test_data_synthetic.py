"""Synthetic datasets: determinism, shapes, balance, disjoint splits, and `open_dataset`."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

import aiopipe.data
from aiopipe.data import DATASET_NAMES, Dataset, SyntheticDataset, open_dataset
from aiopipe.errors import ConfigError

SHAPES = {
    "synthetic-cifar10": (10, (3, 32, 32), 50_000),
    "synthetic-cifar100": (100, (3, 32, 32), 50_000),
    "synthetic-mnist": (10, (1, 28, 28), 60_000),
    "synthetic-tinyimagenet": (200, (3, 64, 64), 100_000),
}


def test_names_are_sorted_and_complete() -> None:
    assert tuple(sorted(SHAPES)) == DATASET_NAMES


def test_exports_are_complete() -> None:
    public = {
        name
        for name in dir(aiopipe.data)
        if not name.startswith("_")
        and name not in {"annotations"}
        and not isinstance(getattr(aiopipe.data, name), type(aiopipe.data))
    }
    assert sorted(aiopipe.data.__all__) == sorted(public)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_dtypes_and_default_sizes(name: str) -> None:
    classes, shape, train_size = SHAPES[name]
    ds = open_dataset(name)
    assert isinstance(ds, Dataset)
    assert (ds.name, ds.num_classes, ds.in_shape, len(ds)) == (name, classes, shape, train_size)
    assert len(open_dataset(name, split="val")) == 2_000  # pipar.txt Table 4
    assert len(open_dataset(name, split="test")) == 8_000
    x, y = ds.batch([0, 5, 5, 2])
    assert x.dtype == torch.float32
    assert x.shape == (4, *shape)
    assert x.is_contiguous()
    assert y.dtype == torch.int64
    assert y.shape == (4,)
    assert torch.equal(x[1], x[2])
    assert y.tolist() == ds.labels()[[0, 5, 5, 2]].tolist()
    assert ((y >= 0) & (y < classes)).all()
    empty_x, empty_y = ds.batch([])
    assert empty_x.shape == (0, *shape)
    assert empty_y.shape == (0,)


@pytest.mark.parametrize("name", ["synthetic-cifar10", "synthetic-mnist"])
def test_roughly_normalized(name: str) -> None:
    x, _ = open_dataset(name, size=500).batch(np.arange(500))
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3))
    assert (mean.abs() < 0.15).all(), mean
    assert ((std > 0.85) & (std < 1.15)).all(), std


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    idx = np.array([0, 1, 17, 999])
    a = open_dataset("synthetic-cifar10", size=1000, seed=3).batch(idx)
    b = open_dataset("synthetic-cifar10", size=1000, seed=3).batch(idx)
    c = open_dataset("synthetic-cifar10", size=1000, seed=4).batch(idx)
    assert a[0].numpy().tobytes() == b[0].numpy().tobytes()
    assert torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    negative = open_dataset("synthetic-cifar10", size=1000, seed=-3).batch(idx)
    assert not torch.equal(a[0], negative[0])


def test_sample_depends_only_on_its_index() -> None:
    small = open_dataset("synthetic-mnist", size=50, seed=1)
    large = open_dataset("synthetic-mnist", size=10_000, seed=1)
    x_alone, y_alone = small.batch([7])
    x_batch, y_batch = large.batch([3, 7, 49])
    assert torch.equal(x_alone[0], x_batch[1])
    assert int(y_alone[0]) == int(y_batch[1])
    assert np.array_equal(small.labels(), large.labels()[:50])


def test_labels_are_balanced_and_shuffled() -> None:
    labels = open_dataset("synthetic-cifar100", size=10_050).labels()
    assert labels.dtype == np.int64
    assert labels.shape == (10_050,)
    counts = np.bincount(labels, minlength=100)
    assert counts.min() >= 100
    assert counts.max() <= 101
    for block in range(0, 10_000, 100):  # every run of num_classes holds each class once
        assert sorted(labels[block : block + 100].tolist()) == list(range(100))
    assert not np.array_equal(labels[:100], labels[100:200])
    assert not np.array_equal(labels[:100], np.arange(100))


def test_splits_are_disjoint_streams_of_the_same_classes() -> None:
    idx = np.arange(300)
    xs = {
        split: open_dataset("synthetic-cifar10", split=split, size=300).batch(idx)[0]
        for split in ("train", "val", "test")
    }
    flat = {split: x.reshape(300, -1) for split, x in xs.items()}
    for a, b in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert torch.cdist(flat[a], flat[b]).min() > 1.0, (a, b)
    train = open_dataset("synthetic-cifar10", split="train", size=300)
    test = open_dataset("synthetic-cifar10", split="test", size=300)
    assert not np.array_equal(train.labels(), test.labels())


def test_a_million_samples_cost_nothing_up_front() -> None:
    tracemalloc.start()
    try:
        ds = open_dataset("synthetic-cifar10", size=1_000_000)
        x, y = ds.batch([999_999])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds) == 1_000_000
    assert x.shape == (1, 3, 32, 32)
    assert peak < 1_000_000  # numpy allocations; 1M CIFAR samples would be 12 GB
    assert int(y[0]) == int(ds.labels()[-1])


def test_repr_names_the_dataset() -> None:
    ds = open_dataset("synthetic-mnist", split="val", size=10, seed=2)
    assert isinstance(ds, SyntheticDataset)
    assert repr(ds) == "SyntheticDataset('synthetic-mnist', split='val', size=10, seed=2)"


@pytest.mark.parametrize("indices", [[10], [-1], np.array([[1]]), np.array([0.5]), ["a"]])
def test_bad_indices_raise_config_error(indices: object) -> None:
    ds = open_dataset("synthetic-mnist", size=10)
    with pytest.raises(ConfigError, match="indices"):
        ds.batch(indices)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "imagenet"}, "unknown 'imagenet'"),
        ({"name": "mnist:"}, "unknown"),
        ({"name": "svhn:/tmp"}, "unknown"),
        ({"name": 3}, "dataset"),
        ({"name": "synthetic-mnist", "split": "validation"}, "split"),
        ({"name": "synthetic-mnist", "size": 0}, "size"),
        ({"name": "synthetic-mnist", "size": True}, "size"),
        ({"name": "synthetic-mnist", "seed": 1.5}, "seed"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        open_dataset(**kwargs)  # type: ignore[arg-type]
