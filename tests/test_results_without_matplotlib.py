"""Without matplotlib (the ``plot`` extra) a run writes no ``timeline.png`` or
``overview.png``, and says so once, with how to get them: ``python -m aiopipe`` after
``pip install -e .`` used to leave them out without a word."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.metrics.results import EpochMetrics, RunResult, write_results
from aiopipe.metrics.trace import Slice

PICTURES = ("timeline.png", "overview.png")


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib cannot be imported (as when it is not installed), submodules too."""
    for name in [n for n in sys.modules if n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _result() -> RunResult:
    epochs = [EpochMetrics(epoch=1, time_s=1.0, busy_s={}, idle_s={}, loss=2.3, accuracy=0.1,
                           train_accuracy=0.1, samples=8, bytes_up=0, bytes_down=0, plan=[])]
    trace = [Slice("device0/compute", "f", 0.0, 0.1, 0, 0, 0),
             Slice("device0/compute", "b", 0.1, 0.3, 0, 0, 0)]
    return RunResult(RunConfig(mode="fl", devices=1, epochs=1), epochs,
                     nn.Sequential(nn.Linear(2, 2)), trace)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]


@pytest.mark.usefixtures("no_matplotlib")
def test_results_without_matplotlib_say_why_there_are_no_pictures_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        path = write_results(_result(), tmp_path)
    [line] = _said(caplog)
    assert line.startswith("no timeline.png or overview.png: drawing them needs matplotlib")
    assert "pip install 'aiopipe[plot]'" in line
    assert 'pip install -e ".[plot]"' in line
    assert "\n" not in line
    assert [r.levelno for r in caplog.records if "matplotlib" in r.getMessage()] == [
        logging.WARNING]
    assert not any((path / name).exists() for name in PICTURES)
    assert (path / "metrics.jsonl").exists()
    assert (path / "model.safetensors").exists()


def test_results_with_matplotlib_draw_and_say_nothing_of_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    with caplog.at_level(logging.WARNING):
        path = write_results(_result(), tmp_path)
    assert _said(caplog) == []
    assert all((path / name).exists() for name in PICTURES)


@pytest.mark.usefixtures("no_matplotlib")
async def test_a_simulation_with_an_out_dir_says_it_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`simulate`, `Server.run` and both commands write results the same way."""
    config = RunConfig(devices=1, samples_per_device=20, batch_size=10, epochs=1,
                       test_samples=10, out_dir=str(tmp_path / "run"))
    with caplog.at_level(logging.WARNING):
        await simulate(config, clock=VirtualClock())
    [line] = _said(caplog)
    assert "pip install 'aiopipe[plot]'" in line
    assert not any((tmp_path / "run" / name).exists() for name in PICTURES)
