"""aiopipe.wording: counts with the right plural ("1 epoch", not "1 epochs") and id
ranges; and the lines that use them."""

from __future__ import annotations

import logging

import pytest

from aiopipe import VirtualClock, simulate
from aiopipe.__main__ import _run_line
from aiopipe.config import RunConfig
from aiopipe.wording import id_ranges, plural


@pytest.mark.parametrize(("count", "word", "many", "want"), [
    (1, "epoch", None, "1 epoch"),
    (0, "epoch", None, "0 epochs"),
    (2, "device", None, "2 devices"),
    (1, "batch", None, "1 batch"),
    (3, "batch", None, "3 batches"),
    (4, "micro-batch", None, "4 micro-batches"),
    (2, "child", "children", "2 children"),
])
def test_plural(count: int, word: str, many: str | None, want: str) -> None:
    assert plural(count, word, many) == want


def test_id_ranges_are_sorted_runs() -> None:
    assert id_ranges([7, 0, 2, 1, 5, 8]) == "0-2, 5, 7-8"
    assert id_ranges([3]) == "3"
    assert id_ranges([]) == ""


def test_the_launchers_first_line_counts_one_device_and_one_epoch_right() -> None:
    """``python -m aiopipe --devices 1 --epochs 1`` used to print "1 devices" and "1
    epochs"."""
    line = _run_line(RunConfig(mode="fl", devices=1, epochs=1, samples_per_device=100))
    assert "| 1 device x 100 samples | 1 epoch |" in line
    line = _run_line(RunConfig(devices=2, epochs=3))
    assert "| 2 devices x 2000 samples | 3 epochs |" in line


async def test_a_run_of_one_device_and_one_epoch_logs_them_in_the_singular(
        caplog: pytest.LogCaptureFixture) -> None:
    config = RunConfig(mode="fl", devices=1, samples_per_device=20, batch_size=10, epochs=1,
                       test_samples=0)
    with caplog.at_level(logging.INFO):
        await simulate(config, clock=VirtualClock())
    said = [r.getMessage() for r in caplog.records]
    assert "device 0: joined a fl run of 1 device, 1 epoch" in said
    assert "device 0 joined: 20 samples" in said
