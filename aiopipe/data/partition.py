"""Which samples each device holds (`partition`), and in which order it visits them
(`epoch_order`). Both are pure functions of their arguments and the seed.

Dirichlet label skew, as in Hsu et al. (2019): for every class, the shares of its
samples across the devices are drawn from Dirichlet(alpha, ..., alpha); a small alpha
puts most of a class on few devices, a large alpha approaches IID. When every device
must hold exactly ``samples_per_device`` samples, the drawn class-by-device share matrix
is first rescaled by iterative proportional fitting (Sinkhorn) so that its row sums are
the class counts and its column sums the device sizes: this keeps the draw's skew (its
cross-ratios) while meeting both constraints, then it is rounded to whole samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from aiopipe.data.dataset import check_seed, seed_words
from aiopipe.errors import ConfigError
from aiopipe.wording import plural

__all__ = ["SCHEMES", "epoch_order", "partition"]

SCHEMES: Final = ("dirichlet", "iid")
"""The partition schemes `partition` accepts."""

_TAG_PARTITION: Final = 0x70617274
_TAG_ORDER: Final = 0x6F726465
_FLOOR: Final = 1e-6  # keeps every drawn share positive, so the rescaling always converges
_FIT_TOLERANCE: Final = 1e-3  # samples; anything below 1 keeps the rounding exact
_FIT_ROUNDS: Final = 10_000


def partition(
    labels: npt.NDArray[np.integer],
    devices: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    samples_per_device: int | Sequence[int] | None = None,
    seed: int = 0,
) -> list[npt.NDArray[np.int64]]:
    """Split sample indices ``0..len(labels)-1`` among ``devices`` devices.

    Returns one sorted int64 index array per device; the arrays are disjoint and together
    cover every sample, or, with ``samples_per_device`` (one number, or one per device),
    exactly the first ``sum`` of them, each device then holding exactly its number of
    them. ``"iid"``: a shuffled split (without ``samples_per_device``, sizes differ by at
    most one). ``"dirichlet"``: label skew with concentration ``alpha`` (see the module
    docstring); without ``samples_per_device`` the sizes vary, but no device is left
    empty. The same arguments always give the same result.

    Raises:
        ConfigError: ``labels`` is not a 1-D array of non-negative integers, ``devices``
            or ``samples_per_device`` is not a positive integer, ``scheme`` is unknown,
            ``alpha`` is not a positive finite number, ``seed`` is not an integer, or
            there are fewer samples than the devices need.
    """
    labels = _check_labels(labels)
    devices = _positive_int("devices", devices)
    if scheme not in SCHEMES:
        raise ConfigError(f"scheme: expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float | np.integer | np.floating)
        or not (math.isfinite(alpha) and alpha > 0)
    ):
        raise ConfigError(f"alpha: expected a positive finite number, got {alpha!r}")
    seed = check_seed(seed)
    sizes = None if samples_per_device is None else _sizes(samples_per_device, devices)
    pool = len(labels) if sizes is None else int(sizes.sum())
    if pool > len(labels):
        raise ConfigError(
            f"samples_per_device: {plural(devices, 'device')} x {samples_per_device} samples need "
            f"{pool} samples, but the dataset has {len(labels)}"
        )
    if pool < devices:
        raise ConfigError(f"devices: {plural(devices, 'device')} but only "
                          f"{plural(pool, 'sample')} to share")
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([_TAG_PARTITION, *seed_words(seed)]))
    )
    if scheme == "iid":
        order = rng.permutation(pool)
        parts = (np.array_split(order, devices) if sizes is None
                 else np.split(order, np.cumsum(sizes)[:-1]))
        return [np.sort(part).astype(np.int64) for part in parts]
    return _dirichlet(labels[:pool], devices, float(alpha), sizes, rng)


def _sizes(samples_per_device: int | Sequence[int], devices: int) -> npt.NDArray[np.int64]:
    """Each device's number of samples.

    Raises:
        ConfigError: not one positive integer, or one per device.
    """
    if isinstance(samples_per_device, Sequence):
        if len(samples_per_device) != devices:
            raise ConfigError(f"samples_per_device: expected {devices} numbers (one per "
                              f"device), got {len(samples_per_device)}")
        values = [_positive_int("samples_per_device", v) for v in samples_per_device]
    else:
        values = [_positive_int("samples_per_device", samples_per_device)] * devices
    return np.asarray(values, dtype=np.int64)


def epoch_order(
    indices: npt.NDArray[np.integer], *, epoch: int, seed: int
) -> npt.NDArray[np.int64]:
    """``indices`` shuffled for epoch ``epoch``: the same (epoch, seed) gives the same order.

    The shuffle depends only on (epoch, seed, len(indices)), not on the values.

    Raises:
        ConfigError: ``indices`` is not a 1-D integer array, ``epoch`` is not a
            non-negative integer, or ``seed`` is not an integer.
    """
    array = np.asarray(indices)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ConfigError(f"indices: expected a 1-D integer array, got {array.dtype} {array.shape}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ConfigError(f"epoch: expected a non-negative integer, got {epoch!r}")
    seed = check_seed(seed)
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([_TAG_ORDER, *seed_words(seed), epoch]))
    )
    return array.astype(np.int64)[rng.permutation(array.size)]


def _dirichlet(
    labels: npt.NDArray[np.int64],
    devices: int,
    alpha: float,
    sizes: npt.NDArray[np.int64] | None,
    rng: np.random.Generator,
) -> list[npt.NDArray[np.int64]]:
    """The Dirichlet label-skew split of ``labels`` (see `partition`)."""
    classes, class_counts = np.unique(labels, return_counts=True)
    shares = rng.dirichlet(np.full(devices, alpha), size=len(classes))
    shares = np.nan_to_num(shares, nan=0.0) + _FLOOR
    shares /= shares.sum(axis=1, keepdims=True)
    if sizes is None:
        counts = _round_rows(shares * class_counts[:, None], class_counts)
        _fill_empty(counts)
    else:
        target = _fit_margins(shares * class_counts[:, None], class_counts, sizes)
        counts = _round_both(target, class_counts, sizes)
    parts: list[list[npt.NDArray[np.int64]]] = [[] for _ in range(devices)]
    for row, cls in enumerate(classes):
        members = rng.permutation(np.flatnonzero(labels == cls))
        for device, chunk in enumerate(np.split(members, np.cumsum(counts[row])[:-1])):
            parts[device].append(chunk)
    return [np.sort(np.concatenate(chunks)).astype(np.int64) for chunks in parts]


def _round_rows(
    target: npt.NDArray[np.float64], row_sums: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Round each row of ``target`` to integers summing to ``row_sums`` (largest remainder)."""
    counts = np.floor(target).astype(np.int64)
    for row in range(len(counts)):
        short = int(row_sums[row] - counts[row].sum())
        order = np.argsort(-(target[row] - counts[row]), kind="stable")
        counts[row, order[:short]] += 1
    return counts


def _fill_empty(counts: npt.NDArray[np.int64]) -> None:
    """Give every empty device one sample from the device holding the most (in place)."""
    for device in np.flatnonzero(counts.sum(axis=0) == 0).tolist():
        donor = int(np.argmax(counts.sum(axis=0)))
        row = int(np.argmax(counts[:, donor]))
        counts[row, donor] -= 1
        counts[row, device] += 1


def _fit_margins(
    target: npt.NDArray[np.float64],
    row_sums: npt.NDArray[np.int64],
    col_sums: npt.NDArray[np.int64],
) -> npt.NDArray[np.float64]:
    """Rescale the positive matrix ``target`` to the given row and column sums (IPF)."""
    fitted = target.copy()
    for _ in range(_FIT_ROUNDS):
        fitted *= (col_sums / fitted.sum(axis=0))[None, :]
        fitted *= (row_sums / fitted.sum(axis=1))[:, None]
        if np.abs(fitted.sum(axis=0) - col_sums).max() < _FIT_TOLERANCE:
            break
    return fitted


def _round_both(
    target: npt.NDArray[np.float64],
    row_sums: npt.NDArray[np.int64],
    col_sums: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64]:
    """Round ``target`` to integers with exactly the given row and column sums.

    Floors every cell, then hands each row's missing units to the columns that still miss
    some, largest fractional part first. Column sums of the floors never exceed
    ``col_sums`` while ``target``'s column sums are within 1 of them.
    """
    counts = np.floor(target).astype(np.int64)
    fraction = target - counts
    col_short = col_sums - counts.sum(axis=0)
    # A target fitted less closely than 1 sample would leave a column over-full: move the
    # surplus back to the rows it came from before the main pass.
    for col in np.flatnonzero(col_short < 0).tolist():
        while col_short[col] < 0:
            row = int(np.argmax(counts[:, col]))
            counts[row, col] -= 1
            col_short[col] += 1
    for row in range(len(counts)):
        short = int(row_sums[row] - counts[row].sum())
        while short > 0:
            open_cols = np.flatnonzero(col_short > 0)
            best = open_cols[np.argsort(-fraction[row, open_cols], kind="stable")][:short]
            counts[row, best] += 1
            col_short[best] -= 1
            short -= len(best)
    return counts


def _check_labels(labels: object) -> npt.NDArray[np.int64]:
    """``labels`` as a 1-D int64 array.

    Raises:
        ConfigError: it is not a 1-D array of non-negative integers.
    """
    if not isinstance(labels, np.ndarray) or labels.ndim != 1:
        raise ConfigError("labels: expected a 1-D numpy array")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(f"labels: expected integers, got {labels.dtype}")
    out = labels.astype(np.int64)
    if out.size and int(out.min()) < 0:
        raise ConfigError(f"labels: expected non-negative integers, got {int(out.min())}")
    return out


def _positive_int(what: str, value: object) -> int:
    """``value`` if it is a positive integer.

    Raises:
        ConfigError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)
