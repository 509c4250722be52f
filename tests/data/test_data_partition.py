"""Partitions among devices, and the per-epoch order of a device's samples."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiopipe.data import epoch_order, open_dataset, partition
from aiopipe.errors import ConfigError

LABELS = open_dataset("synthetic-cifar10", size=10_000).labels()


def label_entropy(labels: npt.NDArray[np.int64], part: npt.NDArray[np.int64]) -> float:
    share = np.bincount(labels[part], minlength=10) / len(part)
    share = share[share > 0]
    return float(-(share * np.log(share)).sum())


def check_disjoint_cover(parts: list[npt.NDArray[np.int64]], pool: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    assert np.array_equal(np.sort(joined), np.arange(pool))  # disjoint and covering
    for part in parts:
        assert np.array_equal(part, np.sort(part))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    classes=st.integers(1, 12),
    devices=st.integers(1, 20),
    scheme=st.sampled_from(["iid", "dirichlet"]),
    alpha=st.sampled_from([0.01, 0.1, 0.5, 1.0, 100.0]),
    capped=st.booleans(),
    seed=st.integers(-5, 5),
)
def test_parts_are_disjoint_cover_and_never_empty(
    n: int, classes: int, devices: int, scheme: str, alpha: float, capped: bool, seed: int
) -> None:
    labels = np.random.default_rng(n).integers(0, classes, n)
    if n < devices:
        with pytest.raises(ConfigError, match="devices"):
            partition(labels, devices, scheme=scheme, alpha=alpha, seed=seed)
        return
    per = n // devices if capped else None
    parts = partition(
        labels, devices, scheme=scheme, alpha=alpha, samples_per_device=per, seed=seed
    )
    assert len(parts) == devices
    check_disjoint_cover(parts, n if per is None else devices * per)
    assert min(len(p) for p in parts) >= 1
    if per is not None:
        assert {len(p) for p in parts} == {per}
    elif scheme == "iid":
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_cap_uses_the_first_samples() -> None:
    for scheme in ("iid", "dirichlet"):
        parts = partition(LABELS, 8, scheme=scheme, samples_per_device=250, seed=1)
        check_disjoint_cover(parts, 2_000)
        assert [len(p) for p in parts] == [250] * 8


def test_iid_label_proportions_match_the_global_ones() -> None:
    parts = partition(LABELS, 10, seed=0)
    overall = np.bincount(LABELS, minlength=10) / len(LABELS)
    for part in parts:
        share = np.bincount(LABELS[part], minlength=10) / len(part)
        assert np.abs(share - overall).max() < 0.04


@pytest.mark.parametrize("capped", [False, True])
def test_dirichlet_skew_grows_as_alpha_shrinks(capped: bool) -> None:
    per = 500 if capped else None
    entropy = {}
    for alpha in (0.1, 1.0, 100.0):
        parts = partition(
            LABELS, 20, scheme="dirichlet", alpha=alpha, samples_per_device=per, seed=3
        )
        entropy[alpha] = np.mean([label_entropy(LABELS, p) for p in parts])
    assert entropy[0.1] < entropy[1.0] < entropy[100.0]
    assert entropy[0.1] < 0.6 * np.log(10)
    assert entropy[100.0] > 0.95 * np.log(10)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_deterministic_by_seed(scheme: str) -> None:
    a = partition(LABELS, 7, scheme=scheme, seed=11)
    b = partition(LABELS, 7, scheme=scheme, seed=11)
    c = partition(LABELS, 7, scheme=scheme, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_extreme_skew_still_leaves_no_device_empty() -> None:
    labels = np.repeat(np.arange(2), 60)  # 2 classes over 100 devices
    parts = partition(labels, 100, scheme="dirichlet", alpha=0.001, seed=0)
    assert min(len(p) for p in parts) == 1
    check_disjoint_cover(parts, 120)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 0}, "devices"),
        ({"devices": 2.0}, "devices"),
        ({"devices": True}, "devices"),
        ({"scheme": "shards"}, "scheme"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"alpha": "1"}, "alpha"),
        ({"samples_per_device": 0}, "samples_per_device"),
        ({"samples_per_device": 2_001}, "samples_per_device"),
        ({"seed": 0.5}, "seed"),
        ({"labels": [0, 1, 2]}, "labels"),
        ({"labels": np.zeros((4, 1), dtype=np.int64)}, "labels"),
        ({"labels": np.array([0.5, 1.0])}, "labels"),
        ({"labels": np.array([0, -1])}, "labels"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"labels": LABELS[:10_000], "devices": 5} | kwargs
    with pytest.raises(ConfigError, match=match):
        partition(**args)  # type: ignore[arg-type]


def test_epoch_order_is_a_deterministic_shuffle_per_epoch() -> None:
    indices = np.arange(100, 200)
    first = epoch_order(indices, epoch=0, seed=1)
    assert first.dtype == np.int64
    assert np.array_equal(np.sort(first), indices)
    assert not np.array_equal(first, indices)
    assert np.array_equal(first, epoch_order(indices, epoch=0, seed=1))
    assert not np.array_equal(first, epoch_order(indices, epoch=1, seed=1))
    assert not np.array_equal(first, epoch_order(indices, epoch=0, seed=2))
    assert np.array_equal(indices, np.arange(100, 200))  # the input is not shuffled in place
    assert epoch_order(np.array([], dtype=np.int64), epoch=3, seed=0).size == 0


@pytest.mark.parametrize(
    ("indices", "epoch", "seed", "match"),
    [
        (np.zeros((2, 2), dtype=np.int64), 0, 0, "indices"),
        (np.array([0.5]), 0, 0, "indices"),
        (np.arange(3), -1, 0, "epoch"),
        (np.arange(3), 1.0, 0, "epoch"),
        (np.arange(3), 0, "x", "seed"),
    ],
)
def test_epoch_order_rejects_bad_arguments(
    indices: npt.NDArray[np.int64], epoch: int, seed: int, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        epoch_order(indices, epoch=epoch, seed=seed)
