"""The progress display of the commands (aiopipe/progress.py) and what it reads of the
coordinator (`Coordinator.epoch_progress`): a bar on a terminal, nothing but the table's
rows elsewhere."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

import pytest
from fleet import suite_fleet
from test_runtime_faults import CONFIG

from aiopipe import RunConfig, VirtualClock
from aiopipe.progress import RunDisplay


def test_without_a_terminal_only_rows_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    display = RunDisplay(stream)
    assert not display.enabled
    display.row("    1     0.50  2.3000")
    assert capsys.readouterr().out == "    1     0.50  2.3000\n"
    assert stream.getvalue() == ""


async def test_on_a_terminal_the_bar_follows_joining_planning_and_the_epoch() -> None:
    stream = io.StringIO()
    display = RunDisplay(stream, enabled=True)
    node = SimpleNamespace(config=RunConfig(devices=2, epochs=3), announced={0: None},
                           prepared=False, epoch=-1, epoch_progress=lambda: (0, 0))
    async with display.following(node):  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        node.announced[1] = None
        await asyncio.sleep(0.3)
        node.prepared, node.epoch = True, 1
        node.epoch_progress = lambda: (5, 10)
        await asyncio.sleep(0.3)
        display.row("row above the bar")
    drawn = stream.getvalue()
    assert "waiting for devices (1/2 joined)" in drawn
    assert "planning" in drawn
    assert "epoch 2/3" in drawn
    assert "5/10" in drawn


async def test_epoch_progress_counts_the_servers_micro_batches() -> None:
    clock = VirtualClock()
    seen: list[tuple[int, int]] = []
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, clock, tasks)
        assert fleet.node.epoch_progress() == (0, 0)  # before planning
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.activations_in(1, 2) > 1)  # epoch 1, round 2
        seen.append(fleet.node.epoch_progress())
        await training
        seen.append(fleet.node.epoch_progress())
    await clock.aclose()
    # 3 devices x 4 iterations x 2 micro-batches; the second round was under way
    (done, total), end = seen
    assert total == 24
    assert 8 < done < 24
    assert end == (24, 24)
