"""How long `Dataset.batch` takes for 100 samples, per dataset, on one torch thread.

Run: .venv/bin/python bench/data_batch.py

Prints, per synthetic dataset: the time to open it (prototypes), to list 1,000,000 labels,
and the median / best time of `batch()` for 100 consecutive and 100 scattered samples;
then the same batch for the CIFAR-10 binary reader on a 10,000-sample file written to a
temporary directory, and `partition` of 50,000 labels among 100 devices, with each batch
time as a ratio to synthetic-cifar10's.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from aiopipe.data import DATASET_NAMES, Dataset, open_dataset, partition

REPEATS = 30


def timed(fn: Callable[[], object], repeats: int = REPEATS) -> tuple[float, float]:
    """(median, best) wall time of ``fn`` in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def batch_times(ds: Dataset) -> tuple[float, float, float]:
    """(median consecutive, best consecutive, median scattered) ms for 100 samples."""
    rng = np.random.default_rng(0)
    scattered = rng.choice(len(ds), 100, replace=False)
    med, best = timed(lambda: ds.batch(np.arange(100)))
    scattered_med, _ = timed(lambda: ds.batch(scattered))
    return med, best, scattered_med


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, numpy {np.__version__}, 1 torch thread, {REPEATS} runs")
    header = (
        f"{'dataset':<26}{'open ms':>9}{'labels(1M) ms':>15}{'batch100 med':>14}"
        f"{'best':>8}{'scattered':>11}{'us/sample':>11}{'vs cifar10':>12}"
    )
    print(header)
    reference = None
    rows: list[tuple[str, float, float, float, float, float]] = []
    for name in DATASET_NAMES:
        start = time.perf_counter()
        ds = open_dataset(name, size=1_000_000)
        opened = (time.perf_counter() - start) * 1e3
        labels_ms, _ = timed(ds.labels, repeats=3)
        med, best, scattered = batch_times(ds)
        rows.append((name, opened, labels_ms, med, best, scattered))
        if name == "synthetic-cifar10":
            reference = med
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(0)
        records = rng.integers(0, 256, (10_000, 3073), dtype=np.uint8)
        records[:, 0] %= 10
        (folder / "test_batch.bin").write_bytes(records.tobytes())
        start = time.perf_counter()
        reader = open_dataset(f"cifar10:{folder}", split="test")
        opened = (time.perf_counter() - start) * 1e3
        med, best, scattered = batch_times(reader)
        rows.append(("cifar10 reader (10k file)", opened, float("nan"), med, best, scattered))
        del reader
    for name, opened, labels_ms, med, best, scattered in rows:
        ratio = med / reference if reference else float("nan")
        print(
            f"{name:<26}{opened:>9.1f}{labels_ms:>15.1f}{med:>14.2f}{best:>8.2f}"
            f"{scattered:>11.2f}{med * 10:>11.1f}{ratio:>11.2f}x"
        )
    labels = open_dataset("synthetic-cifar10").labels()
    for scheme in ("iid", "dirichlet"):
        for per in (None, 500):
            split = functools.partial(
                partition, labels, 100, scheme=scheme, alpha=0.1, samples_per_device=per
            )
            med, _ = timed(split, repeats=5)
            print(f"partition 50,000 labels / 100 devices, {scheme}, cap {per}: {med:.1f} ms")


if __name__ == "__main__":
    main()
