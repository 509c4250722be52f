"""A synchronous pipeline goes on without a lost stage (docs/design.md, "The synchronous
pipeline"), in virtual time with the testing kit: the round in which a device died is
played again from its start by the devices still there, the model re-partitioned among
them, from the weights and momentum the coordinator holds for the round. Only that
round's work is lost: the run ends with the weights of unsplit training, every epoch with
each of its samples once. Device 0 holds the data: without it the run ends."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fleet import suite_fleet
from test_runtime_pipeline import BATCH, _config, _reference

from aiopipe import RunResult, TrainingError, VirtualClock
from aiopipe.testing import Fleet
from aiopipe.transport.fabric import MemoryFabric

ITERATIONS = 8
CONFIG = _config(3, "1f1b", 2, epochs=3, samples_per_device=ITERATIONS * BATCH,
                 heartbeat_interval=0.5, device_timeout=2.0, reconnect_grace=1.0)
#: seconds into epoch 2's round when a device is killed: after a few of its iterations
INTO = 1.0


async def _train(killed: int | None) -> tuple[RunResult | BaseException, Fleet]:
    """Train `CONFIG` on three devices (``killed`` killed `INTO` virtual seconds into
    epoch 2's round); the result, or what training raised."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, clock, tasks, fabric=MemoryFabric(clock))
        for k in range(3):
            fleet.start_device(k)

        async def train() -> RunResult | BaseException:
            try:
                return await fleet.node.train()
            except TrainingError as exc:
                return exc

        training = tasks.create_task(train())
        if killed is not None:
            await fleet.until(lambda: fleet.node.rounds == 2 and fleet.node.epoch == 1)
            await clock.sleep(INTO)
            fleet.kill(killed)
        result = await training
    await clock.aclose()
    assert not fleet.crashes
    return result, fleet


def _iterations_done(result: RunResult, epoch: int, seconds: float) -> int:
    """Iterations of ``epoch`` whose backwards device 0 had finished ``seconds`` into the
    epoch's round (its last micro-batch's backward ends its iteration)."""
    backwards = sorted(s.end for s in result.trace if s.track == "device0/compute"
                       and s.name == "b" and s.epoch == epoch)
    start = min(s.start for s in result.trace if s.epoch == epoch
                and s.track.startswith("device"))
    n = CONFIG.parallel_batches
    assert isinstance(n, int)
    return sum(end <= start + seconds for end in backwards[n - 1::n])


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 2])
async def test_a_stage_killed_mid_round_costs_only_that_round(killed: int) -> None:
    """A middle stage, or the last, killed a few iterations into epoch 2: that round is
    played again from its start on devices 0 and the one left (two stages, re-cut), and
    the run ends as undisturbed training does."""
    undisturbed, _ = await _train(None)
    assert isinstance(undisturbed, RunResult)
    # the kill falls mid-round: after some of epoch 2's iterations, before its last
    assert 0 < _iterations_done(undisturbed, 1, INTO) < ITERATIONS
    result, fleet = await _train(killed)
    assert isinstance(result, RunResult), result
    left = [k for k in range(3) if k != killed]
    [recovery] = [c for e in result.epochs for c in e.changes]
    assert recovery["lost"] == [killed]
    assert recovery["workers"] == left
    assert recovery["workers_before"] == [0, 1, 2]
    assert recovery["before"] == [1, 3]
    assert len(recovery["after"]) == 1  # two stages now
    assert recovery["iterations"] == [0, ITERATIONS]  # the round again, from its start
    assert (recovery["epoch"], recovery["round"]) == (2, 2)  # counted from 1, as the log
    assert recovery["replayed_as"] == 3
    # given up reconnect_grace after its link broke; played again at once
    assert 0 <= recovery["resumed_s"] - recovery["noticed_s"] <= CONFIG.reconnect_grace + 0.6
    first, second, third = result.epochs
    assert second.changes == (recovery,)
    assert second.devices_lost == (killed,)
    # each epoch's samples once: the replay's, not the abandoned attempt's too
    assert [e.samples for e in result.epochs] == [ITERATIONS * BATCH] * 3
    assert [e.device_samples[0] for e in result.epochs] == [ITERATIONS * BATCH] * 3
    assert [p["device"] for p in second.plan] == [p["device"] for p in third.plan] == left
    assert [k for k, outcomes in fleet.outcomes.items() if outcomes == ["killed"]] == [killed]
    # the epoch before is the undisturbed run's; the lost round's work is all that was
    # lost: the run ends with unsplit training's weights (momentum carried exactly)
    assert (first.loss, first.accuracy, first.time_s) == (
        undisturbed.epochs[0].loss, undisturbed.epochs[0].accuracy,
        undisturbed.epochs[0].time_s)
    want = _reference(CONFIG, iterations=ITERATIONS).state_dict()
    for key, value in result.model.state_dict().items():
        difference = (value - want[key]).norm() / want[key].norm()
        assert difference <= 1e-5, f"{key}: relative difference {difference:.2e}"
    got, unsplit = result.model.state_dict(), undisturbed.model.state_dict()
    assert all(torch.allclose(got[k], unsplit[k], rtol=1e-5, atol=1e-7) for k in got)


async def test_without_device_0_the_pipeline_ends_naming_it() -> None:
    result, _ = await _train(0)
    assert isinstance(result, TrainingError)
    assert "device 0 is gone: it holds the data" in str(result)
