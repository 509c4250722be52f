"""The caption of a run's ``timeline.png`` counts truthfully what its median was taken
over. Devices that drift apart (PiPar's devices each run their own iterations: a slower
one falls behind) share some iterations in time and not others; the caption used to
call them all "device iterations" ("the last epoch's 76 device iterations" for 2
devices x 41 iterations)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiopipe.metrics.timeline import TITLE_CHARS, draw_timeline, representative_window
from aiopipe.metrics.trace import Slice, chrome_trace


def _iteration(k: int, iteration: int, start: float, length: float) -> list[Slice]:
    """Device k's forward, upload, download and backward of one micro-batch."""
    def at(x: float) -> float:
        return start + length * x

    return [Slice(f"device{k}/compute", "f", at(0.0), at(0.3), 0, iteration, 0),
            Slice(f"device{k}/uplink", "u", at(0.3), at(0.4), 0, iteration, 0),
            Slice(f"device{k}/downlink", "d", at(0.6), at(0.7), 0, iteration, 0),
            Slice(f"device{k}/compute", "b", at(0.7), at(1.0), 0, iteration, 0)]


def _caption(slices: list[Slice]) -> str:
    picked = representative_window(chrome_trace(slices))
    assert picked is not None
    return picked[1]


def test_devices_that_drift_apart_are_counted_as_they_ran() -> None:
    """Device 0 takes 1 s an iteration, device 1 1.6 s: their iterations 0 and 1
    overlap in time (one span each, of both devices), iterations 2 and 3 do not (a span
    per device): 6 spans, 4 of one device and 2 of both."""
    slices = [s for i in range(4) for s in _iteration(0, i, 1.0 * i, 1.0)]
    slices += [s for i in range(4) for s in _iteration(1, i, 1.6 * i, 1.6)]
    caption = _caption(slices)
    assert caption.startswith("epoch 1 of 1, ")
    assert "iteration " in caption
    assert caption.endswith("the median duration of the last epoch's 6 iterations: 4 of "
                            "one device alone, 2 of 2 devices at once)"), caption


def test_devices_in_step_share_every_iteration() -> None:
    slices = [s for k in range(2) for i in range(3) for s in _iteration(k, i, 1.0 * i, 0.9)]
    assert _caption(slices).endswith("the median duration of the last epoch's 3 "
                                     "iterations)")


def test_devices_taking_turns_count_device_iterations() -> None:
    slices = [s for k in range(2) for i in range(3)
              for s in _iteration(k, i, 3.0 * k + i, 0.9)]
    caption = _caption(slices)
    assert caption.endswith("the median duration of the last epoch's 6 device iterations)")
    assert ", device " in caption


def test_a_long_title_wraps_instead_of_running_off_the_picture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figure = pytest.importorskip("matplotlib.figure")
    drawn: list[Any] = []
    monkeypatch.setattr(figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    slices = [s for i in range(3) for s in _iteration(0, i, i * 10.0, 8.0 + i)]
    title = "pipar, vgg5, 2 devices: " + "the median duration of the last epoch's " * 6
    draw_timeline(chrome_trace(slices), tmp_path / "t.png", title=title)
    shown = drawn[0].axes[0].get_title()
    assert shown.replace("\n", " ") == title.strip()
    assert "\n" in shown
    assert all(len(line) <= TITLE_CHARS for line in shown.splitlines())
