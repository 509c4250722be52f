"""Asteroid's hybrid pipeline (``mode = "asteroid"``), in virtual time.

- equivalence: stages run by data-parallel groups, each member on its rows of every
  micro-batch, train the weights unsplit training does on the whole mini-batch (one
  forward of all its samples, one step), to 1e-5, for groups in the first stage, the last
  or both, 1F1B and GPipe, N in {1, 2};
- the plan: "auto" takes Asteroid's planner's stages, groups and rows; a fleet whose
  memory cannot hold the model is refused naming a device;
- a member's rows follow Algorithm 1: a slower device computes fewer of them.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, ClassVar

import pytest
import torch
from fleet import COSTS, suite_fleet
from torch import nn

from aiopipe import RunConfig, RunResult, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.errors import ConfigError
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.factories import build_model
from aiopipe.runtime.plan import device_indices, train_dataset
from aiopipe.runtime.systems.asteroid.coordinator import Asteroid
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.testing import Fleet
from aiopipe.transport import LinkSpec, MemoryLink
from aiopipe.transport.fabric import MemoryFabric

BATCH = 16
LR = 0.05


def _model() -> nn.Sequential:
    """Five units, no batch norm (whose statistics over a member's rows differ from the
    whole micro-batch's by definition)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(16 * 8 * 8, 32), nn.ReLU()),
        nn.Linear(32, 10))


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="asteroid", model=_model(), devices=3, samples_per_device=4 * BATCH,
                     batch_size=BATCH, epochs=1,
                     parallel_batches=2, learning_rate=LR, momentum=0.9, test_samples=20,
                     seed=3, options={"partition": [2], "stage_groups": [[0, 1], [2]]})
    return base.replace(**changes)


def _rows(plan: list[dict[str, object]]) -> dict[int, tuple[int, int]]:
    return {int(e["device"]): tuple(e["rows"]) for e in plan}  # type: ignore[arg-type,misc]


def _reference(config: RunConfig, rows: dict[int, tuple[int, int]], first_stage: list[int],
               iterations: int) -> nn.Sequential:
    """Unsplit training: per iteration, the whole mini-batch (micro-batch n is the first
    stage's members' rows of it, each from its own data: its next ``share`` samples) in
    one forward, its mean loss, one SGD step with momentum."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    n = config.parallel_batches
    assert isinstance(n, int)
    for epoch in range(config.epochs):
        orders = {d: datasets.epoch_order(device_indices(config, dataset, d), epoch=epoch,
                                          seed=config.seed) for d in first_stage}
        for i in range(iterations):
            picked = []
            for m in range(n):
                for d in sorted(first_stage, key=lambda d: rows[d]):
                    share = rows[d][1] - rows[d][0]
                    start = i * share * n + m * share
                    picked.extend(orders[d][start:start + share])
            x, y = dataset.batch(picked)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.mark.parametrize(("groups", "cuts", "slowdowns"), [
    ([[0, 1], [2]], [2], [1.0, 1.5, 1.0]),  # a group first
    ([[0], [1, 2]], [3], [1.0, 1.0, 2.0]),  # a group last (it computes the loss)
    ([[0, 1], [2, 3]], [1], [1.0, 2.0, 1.0, 1.0]),  # two groups: rows re-cut between them
    ([[0, 1, 2]], [], [1.0, 1.0, 1.0]),  # one stage: pure data parallelism
])
@pytest.mark.parametrize(("schedule", "n"), [("1f1b", 2), ("gpipe", 2), ("1f1b", 1)])
async def test_hybrid_pipeline_training_equals_unsplit_training(
        groups: list[list[int]], cuts: list[int], slowdowns: list[float], schedule: str,
        n: int) -> None:
    config = _config(devices=len(slowdowns),
                     device_slowdown=slowdowns, parallel_batches=n,
                     options={"stage_groups": groups, "partition": cuts, "schedule": schedule})
    result = await simulate(config, clock=VirtualClock())
    rows = _rows(result.final.plan)
    iterations = result.final.samples // BATCH
    assert iterations >= 3
    assert result.final.samples == iterations * BATCH
    want = _reference(config, rows, groups[0], iterations).state_dict()
    got = result.model.state_dict()
    # equal up to float rounding: a member's rows are summed apart from the others', and
    # which rows a member gets follows the measured costs (so rounding varies by host)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=5e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
async def test_a_slower_member_computes_fewer_rows() -> None:
    result = await simulate(_config(device_slowdown=[1.0, 3.0, 1.0], batch_size=32),
                            clock=VirtualClock())
    rows = _rows(result.final.plan)
    assert (rows[0][0], rows[0][1], rows[1][1]) == (0, rows[1][0], 16)
    assert rows[1][1] - rows[1][0] < rows[0][1] - rows[0][0]
    assert rows[2] == (0, 16)


async def test_auto_takes_the_planners_stages_groups_and_rows() -> None:
    config = _config(devices=4,
                     device_slowdown=[1.0, 1.0, 4.0, 4.0],
                     options={"partition": "auto", "stage_groups": "auto"})
    result = await simulate(config, clock=VirtualClock())
    plan = result.final.plan
    assert sorted(int(e["device"]) for e in plan) == [0, 1, 2, 3]
    assert float(plan[0]["estimate_s"]) > 0  # type: ignore[arg-type]
    for stage in {int(e["stage"]) for e in plan}:  # type: ignore[call-overload]
        members = sorted(tuple(e["rows"]) for e in plan if e["stage"] == stage)  # type: ignore[misc]
        assert (members[0][0], members[-1][1]) == (0, BATCH // 2)
    assert result.final.samples > 0


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["equal-groups", "equal-groups-by-speed"])
async def test_a_baseline_planner_plans_auto_stages_by_its_own_rules(planner: str) -> None:
    """``planner``: a hybrid baseline's plan (`aiopipe.scheduler.hpp_baseline`), not
    Asteroid's: groups of equal size in the declared order; "equal-groups" splits a
    micro-batch equally even with a member 4x slower, "-by-speed" gives it fewer rows.
    The run trains on that plan."""
    options = {"partition": "auto", "stage_groups": "auto", "planner": planner}
    config = _config(devices=4, device_slowdown=[1.0, 4.0, 1.0, 4.0], options=options)
    system = Coordinator(config, clock=VirtualClock(), cost_table=COSTS).system
    assert isinstance(system, Asteroid)
    sizes = [len(group) for group in system.groups]
    assert max(sizes) - min(sizes) <= 1
    assert [d for group in system.groups for d in group] == [0, 1, 2, 3]
    shares = {d: stop - start for d, (start, stop) in system.rows.items()}
    grouped = [group for group in system.groups if {0, 1} <= set(group)]
    if planner == "equal-groups":
        assert all(max(shares[d] for d in g) - min(shares[d] for d in g) <= 1
                   for g in system.groups)
    elif grouped:
        assert shares[1] < shares[0]
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert _rows(result.final.plan) == system.rows
    assert result.final.samples > 0
    with pytest.raises(ConfigError, match="planner"):
        _config(options={**options, "planner": "dapple"})


def test_the_plan_follows_what_the_devices_measured_of_themselves() -> None:
    """On real clocks the coordinator plans again from the devices' own profiles
    ([Note: device profiles]): devices declared equal, of which device 1 measured
    itself 3x slower, get rows by what they measured; with "auto", a device that
    measured itself 50x slower than declared computes the least a member can."""
    table = CostTable.uniform(5, forward=1e-3, backward=2e-3)
    link = LinkSpec(None, 0.0)

    def measured(*factors: float) -> list[DeviceProfile]:
        return [DeviceProfile(1.0, link, link, 4 * BATCH, table.scaled(f)) for f in factors]

    system = Coordinator(_config(), clock=VirtualClock(), cost_table=table).system
    assert isinstance(system, Asteroid)
    assert system.rows[0][1] - system.rows[0][0] == system.rows[1][1] - system.rows[1][0]
    system.prepare([4 * BATCH] * 3, measured(1.0, 3.0, 1.0))
    assert (system.rows[0], system.rows[1], system.rows[2]) == ((0, 6), (6, 8), (0, 8))
    declared = _config(devices=4, options={"partition": "auto", "stage_groups": "auto"})
    system = Coordinator(declared, clock=VirtualClock(), cost_table=table).system
    assert isinstance(system, Asteroid)
    before, slow = system.estimate_s(), system.groups[0][0]
    assert system.rows[slow][1] - system.rows[slow][0] > 1
    system.prepare([4 * BATCH] * 4, measured(*[50.0 if d == slow else 1.0 for d in range(4)]))
    assert system.rows[slow][1] - system.rows[slow][0] == 1  # the least a member computes
    assert system.estimate_s() > before


def test_a_fleet_whose_memory_cannot_hold_the_model_is_refused_naming_a_device() -> None:
    config = _config(devices=2,
                     device_memory_mb=[0.01, 0.01],
                     options={"partition": "auto", "stage_groups": "auto"})
    with pytest.raises(ConfigError, match="device"):
        Coordinator(config, clock=VirtualClock())


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
async def test_each_members_measured_memory_is_within_its_budget_and_the_planners_model(
        schedule: str) -> None:
    """What training held at most on each device (its weights, gradients, momentum and
    the tensors autograd kept for the micro-batches in flight, `aiopipe.runtime.memory`)
    stays within its budget and within 5% of the planner's Eq. 3 for its stage (the
    loss's own tensors, on the last stage, are not in Eq. 3), and Eq. 3 is no more than
    15% above it."""
    config = RunConfig(mode="asteroid", model="vgg5", devices=4, samples_per_device=128,
                       batch_size=32, epochs=1, parallel_batches=4, test_samples=0, seed=3,
                       device_slowdown=[1.0, 2.0, 2.0, 4.0],
                       device_memory_mb=[40.0, 24.0, 16.0, 12.0], options={"schedule": schedule})
    result = await simulate(config, clock=VirtualClock())
    for stage in result.final.stages:
        peak, planned = stage["peak_memory_mb"], stage["planned_memory_mb"]
        assert 0 < peak <= stage["budget_mb"]
        assert peak <= 1.05 * planned, stage
        assert planned <= 1.15 * peak, stage


@pytest.mark.parametrize(("killed", "rescheduling", "after"), [
    # a member of a group: lightweight keeps each stage's devices, the group on the
    # member left, and moves the cut towards the stage that got slower
    (1, "lightweight", [[0, 0, [0, 3]], [2, 1, [3, 5]]]),
    # the last stage's only device: lightweight gives its units to the stage before
    (2, "lightweight", [[0, 0, [0, 5]], [1, 0, [0, 5]]]),
    pytest.param(1, "heavy", None,  # the planner from scratch: whatever it finds
                 marks=pytest.mark.slow),  # (a training of about 2.5 s)
])
@pytest.mark.slow
async def test_a_lost_device_is_re_planned_around_and_its_round_played_again(
        killed: int, rescheduling: str, after: list[list[object]] | None) -> None:
    """Killed mid-round, the device's neighbours' links to it and its connection are
    given up; the devices left wait, the coordinator re-plans over them and plays the
    round again from its start: the run ends, the lost device out of the plan, every
    epoch's samples counted once by the plan that completed it."""
    config = _config(model="vgg5", devices=3,
                     epochs=3, samples_per_device=6 * BATCH, heartbeat_interval=0.5,
                     device_timeout=2.0, reconnect_grace=1.0,
                     options={"stage_groups": [[0, 1], [2]], "partition": [2],
                              "rescheduling": rescheduling})
    result, _ = await _killed_mid_round(config, killed)
    first, second, third = result.epochs
    assert killed not in [e["device"] for e in third.plan]
    [recovery] = [c for c in second.changes if c.get("kind") == "recovery"]
    assert recovery["lost"] == [killed]
    assert recovery["rescheduling"] == rescheduling
    if after is not None:
        assert [entry[:3] for entry in recovery["after"]] == after
    assert recovery["resumed_s"] > recovery["noticed_s"]
    assert recovery["noticed_s"] - first.time_s <= (config.device_timeout
                                                    + config.reconnect_grace + 1.0)
    # an epoch keeps its batches: the first stage's devices go round their data again
    assert first.samples == second.samples == third.samples
    for epoch in (second, third):  # played by the plan that completed it
        stage0 = [e for e in epoch.plan if e["stage"] == 0]
        per_iteration = sum(e["rows"][1] - e["rows"][0] for e in stage0) * 2
        assert epoch.samples % per_iteration == 0
        assert epoch.samples == sum(epoch.device_samples[e["device"]] for e in stage0)
    assert math.isfinite(third.loss)


async def _killed_mid_round(config: RunConfig, killed: int, *, into: float = 0.05,
                            costs: CostTable = COSTS) -> tuple[RunResult, Fleet]:
    """Train ``config`` on three devices, ``killed`` killed ``into`` virtual seconds
    into epoch 2's round; compute charged by ``costs``."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks, fabric=MemoryFabric(clock), cost_table=costs)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 2 and fleet.node.epoch == 1)
        await clock.sleep(into)
        fleet.kill(killed)
        result = await training
    await clock.aclose()
    assert not fleet.crashes
    return result, fleet


@pytest.mark.slow  # (about 2 s)
async def test_a_lightweight_replay_keeps_the_stages_left_in_place_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 2 of the last stage's group is lost: devices 0 and 1 keep their stages (the
    last stage, of two units on one device, is still not slower than the first, of
    three), so the replay sends them no weights; each starts again from the state it
    kept of the round's start, and the run ends with the weights of a replay that sent
    them."""
    config = _config(model="vgg5", devices=3,
                     epochs=3, samples_per_device=6 * BATCH, heartbeat_interval=0.5,
                     device_timeout=2.0, reconnect_grace=1.0,
                     options={"stage_groups": [[0], [1, 2]], "partition": [3]})
    kept, _ = await _killed_mid_round(config, 2, into=1.0)  # a few steps in
    original = Asteroid._starts

    def sending(self: Asteroid, *args: Any) -> Any:
        self._keep = False  # as if the devices held nothing: every stage's weights sent
        return original(self, *args)

    monkeypatch.setattr(Asteroid, "_starts", sending)
    sent, _ = await _killed_mid_round(config, 2, into=1.0)
    [change] = kept.epochs[1].changes
    assert change["lost"] == sent.epochs[1].changes[0]["lost"] == [2]
    assert [entry[:3] for entry in change["after"]] == [[0, 0, [0, 3]], [1, 1, [3, 5]]]
    for name, tensor in sent.model.state_dict().items():
        assert torch.equal(kept.model.state_dict()[name], tensor), name
    # the replay's weights did not travel to the two devices that kept their stages
    assert kept.epochs[1].bytes_down < sent.epochs[1].bytes_down


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 2])
async def test_a_lost_device_s_stage_is_restored_from_the_latest_backup_point(
        killed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage backups every 2 batches ([Note: stage backups]): device 1 (a member of
    stage 0's group: its stage survives on device 0) or device 2 (stage 1's only device:
    its stage survives on its backup node, device 0) is lost mid-round; the round is
    played again from the latest backup point, not from its start, the epoch keeps its
    samples, and the devices that kept their own snapshot start from it, ending bit for
    bit where a replay that sent every stage its weights and momentum ends."""
    config = _config(model="vgg5", devices=3,
                     epochs=3, samples_per_device=6 * BATCH, heartbeat_interval=0.5,
                     device_timeout=2.0, reconnect_grace=1.0,
                     options={"stage_groups": [[0, 1], [2]], "partition": [2],
                              "chain_replication_every": 2})
    kept, _ = await _killed_mid_round(config, killed, into=1.0)
    original = Asteroid._starts

    def sending(self: Asteroid, *args: Any) -> Any:
        self._keep = False  # every stage's weights (and momentum) sent
        return original(self, *args)

    monkeypatch.setattr(Asteroid, "_starts", sending)
    sent, _ = await _killed_mid_round(config, killed, into=1.0)
    [change] = kept.epochs[1].changes
    assert change["lost"] == [killed]
    assert change["from_iteration"] > 0
    assert change["from_iteration"] % 2 == 0
    assert len({e.samples for e in kept.epochs}) == 1  # the epoch kept its samples
    for name, tensor in sent.model.state_dict().items():
        assert torch.equal(kept.model.state_dict()[name], tensor), name
    assert [e.loss for e in kept.epochs] == [e.loss for e in sent.epochs]


@pytest.mark.slow
async def test_a_much_worse_adjustment_falls_back_to_the_planner() -> None:
    """Over wifi, losing stage 1's only device leaves the adjustment one choice: stage 0's
    group takes every unit and all-reduces the whole model every batch, far slower than
    the devices left should manage; the planner's plan (a pipeline) is taken instead.
    The round goes on from a backup point; the samples before it count, device 1's too,
    though it no longer runs the first stage."""
    config = _config(model="vgg5", devices=3,
                     epochs=2, samples_per_device=6 * BATCH, heartbeat_interval=0.5,
                     device_timeout=2.0, reconnect_grace=1.0, network="wifi",
                     options={"stage_groups": [[0, 1], [2]], "partition": [2],
                              "chain_replication_every": 2})
    fast = CostTable.uniform(5, forward=1e-4, backward=2e-4, batch=10)  # links dominate
    result, _ = await _killed_mid_round(config, 2, into=0.6, costs=fast)
    [change] = result.epochs[1].changes
    assert change["rescheduling"] == "lightweight+planner"
    assert change["from_iteration"] > 0  # device 1's samples before it: still counted
    assert len({entry[1] for entry in change["after"]}) == 2  # two stages: a pipeline
    assert len({e.samples for e in result.epochs}) == 1


@pytest.mark.slow  # (the fast subset's slowest: the full suite runs it)
async def test_the_last_stage_is_backed_up_to_the_first() -> None:
    """Three one-device stages: the last stage's only device (2) backs its stage up to
    the first stage's (0), over a link of their own; lost, its stage is restored from
    there and the round goes on from the latest backup point."""
    config = _config(model="vgg5", devices=3,
                     epochs=2, samples_per_device=6 * BATCH, heartbeat_interval=0.5,
                     device_timeout=2.0, reconnect_grace=1.0,
                     options={"stage_groups": [[0], [1], [2]], "partition": [2, 3],
                              "chain_replication_every": 2})
    result, _ = await _killed_mid_round(config, 2, into=1.0)
    [change] = result.epochs[1].changes
    assert change["lost"] == [2]
    assert change["from_iteration"] > 0  # stage 2's state: on device 0 alone
    assert len({e.samples for e in result.epochs}) == 1
    assert math.isfinite(result.epochs[1].loss)


@pytest.mark.slow
@pytest.mark.parametrize("backups", [0, 2])
async def test_a_round_stopped_by_a_broken_link_is_played_again_exactly(backups: int) -> None:
    """The link between device 0 (stage 0) and device 2 (stage 1) breaks mid-round, no
    device lost: both say their round stopped, the coordinator plays it again with the
    same plan, every device from the state it kept of the round's start (weights,
    buffers, momentum) or, with stage backups every 2 batches, from its own snapshot at
    the latest backup point, and the run ends bit for bit where an undisturbed one does."""
    config = _config(model="vgg5", devices=3,
                     epochs=3, samples_per_device=6 * BATCH, heartbeat_interval=0.5,
                     device_timeout=2.0, reconnect_grace=1.0,
                     options={"stage_groups": [[0, 1], [2]], "partition": [2],
                              "chain_replication_every": backups})
    undisturbed = await simulate(config, clock=VirtualClock())

    class Recorded(MemoryFabric):
        """A fabric that keeps each peer link's ends (to break one)."""

        links: ClassVar[list[tuple[str, str, MemoryLink]]] = []

        def _connect(self, dialer: str, address: str) -> tuple[Any, Any, Any]:
            ours, theirs, target = super()._connect(dialer, address)
            self.links.append((dialer, target.name, ours))
            return ours, theirs, target

    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fabric = Recorded(clock)
        fleet = suite_fleet(config, clock, tasks, fabric=fabric)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 2 and fleet.node.epoch == 1)
        await clock.sleep(1.0)  # a few steps into epoch 2's round
        [link] = [link for a, b, link in fabric.links if {a, b} == {"device0", "device2"}]
        link.break_("cut")
        result = await training
    await clock.aclose()
    assert not fleet.crashes
    [change] = result.epochs[1].changes
    assert (change["lost"], change["rescheduling"]) == ([], "")  # the plan stayed
    assert change["replayed_as"] > change["round"]
    assert (change["from_iteration"] > 0) == (backups > 0)
    assert change["from_iteration"] % 2 == 0
    assert [e.samples for e in result.epochs] == [e.samples for e in undisturbed.epochs]
    for name, tensor in undisturbed.model.state_dict().items():
        assert torch.equal(result.model.state_dict()[name], tensor), name
