"""HADFL between devices in virtual time: the rings compute the plain average of models
trained by plain PyTorch, the strategy follows the devices' speeds, the coordinator stays
off the data path, a dead ring member is bypassed and a device that comes back starts
from the backup."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fleet import COSTS, suite_fleet, vgg5_shaped

from aiopipe import RunConfig, RunResult, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.factories import build_model, make_loss, make_optimizer
from aiopipe.runtime.plan import device_data
from aiopipe.runtime.systems.hadfl.gossip import chunk_bounds
from aiopipe.runtime.systems.hadfl.partial_sync import PartialSync
from aiopipe.transport.fabric import MemoryFabric

BATCH = 16


def _config(**changes: Any) -> RunConfig:
    values: dict[str, Any] = {
        "mode": "hadfl", "model": vgg5_shaped, "devices": 3, "batch_size": BATCH,
        "samples_per_device": 3 * BATCH, "epochs": 2, "test_samples": 64, "network": "wifi",
        "learning_rate": 0.05}
    values.update(changes)
    return RunConfig(**values)


def _rounds(result: RunResult) -> list[dict[str, Any]]:
    return [c for e in result.epochs for c in e.changes if c.get("kind") == "hadfl-round"]


def _flat(model: torch.nn.Module, version: float) -> torch.Tensor:
    return torch.cat([*(v.detach().reshape(-1).float() for v in model.state_dict().values()
                        if v.is_floating_point()), torch.tensor([version])])


def _ring_sum(vectors: dict[int, torch.Tensor], ring: list[int]) -> torch.Tensor:
    """Chunk c summed from ring position c on, in ring order (as the scatter-reduce
    adds it up)."""
    n = len(ring)
    total = torch.empty_like(vectors[ring[0]])
    for c, (a, b) in enumerate(chunk_bounds(total.numel(), n)):
        running = vectors[ring[c]][a:b].clone()
        for p in range(1, n):
            running = running + vectors[ring[(c + p) % n]][a:b]
        total[a:b] = running
    return total


def _reference(config: RunConfig, rings: list[list[int]], steps: int) -> torch.nn.Module:
    """Plain PyTorch: each device trains ``steps`` mini-batches a round, going round its
    data in epochs, then every device of the round's ring (all of them) takes the
    average of their models and versions."""
    k = config.devices
    models = [build_model(config, num_classes=10, in_shape=(3, 32, 32)) for _ in range(k)]
    optimizers = [make_optimizer(m, config) for m in models]
    loss = make_loss(config)
    data = [device_data(config, d) for d in range(k)]
    done, versions = [0] * k, [0.0] * k
    for ring in rings:
        for d in range(k):
            batches = len(data[d]) // BATCH
            for _ in range(steps):
                epoch, j = divmod(done[d], batches)
                order = datasets.epoch_order(np.arange(len(data[d])), epoch=epoch,
                                             seed=config.seed)
                x, y = data[d].batch(order[j * BATCH:(j + 1) * BATCH])
                loss(models[d](x), y).backward()
                optimizers[d].step()
                optimizers[d].zero_grad(set_to_none=True)
                done[d] += 1
                versions[d] += 1 / batches
        average = _ring_sum({d: _flat(models[d], versions[d]) for d in ring}, ring) / len(ring)
        for d in ring:
            offset = 0
            with torch.no_grad():
                for v in models[d].state_dict().values():
                    if v.is_floating_point():
                        v.copy_(average[offset:offset + v.numel()].reshape(v.shape))
                        offset += v.numel()
            versions[d] = float(average[-1])
    return models[rings[-1][0]]


@pytest.mark.slow
async def test_rings_of_every_device_average_what_plain_pytorch_trains_bit_for_bit() -> None:
    """Decentralized FedAvg as HADFL runs it (every device in the ring, 4 steps each a
    round): the model the coordinator backs up after each epoch is, bit for bit, the
    ring-ordered average of three models trained by plain PyTorch."""
    config = _config(epochs=3,
                     options={"warmup_epochs": 0, "local_steps": 4, "ring_size": 3})
    result = await simulate(config, clock=VirtualClock())
    rounds = _rounds(result)
    assert [r["steps"] for r in rounds] == [[4, 4, 4]] * 3  # ceil(9 / 12): a round an epoch
    assert all(sorted(r["rings"][0]) == [0, 1, 2] for r in rounds)
    reference = _reference(config, [r["rings"][0] for r in rounds], 4)
    for name, value in reference.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(result.model.state_dict()[name], value), name
    assert rounds[-1]["versions"] == [round(3 * 4 / 3, 6)] * 3  # 12 steps of 3-batch epochs
    assert all(e.samples == 3 * 4 * BATCH for e in result.epochs)


@pytest.mark.slow
async def test_local_steps_follow_speed_and_the_coordinator_carries_no_models_but_backups(
        ) -> None:
    """Slowdowns 1, 1, 2, 4: after a negotiation epoch the hyperperiod is four fast
    epochs and the local steps 4:4:2:1 of it; rings of two, the others merge the
    average; the coordinator's downlink carries control messages only, its uplink one
    backup per epoch; the same seed gives the same run."""
    config = _config(devices=4, device_slowdown=(1, 1, 2, 4), epochs=4,
                     options={"ring_size": 2})
    first = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    again = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    rounds = _rounds(first)
    assert rounds == _rounds(again)
    assert [e.time_s for e in first.epochs] == [e.time_s for e in again.epochs]
    assert rounds[0]["steps"] == [3, 3, 3, 3]
    assert sorted(rounds[0]["rings"][0]) == [0, 1, 2, 3]
    assert all(r["steps"] == [12, 12, 6, 3] for r in rounds[1:])
    assert all(len(r["rings"][0]) == 2 for r in rounds[1:])
    model_bytes = sum(v.numel() * v.element_size()
                      for v in first.model.state_dict().values())
    for epoch in first.epochs:
        assert epoch.bytes_down < 8 * 1024  # control messages only
        assert model_bytes <= epoch.bytes_up < model_bytes + 64 * 1024  # one backup
    # device to device: a ring of N moves 2 (N - 1) models, its sender one to each of
    # the K - N others: the negotiation's ring of four 6, a ring of two and two
    # broadcasts 4 (the paper's bound, 2 K M, is 8), frames included
    flat = sum(v.numel() * v.element_size() for v in first.model.state_dict().values()
               if v.is_floating_point())
    assert math.isclose(sum(first.epochs[0].peer_bytes), 6 * flat, rel_tol=0.01)
    for epoch in first.epochs[1:-1]:
        assert math.isclose(sum(epoch.peer_bytes), 4 * flat, rel_tol=0.01)
    # a device left out merges the average: its version moves towards the ring's
    versions = [r["versions"] for r in rounds]
    left_out = [d for d in range(4) if d not in rounds[1]["rings"][0]]
    ring = rounds[1]["rings"][0]
    steps = rounds[2]["steps"]
    for d in left_out:
        if d not in rounds[2]["rings"][0]:
            merged = (versions[1][d] + versions[1][ring[0]]) / 2 + steps[d] / 3
            assert math.isclose(versions[2][d], merged, abs_tol=1e-5)
    for name, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[name]), name


async def test_a_dead_ring_member_is_bypassed_and_comes_back_from_the_backup() -> None:
    """Four devices, all in every ring: device 2 killed in the middle of round 2's
    training. Its downstream hears nothing, asks, gets no answer, and the three others
    average among themselves; later rounds go on without it; restarted, it starts from
    the coordinator's backup and joins the rings again."""
    config = _config(devices=4, epochs=6, heartbeat_interval=0.5, device_timeout=2.0,
                     reconnect_grace=1.0,
                     options={"warmup_epochs": 0, "local_steps": 3, "ring_size": 4,
                              "ring_timeout": 0.5})
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks, fabric=MemoryFabric(clock))
        for k in range(4):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 2)
        await clock.sleep(0.01)
        fleet.kill(2)
        await fleet.until(lambda: fleet.node.rounds == 4)
        fleet.start_device(2)
        result = await training
    await clock.aclose()
    assert not fleet.crashes
    rounds = _rounds(result)
    assert rounds[1]["lost"] == [2]
    assert rounds[1]["rings"][0] != []
    assert 2 in rounds[1]["rings"][0]
    assert 2 not in rounds[2]["rings"][0]  # the liveness monitor knows
    back = [r for r in rounds[3:] if 2 in r["rings"][0]]
    assert back, "the restarted device never joined a ring again"
    assert result.epochs[1].devices_lost == (2,)
    assert all(math.isfinite(e.loss) for e in result.epochs)


async def test_a_silent_ring_member_is_asked_then_bypassed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Device 2 stays connected but sends its ring nothing in round 2 (a stalled
    member): its downstream waits ``ring_timeout``, asks it, waits as long again, and
    the three others average among themselves; device 2, told, keeps its own model, and
    the run goes on with everyone."""
    original = PartialSync._send

    def silent(self: PartialSync, device: int, message: Any, name: str, *,
               background: bool = False) -> None:
        if self.me == 2 and self._round == 1:
            return
        original(self, device, message, name, background=background)

    monkeypatch.setattr(PartialSync, "_send", silent)
    config = _config(devices=4, epochs=3,
                     options={"warmup_epochs": 0, "local_steps": 3, "ring_size": 4,
                              "ring_timeout": 0.5})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    rounds = _rounds(result)
    assert [r["lost"] for r in rounds] == [[], [], []]
    upstream_of_2 = rounds[1]["rings"][0][rounds[1]["rings"][0].index(2) - 1]
    downstream_of_2 = rounds[1]["rings"][0][(rounds[1]["rings"][0].index(2) + 1) % 4]
    assert f"device{downstream_of_2}: ring member device2 is dead" in caplog.text
    # device 2 heard nothing either (its asks went nowhere): it averaged with nobody
    assert f"device2: ring member device{upstream_of_2} is dead" in caplog.text
    # the round took the two waits (the wait, then the handshake's)
    assert result.epochs[1].time_s >= 2 * config.options.ring_timeout
    assert result.epochs[1].time_s > result.epochs[2].time_s + 2 * config.options.ring_timeout - 0.2


async def test_a_resumed_run_goes_on_from_the_backup_with_the_negotiated_strategy(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The server stops after two epochs (negotiation and one) and is started again
    from its checkpoint with new device processes: every device starts from the backup,
    the strategy is the negotiated one (no second negotiation), and the run ends."""
    config = _config(devices=3, device_slowdown=(1, 2, 2), epochs=4,
                     options={"ring_size": 2})

    async def run(resume: bool, stop_after: int | None) -> Coordinator:
        clock = VirtualClock()
        async with asyncio.TaskGroup() as tasks:
            fleet = suite_fleet(config, clock, tasks, fabric=MemoryFabric(clock))
            fleet.node = Coordinator(config, clock=clock, cost_table=COSTS,
                                     checkpoint_dir=tmp_path, resume=resume)
            for k in range(3):
                fleet.start_device(k)
            training = tasks.create_task(fleet.node.train())
            if stop_after is None:
                await training
            else:
                await fleet.until(lambda: len(fleet.node.epochs) == stop_after)
                await fleet.node.checkpoints.written()
                training.cancel()
                for k in range(3):
                    fleet.kill(k)
                for task in fleet.helpers:
                    task.cancel()
        await clock.aclose()
        return fleet.node

    caplog.set_level(logging.INFO, "aiopipe.device")
    first = await run(False, 2)
    negotiated = list(first.system.warmup_times)  # type: ignore[attr-defined]
    steps = [c["steps"] for c in first.epochs[1].changes]
    assert steps == [[6, 3, 3]]  # a hyperperiod of two fast epochs
    caplog.clear()
    node = await run(True, None)
    assert len(node.epochs) == 4
    assert node.system.warmup_times == negotiated  # type: ignore[attr-defined]
    later = [c for e in node.epochs[2:] for c in e.changes if c.get("kind") == "hadfl-round"]
    assert later
    assert all(r["steps"] == steps[0] for r in later)  # no negotiation again
    assert caplog.text.count("starts from the coordinator's backup") == 3


async def test_groups_average_within_themselves_and_across_every_few_rounds() -> None:
    """Six devices in groups of three: rings of two within each group (its sender
    serving the group's third device), and every second round, and each epoch's last,
    a ring of one device per group whose average reaches everyone."""
    config = _config(devices=6, epochs=3, samples_per_device=2 * BATCH,
                     options={"warmup_epochs": 0, "local_steps": 1, "ring_size": 2,
                              "group_size": 3, "inter_group_every": 2})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    rounds = _rounds(result)
    assert len(rounds) == 6  # ceil(12 batches / 6 steps) = 2 rounds an epoch
    groups = [{0, 1, 2}, {3, 4, 5}]
    for r in rounds:
        rings = r["rings"]
        if r["round"] % 2 == 1:  # the epoch's first (rounds count from 1): within groups
            assert len(rings) == 2
            assert [len(ring) for ring in rings] == [2, 2]
            assert [set(ring) <= group for ring, group in zip(rings, groups, strict=True)]
        else:  # the epoch's last: across them (its average is the backup)
            assert len(rings) == 1
            assert sorted(len(set(rings[0]) & g) for g in groups) == [1, 1]
    flat = sum(v.numel() * v.element_size() for v in result.model.state_dict().values()
               if v.is_floating_point())
    # within: two rings of two (2 models each) and a broadcast each (1); across: a ring
    # of two (2) and four broadcasts (4): 12 models an epoch (a device counts what it
    # sent at each report: a broadcast may go on past it, and the last one's past the
    # run's end)
    total = sum(sum(epoch.peer_bytes) for epoch in result.epochs) / flat
    assert 12 * 3 - 4 <= total <= 12 * 3 * 1.01


@pytest.mark.slow
async def test_a_device_slower_than_negotiated_stops_at_its_budget_not_holding_the_ring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 3 turns twice as slow after the negotiation: it stops its local steps once
    it has used 1.1 times the time they were to take, reaching a lower version, and its
    rounds last about 1.1 periods instead of 2."""
    original = PartialSync.run_round

    async def disturbed(self: PartialSync, start: Any, route: Any) -> Any:
        if self.me == 3 and start.round >= 2:
            self.compute.slowdown = 8.0  # was 4
        return await original(self, start, route)

    config = _config(devices=4, device_slowdown=(1, 2, 2, 4), epochs=4,
                     samples_per_device=4 * BATCH, options={"ring_size": 4})
    calm = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    monkeypatch.setattr(PartialSync, "run_round", disturbed)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    calm_rounds, rounds = _rounds(calm), _rounds(result)
    assert [r["trained"] for r in calm_rounds[1:]] == [r["steps"] for r in calm_rounds[1:]]
    for r in rounds[2:]:
        assert r["trained"][:3] == r["steps"][:3]
        assert 0 < r["trained"][3] < r["steps"][3]  # cut at its budget
    assert rounds[-1]["versions"][3] < calm_rounds[-1]["versions"][3]
    for slow, usual in zip(result.epochs[2:], calm.epochs[2:], strict=True):
        assert slow.time_s < 1.25 * usual.time_s
