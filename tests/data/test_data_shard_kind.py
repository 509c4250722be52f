"""A shard's kind is its whole dataset's, read once for all the shards cut from it: an
in-process simulation's devices each announce their shard's kind, and 100,000 of them
each rendered a sample to do so."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiopipe.data import open_dataset
from aiopipe.data.kind import kind_of
from aiopipe.data.sources import Shard
from aiopipe.errors import ConfigError
from aiopipe.runtime import compute


class _Counting:
    """A dataset that counts the batches it renders."""

    def __init__(self, whole: Any) -> None:
        self.whole_set, self.batches = whole, 0
        self.name, self.num_classes = whole.name, whole.num_classes

    def __len__(self) -> int:
        return len(self.whole_set)

    def batch(self, indices: Any) -> Any:
        self.batches += 1
        return self.whole_set.batch(indices)

    def labels(self) -> Any:
        return self.whole_set.labels()


def test_the_shards_of_one_dataset_read_its_kind_once() -> None:
    whole = _Counting(open_dataset("synthetic-cifar10", split="train", seed=0, size=200))
    shards = [Shard(whole, np.arange(k, 200, 50)) for k in range(50)]  # type: ignore[arg-type]
    kinds = {kind_of(shard) for shard in shards}
    assert kinds == {kind_of(whole)}  # type: ignore[arg-type]
    assert whole.batches == 2  # once for the shards, once for the whole set itself
    assert next(iter(kinds)).classes == 10


def test_an_empty_shard_is_still_refused() -> None:
    whole = open_dataset("synthetic-cifar10", split="train", seed=0, size=20)
    with pytest.raises(ConfigError, match="no samples"):
        kind_of(Shard(whole, np.arange(0)))


def test_torch_is_warmed_up_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    compute.warm_up_torch()
    made: list[int] = []
    monkeypatch.setattr(compute, "tune_malloc", lambda: made.append(1))
    compute.warm_up_torch()
    assert made == []
