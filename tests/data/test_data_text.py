"""stdlib-text: byte windows of the standard library's source, their next bytes as
targets, deterministic disjoint splits, labels fit for partitioning, quick to open."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from aiopipe.data import DataKind, Dataset, data_format, kind_of, open_dataset, partition
from aiopipe.data.text import CONTEXT, MAX_BYTES, StdlibText, stdlib_bytes
from aiopipe.errors import ConfigError

NAME = "stdlib-text"


def _open(split: str = "train", size: int | None = None) -> StdlibText:
    data = open_dataset(NAME, split=split, size=size)
    assert isinstance(data, StdlibText)
    return data


def test_it_is_a_dataset_of_byte_windows() -> None:
    data = _open()
    assert isinstance(data, Dataset)
    assert (data.name, data.num_classes, data.in_shape) == (NAME, 256, (64,))
    assert data_format(NAME) == DataKind((("int64", (64,)),), ("int64", (64,)), 256)
    assert kind_of(data) == data_format(NAME)
    assert len(data) > 50_000


def test_batch_shapes_dtypes_and_targets_are_the_next_bytes() -> None:
    data = _open()
    x, y = data.batch([0, 5, len(data) - 1, 5])
    assert x.shape == y.shape == (4, CONTEXT)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous()
    assert y.is_contiguous()
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x[1], x[3])
    assert int(x.min()) >= 0
    assert int(y.max()) < 256
    stream = torch.from_numpy(stdlib_bytes().astype(np.int64))
    for row, start in enumerate(data.offsets[[0, 5, len(data) - 1]].tolist()):
        assert torch.equal(x[row], stream[start:start + CONTEXT])
        assert torch.equal(y[row], stream[start + 1:start + CONTEXT + 1])


def test_consecutive_windows_do_not_overlap() -> None:
    x, y = _open().batch([0, 1])
    assert int(y[0, -1]) == int(x[1, 0])


def test_the_text_is_python_source() -> None:
    x, _ = _open().batch(range(100))
    text = bytes(x.flatten().tolist()).decode("utf-8", errors="replace")
    assert "def " in text
    assert "import " in text
    assert stdlib_bytes().size == MAX_BYTES


def test_two_opens_and_a_fresh_read_give_equal_batches() -> None:
    indices = [0, 17, 1234, 40_000]
    first = _open().batch(indices)
    second = open_dataset(NAME, split="train", seed=99).batch(indices)
    stdlib_bytes.cache_clear()
    third = _open().batch(indices)
    for other in (second, third):
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_splits_are_disjoint_cover_every_window_and_are_about_90_5_5() -> None:
    splits = {split: _open(split).offsets for split in ("train", "val", "test")}
    starts = np.concatenate(list(splits.values()))
    windows = (stdlib_bytes().size - 1) // CONTEXT
    assert np.array_equal(np.sort(starts), np.arange(windows) * CONTEXT)
    for split, share in (("train", 0.9), ("val", 0.05), ("test", 0.05)):
        assert abs(len(splits[split]) / windows - share) < 0.01
        assert np.all(np.diff(splits[split]) > 0)  # in stream order


def test_size_keeps_the_first_windows_of_the_split() -> None:
    small, whole = _open("val", size=10), _open("val")
    assert len(small) == 10
    assert all(torch.equal(a, b) for a, b in zip(small.batch(range(10)),
                                                  whole.batch(range(10)), strict=True))
    assert len(_open("test", size=10**9)) == len(_open("test"))


@pytest.mark.parametrize("index", [-1, 10, 2**40])
def test_an_index_out_of_range_is_a_config_error(index: int) -> None:
    with pytest.raises(ConfigError, match="out of range"):
        _open(size=10).batch([0, index])


@pytest.mark.parametrize(("split", "size"), [("training", None), ("val", 0), ("val", 1.5)])
def test_a_bad_split_or_size_is_a_config_error(split: str, size: int | None) -> None:
    with pytest.raises(ConfigError):
        open_dataset(NAME, split=split, size=size)


def test_labels_are_the_last_target_bytes_and_partition() -> None:
    data = _open(size=500)
    labels = data.labels()
    assert labels.dtype == np.int64
    assert labels.shape == (500,)
    _, y = data.batch(range(500))
    assert np.array_equal(labels, y[:, -1].numpy())
    for scheme in ("iid", "dirichlet"):
        parts = partition(labels, 4, scheme=scheme, seed=0)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(500))


def test_opening_is_quick() -> None:
    stdlib_bytes.cache_clear()
    start = time.perf_counter()
    _open("test")
    assert time.perf_counter() - start < 0.5
