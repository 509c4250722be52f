"""Devices fail and come back (DESIGN §7), in virtual time: a lost device's unfinished
round is excluded from aggregation, the others go on, and a device that returns with its
id is given the latest global model and contributes again from the next round. A device
whose link broke has ``reconnect_grace`` to come back and keep its round; a silent link is
given up after ``device_timeout``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path

import orjson
import pytest
import torch
from fleet import COSTS, NETWORK, suite_fleet, vgg5_shaped

from aiopipe import RunConfig, TrainingError, VirtualClock, simulate
from aiopipe.config import MODES
from aiopipe.errors import ConfigError
from aiopipe.protocol import PROTOCOL_VERSION, Hello, Plan, decode, encode
from aiopipe.runtime.checkpoint import load_checkpoint
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import DeviceSummary
from aiopipe.runtime.systems.registry import options_of
from aiopipe.testing import Fleet, ready_for

# 3 devices x 80 samples, B=20: 4 iterations per epoch, 2 rounds of 2 iterations; a
# stand-in for vgg5 (its bytes on the wire, a tenth of its compute)
CONFIG = RunConfig(mode="pipar", model=vgg5_shaped, devices=3, samples_per_device=80,
                   batch_size=20, epochs=3, split_point=2, parallel_batches=2,
                   aggregation_every=2, test_samples=20, network=NETWORK,
                   heartbeat_interval=1.0, device_timeout=10.0, reconnect_grace=10.0)


def start_of(fleet: Fleet) -> float:
    """When the current round's device-2 session lost its link (approximately)."""
    return fleet.node.sessions[2].liveness.last_heard


async def test_a_killed_device_is_excluded_and_a_restarted_one_rejoins() -> None:
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        # kill device 2 in the middle of round 4 (epoch 2's second round)
        await fleet.until(lambda: fleet.node.rounds == 4 and fleet.activations_in(2, 4) > 0)
        fleet.kill(2)
        # it stays away longer than reconnect_grace: the server gives up on it
        await fleet.until(lambda: fleet.node.sessions[2].ended)
        assert clock.now() - start_of(fleet) >= CONFIG.reconnect_grace
        fleet.start_device(2)  # restarted, it says hello again
        result = await training
    await clock.aclose()
    epochs = result.epochs
    # epoch 2: device 2's second round (round 4) was excluded; it came back after round
    # 5 had started, so it contributes again from round 6 (epoch 3's second round)
    assert [e.device_samples for e in epochs] == [(80, 80, 80), (80, 80, 40), (80, 80, 40)]
    assert [e.devices_lost for e in epochs] == [(), (2,), ()]
    assert [e.samples for e in epochs] == [240, 200, 200]
    killed, rejoined = fleet.outcomes[2]
    assert killed == "killed"
    assert isinstance(rejoined, DeviceSummary)
    assert rejoined.rounds == 1
    for value in result.model.state_dict().values():
        assert torch.isfinite(value).all()


async def test_a_restarted_device_drops_its_round_and_rejoins_at_the_next() -> None:
    """A device process killed mid-round and started again at once: the new process knows
    nothing of the round (its Hello names no session), so that round goes on without it
    and it takes part again from the next round; nothing is counted twice."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 4 and fleet.activations_in(2, 4) > 0)
        fleet.kill(2)
        fleet.start_device(2)  # a fresh process with the same id, within reconnect_grace
        result = await training
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80), (80, 80, 40),
                                                        (80, 80, 80)]
    assert [e.devices_lost for e in result.epochs] == [(), (2,), ()]


async def test_a_silent_device_is_declared_lost_after_timeout_and_grace() -> None:
    # vgg5: the scripted device's Ready (`ready_for`) builds the model the plan's config
    # names, and a factory's plan names only "custom"
    config = CONFIG.replace(model="vgg5", devices=2, epochs=1, aggregation_every=0,
                            reconnect_grace=4.0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        fleet.start_device(0)
        silent, _ = fleet.connect()  # a device that never speaks after it joined
        await silent.send(encode(Hello(PROTOCOL_VERSION, 1)))
        plan = decode(await silent.receive())
        assert isinstance(plan, Plan)
        await silent.send(encode(ready_for(plan, config.device_samples_of(1))))
        start = clock.now()
        result = await fleet.node.train()  # device 1 never says anything again
    await clock.aclose()
    assert result.final.devices_lost == (1,)
    assert result.final.device_samples == (80, 0)
    # silence for device_timeout ends the connection, then reconnect_grace passes: the
    # server gave up on device 1 then, not later, and not forever
    patience = config.device_timeout + config.reconnect_grace
    assert patience - 1 <= result.final.time_s <= patience + 5
    assert clock.now() - start < 60


async def test_a_device_that_does_not_come_back_is_left_out_after_the_grace() -> None:
    """A broken link (noticed at once) costs reconnect_grace, not device_timeout: then the
    round goes on without the device and completes with the others."""
    config = CONFIG.replace(device_timeout=10.0, reconnect_grace=2.0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 4 and fleet.activations_in(2, 4) > 0)
        fleet.kill(2)  # and it never comes back
        killed_at = clock.now()
        await fleet.until(lambda: fleet.node.sessions[2].ended)
        lost_after = clock.now() - killed_at
        # the others finish round 4 without it, shortly after
        await fleet.until(lambda: fleet.node.rounds == 5)
        round_over_after = clock.now() - killed_at
        result = await training
    await clock.aclose()
    # (the grace starts once the server has finished the device's queued activations:
    # a few tenths of a second of compute here)
    assert config.reconnect_grace <= lost_after <= config.reconnect_grace + 0.5
    assert round_over_after < config.reconnect_grace + 1.0 < config.device_timeout
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80), (80, 80, 40),
                                                        (80, 80, 0)]
    # absent the whole last epoch: lost in it too (issue 41)
    assert [e.devices_lost for e in result.epochs] == [(), (2,), (2,)]
    assert fleet.outcomes[2] == ["killed"]


@pytest.mark.slow
async def test_a_device_back_within_the_grace_keeps_its_round() -> None:
    """Device 1's link breaks mid-round and the server is unreachable for it for longer
    than device_timeout but less than reconnect_grace: it reconnects with its session,
    finishes its round, and nothing is lost or counted twice."""
    config = CONFIG.replace(device_timeout=2.0, heartbeat_interval=0.5, reconnect_grace=8.0)
    away = 3.0  # > device_timeout; with the backoff, back well within reconnect_grace
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 4 and fleet.activations_in(1, 4) > 1)
        fleet.block(1, away)
        fleet.cut(1)
        cut_at, session = clock.now(), fleet.node.sessions[1]
        await fleet.until(lambda: 1 not in fleet.node.connected)
        await fleet.until(lambda: 1 in fleet.node.connected or session.ended)
        back_after = clock.now() - cut_at
        result = await training
    await clock.aclose()
    assert away <= back_after < config.reconnect_grace
    assert fleet.node.sessions[1] is session  # the same session: its round went on
    assert not session.ended or session.closing
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)] * 3
    assert [e.devices_lost for e in result.epochs] == [(), (), ()]
    (summary,) = fleet.outcomes[1]
    assert isinstance(summary, DeviceSummary)
    assert summary.rounds == 6
    undisturbed = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    got, want = result.model.state_dict(), undisturbed.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
async def test_a_device_back_after_the_grace_rejoins_at_a_later_round() -> None:
    """Back later than reconnect_grace, with its old session: the server had given up on
    it, so the device starts afresh and contributes again from a later round."""
    # epochs of 2.5 virtual seconds, rounds of 1.25
    config = CONFIG.replace(epochs=4, device_timeout=4.0, heartbeat_interval=0.5,
                            reconnect_grace=1.0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 4 and fleet.activations_in(1, 4) > 1)
        fleet.block(1, 2.0)  # > reconnect_grace, well within the device's patience
        fleet.cut(1)
        cut_at, old = clock.now(), fleet.node.sessions[1]
        await fleet.until(lambda: old.ended, within=10)
        lost_after = clock.now() - cut_at
        await fleet.until(lambda: fleet.node.sessions[1] is not old, within=10)
        back_after = clock.now() - cut_at
        result = await training
    await clock.aclose()
    assert lost_after < 2.0 <= back_after
    # absent the whole third epoch (0 samples): lost in it too (issue 41)
    assert [e.devices_lost for e in result.epochs] == [(), (1,), (1,), ()]
    assert [e.device_samples[0] for e in result.epochs] == [80] * 4
    assert result.epochs[1].device_samples[1] == 40  # round 4 was dropped
    assert result.epochs[2].device_samples[1] == 0
    # it took part again: back at 6.78 s (its backoff), in the last epoch's second round
    # (the grace runs from the break, at 3.79 s: lost at 4.79 s)
    assert result.epochs[-1].device_samples[1] == 40
    (summary,) = fleet.outcomes[1]  # one process throughout: it never failed
    assert isinstance(summary, DeviceSummary)
    assert summary.reason == "training finished"


async def test_the_run_fails_when_every_device_is_gone_for_good() -> None:
    config = CONFIG.replace(devices=1, epochs=2, aggregation_every=0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        fleet.node.join_timeout = 30.0
        fleet.start_device(0)

        async def kill() -> None:
            await fleet.until(lambda: fleet.activations_in(0, 1) > 0)
            fleet.kill(0)

        tasks.create_task(kill())
        with pytest.raises(TrainingError, match="none rejoined within 30 s"):
            await fleet.node.train()
    await clock.aclose()


@pytest.mark.slow  # (about 2 s)
async def test_a_cut_link_is_repaired_and_nothing_is_lost_or_counted_twice() -> None:
    """Cut device 1's link three times mid-round; it reconnects by itself each time. The
    run computes exactly what an undisturbed run computes."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        for round_no in (2, 4, 5):
            await fleet.until(lambda r=round_no: fleet.activations_in(1, r) > 1)  # type: ignore[misc]
            fleet.cut(1)
        result = await training
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)] * 3
    assert [e.devices_lost for e in result.epochs] == [(), (), ()]
    (summary,) = fleet.outcomes[1]
    assert isinstance(summary, DeviceSummary)
    assert summary.rounds == 6
    undisturbed = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    for cut, clean in zip(result.epochs, undisturbed.epochs, strict=True):
        # byte counts span the connections (what was re-sent comes on top)
        assert clean.bytes_up <= cut.bytes_up < 2 * clean.bytes_up
        assert clean.bytes_down <= cut.bytes_down < 2 * clean.bytes_down
    got, want = result.model.state_dict(), undisturbed.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
async def test_a_restarted_server_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Kill the server mid-epoch; a new server resumes from the last round checkpoint,
    the devices reconnect by themselves, and every epoch sees exactly its samples: the
    final model equals an uninterrupted run's, bit for bit, momentum and all (the
    devices start the redone round from their optimizers' state at its start, [Note: a
    redone round])."""
    config = CONFIG
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        fleet.node.checkpoints.directory = tmp_path
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        # the server dies in the middle of round 4 (epoch 2's second round), once device
        # 2 has stepped in it (its second iteration's activations have come)
        await fleet.until(lambda: fleet.node.rounds == 4 and fleet.activations_in(2, 4) > 2)
        training.cancel()
        for k in range(3):
            fleet.device_links[k].break_("the server process died")
        with contextlib.suppress(asyncio.CancelledError):
            await training
        assert load_checkpoint(tmp_path)[1]["rounds"] == 3  # rounds 0-2; 3 runs again
        fleet.node = Coordinator(config, clock=clock, cost_table=COSTS, checkpoint_dir=tmp_path,
                                resume=True)
        result = await fleet.node.train()
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)] * 3
    assert [e.devices_lost for e in result.epochs] == [(), (), ()]
    undisturbed = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert [e.loss for e in result.epochs] == [e.loss for e in undisturbed.epochs]
    got, want = result.model.state_dict(), undisturbed.model.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key


async def test_an_upload_longer_than_the_timeout_is_not_taken_for_silence() -> None:
    # FL: each device uploads vgg5 (2.3 MB) at 0.5 Mbit/s, about 37 s in one frame,
    # during which no heartbeat can pass; device_timeout is 10 s. The server hears the
    # frame arriving (Link.last_received) and waits for it; before, it closed the link
    # as silent, and the resent upload was cut off the same way, for ever.
    config = RunConfig(mode="fl", devices=2, samples_per_device=20, batch_size=10, epochs=1,
                       network={"up_mbps": 0.5, "down_mbps": 50, "latency_ms": 5},
                       heartbeat_interval=2.0, device_timeout=10.0, reconnect_grace=5.0,
                       test_samples=20, seed=1)
    async with asyncio.timeout(120):  # real seconds: the bug was a livelock
        result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    epoch = result.final
    assert not epoch.devices_lost
    assert list(epoch.device_samples) == [20, 20]
    assert epoch.time_s > 37.0


async def test_an_epoch_in_which_nobody_trained_has_no_loss() -> None:
    """Every device killed in the only round of epoch 1, restarted after the grace: epoch
    1 trained nothing, so its loss and training accuracy are NaN (null in
    metrics.jsonl), not 0.0 as if it had trained perfectly; epoch 2 trains again."""
    config = CONFIG.replace(aggregation_every=0, epochs=2)  # one round per epoch
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.activations_in(0, 1) > 0)
        for k in range(3):
            fleet.kill(k)
        await fleet.until(lambda: all(fleet.node.sessions[k].ended for k in range(3)))
        for k in range(3):
            fleet.start_device(k)
        result = await training
    await clock.aclose()
    empty, trained = result.epochs
    assert empty.samples == 0
    assert math.isnan(empty.loss)
    assert math.isnan(empty.train_accuracy)
    line = orjson.dumps(empty.to_mapping())  # as metrics.jsonl writes it
    assert b'"loss":null' in line
    assert b'"epoch":1' in line
    assert trained.samples == 240
    assert math.isfinite(trained.loss)


async def test_a_checkpoint_of_an_earlier_version_resumes_with_its_new_keys_defaulted(
        tmp_path: Path) -> None:
    """A checkpoint written before a config key existed (here ``server_lanes`` and
    ``devices_per_round``) ran as the key's default does: it resumes, also from the old
    flat form of a config (a system's options at top level); one whose keys differ from
    the run's is still another run's."""
    config = CONFIG.replace(epochs=1)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        fleet.node.checkpoints.directory = tmp_path
        for k in range(3):
            fleet.start_device(k)
        await fleet.node.train()
    await clock.aclose()
    path = tmp_path / "checkpoint.json"
    meta = json.loads(path.read_text())
    # the earlier version's form: every key at top level, every system's options among
    # them (at their defaults where they were another system's)
    saved = meta["config"]
    flat = {key: value for m in MODES for key, value in options_of(m).defaults().items()}
    flat.update({k: v for k, v in saved.items() if k != "pipar"}, **saved["pipar"])
    for key in ("server_lanes", "devices_per_round"):
        del flat[key]
    meta["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}
    path.write_text(json.dumps(meta))
    node = Coordinator(config, clock=VirtualClock(), cost_table=COSTS,
                       checkpoint_dir=tmp_path, resume=True)
    assert node.config == config
    with pytest.raises(ConfigError, match=r"another run \(different devices_per_round\)"):
        Coordinator(config.replace(devices_per_round=2), clock=VirtualClock(),
                    cost_table=COSTS, checkpoint_dir=tmp_path, resume=True)
