"""`SparseCounts`: a sampled population's count per device, kept as its nonzero entries,
reads, compares, copies and writes as the tuple it stands for."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from aiopipe.metrics.epoch import SPARSE_FROM, EpochMetrics, SparseCounts, counts_by_device
from aiopipe.runtime.resume import epoch_from


def _drawn(length: int, drawn: dict[int, int]) -> tuple[int, ...]:
    return tuple(drawn.get(k, 0) for k in range(length))


def test_a_large_population_of_which_few_trained_is_kept_sparse() -> None:
    dense = _drawn(100_000, {7: 20, 99_999: 40})
    counts = counts_by_device(dense)
    assert isinstance(counts, SparseCounts)
    assert counts.nonzero() == {7: 20, 99_999: 40}
    assert counts == dense
    assert dense == counts
    assert list(counts) == list(dense)
    assert len(counts) == 100_000
    assert sum(counts) == 60
    assert counts[7] == 20
    assert counts[-1] == 40
    assert counts[8] == 0
    assert counts[5:9] == (0, 0, 20, 0)
    assert counts[::50_000] == (0, 0)
    assert hash(counts) == hash(dense)
    assert counts != _drawn(100_000, {7: 20})
    assert counts != dense[:-1]
    with pytest.raises(IndexError):
        counts[100_000]
    assert copy.deepcopy(counts) == counts
    assert pickle.loads(pickle.dumps(counts)) == counts


@pytest.mark.parametrize("length", [4, SPARSE_FROM - 1])
def test_a_small_population_stays_a_tuple(length: int) -> None:
    counts = counts_by_device(_drawn(length, {0: 20}))
    assert type(counts) is tuple


def test_a_population_of_which_many_trained_stays_a_tuple() -> None:
    counts = counts_by_device([20] * (SPARSE_FROM // 4) + [0] * SPARSE_FROM)
    assert type(counts) is tuple


def test_an_epoch_with_sparse_counts_writes_and_reads_back() -> None:
    counts = counts_by_device(_drawn(5_000, {3: 20, 4_000: 20}))
    epoch = EpochMetrics(epoch=1, time_s=1.0, busy_s={}, idle_s={}, loss=1.0,
                         accuracy=0.5, train_accuracy=0.5, samples=40, bytes_up=1,
                         bytes_down=1, plan=(), device_samples=counts)
    line = json.loads(json.dumps(epoch.to_mapping()))
    assert line["device_samples"] == list(counts)
    again = epoch_from(line)
    assert isinstance(again.device_samples, SparseCounts)
    assert again.device_samples == epoch.device_samples == counts
