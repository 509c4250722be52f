"""A run's pictures: ``overview.png`` (epoch time, training loss, test accuracy per epoch,
epochs numbered from 1) and ``timeline.png`` in the results directory when matplotlib is
installed, nothing (and no error) when it is not; matplotlib is imported only to draw."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from aiopipe.config import RunConfig
from aiopipe.metrics.results import EpochMetrics, RunResult, write_results
from aiopipe.metrics.trace import Slice

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _epochs(accuracy: list[float], held_out: float = math.nan) -> list[EpochMetrics]:
    return [EpochMetrics(epoch=i + 1, time_s=2.0 - 0.1 * i, busy_s={}, idle_s={},
                         loss=2.3 - 0.2 * i, accuracy=a, train_accuracy=0.1, samples=8,
                         bytes_up=0, bytes_down=0, plan=[], held_out_accuracy=held_out)
            for i, a in enumerate(accuracy)]  # `EpochMetrics.epoch` counts from 1


def _lines(ax: Any) -> list[tuple[list[float], list[float]]]:
    """Each line's points (x, y) where y is a number (NaN leaves a gap)."""
    out = []
    for line in ax.get_lines():
        points = [(x, y) for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
                  if not math.isnan(y)]
        out.append(([x for x, _ in points], [y for _, y in points]))
    return out


def test_overview_has_three_titled_panels_over_epochs_from_one() -> None:
    pytest.importorskip("matplotlib")
    from aiopipe.metrics.timeline import overview_figure

    fig = overview_figure(_epochs([0.2, 0.4, 0.5]), title="pipar, vgg5, 2 devices")
    assert [ax.get_title() for ax in fig.axes] == [
        "epoch time (s)", "training loss", "test accuracy"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["epoch"] * 3
    time, loss, accuracy = (_lines(ax) for ax in fig.axes)
    assert time == [([1, 2, 3], [2.0, 1.9, 1.8])]
    assert [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes] == [
        ["1", "2", "3"]] * 3
    assert [x for x, _ in loss] == [[1, 2, 3]]
    assert accuracy == [([1, 2, 3], [0.2, 0.4, 0.5])]
    assert fig.get_suptitle() == "pipar, vgg5, 2 devices"


def test_overview_without_a_test_set_has_no_accuracy_panel() -> None:
    pytest.importorskip("matplotlib")
    from aiopipe.metrics.timeline import overview_figure

    fig = overview_figure(_epochs([math.nan, math.nan]))
    assert [ax.get_title() for ax in fig.axes] == ["epoch time (s)", "training loss"]


def test_overview_shows_held_out_accuracy_and_skips_missing_points() -> None:
    pytest.importorskip("matplotlib")
    from aiopipe.metrics.timeline import overview_figure

    fig = overview_figure(_epochs([math.nan, 0.3], held_out=0.6))
    accuracy = fig.axes[2]
    assert accuracy.get_title() == "accuracy"
    assert _lines(accuracy) == [([2], [0.3]), ([1, 2], [0.6, 0.6])]
    assert [t.get_text() for t in accuracy.get_legend().get_texts()] == [
        "test set (last 0.300)", "devices' held-out data (last 0.600)"]


def _result(out: Path, accuracy: float) -> RunResult:
    epochs = _epochs([accuracy, accuracy])
    trace = [Slice("device0/downlink", "m", 0.0, 0.01, epoch=0)]
    t = 0.02
    for epoch in range(2):
        for it in range(3):
            trace += [
                Slice("device0/compute", "f", t, t + 0.1, epoch, it, 0),
                Slice("device0/uplink", "u", t + 0.1, t + 0.11, epoch, it, 0),
                Slice("server/compute", "s", t + 0.11, t + 0.2, epoch, it, 0),
                Slice("device0/downlink", "d", t + 0.2, t + 0.21, epoch, it, 0),
                Slice("device0/compute", "b", t + 0.21, t + 0.3, epoch, it, 0),
            ]
            t += 0.35
    return RunResult(RunConfig(devices=1, out_dir=str(out)), epochs,
                     nn.Sequential(nn.Linear(2, 2)), trace)


@pytest.mark.slow
def test_results_directory_has_timeline_and_overview(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = write_results(_result(tmp_path / "run", accuracy=0.5), tmp_path / "run")
    assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "overview.png").read_bytes()[:8] == PNG_MAGIC


def test_results_without_matplotlib_have_no_pictures(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    out = write_results(_result(tmp_path / "run", accuracy=math.nan), tmp_path / "run")
    assert (out / "trace.json").exists()
    assert (out / "metrics.jsonl").exists()
    assert not list(out.glob("*.png"))


def test_matplotlib_is_imported_only_to_draw() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    code = ("import sys, aiopipe.timeline, aiopipe.metrics.timeline, aiopipe.metrics.results; "
            "print(sorted(m for m in sys.modules if m.startswith('matplotlib')))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
