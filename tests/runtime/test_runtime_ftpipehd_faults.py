"""FTPipeHD goes on without a lost device (§III-F, DESIGN §FTPipeHD), in virtual time:
the round in which a worker died is played again from its start by the devices still
there, re-partitioned among them, each from the weights and momentum the coordinator sent
for the round. So no batch is applied twice or skipped: the run ends with exactly the
weights of one process that applies the rules round by round, each round under the
partition that completed it. Device 0 holds the data: without it the run ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from async_reference import delayed_sgd_rounds
from fleet import suite_fleet

from aiopipe import CostTable, RunConfig, TrainingError, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.errors import AiopipeError
from aiopipe.runtime.checkpoint import load_checkpoint
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.runtime.plan import build_model, device_indices, train_dataset
from aiopipe.transport import LinkSpec, open_memory_link_pair
from aiopipe.transport.fabric import MemoryFabric

COSTS = CostTable.uniform(5, forward=0.01, backward=0.02, batch=8)
CONFIG = RunConfig(mode="ftpipehd", model="vgg5", devices=4, samples_per_device=80,
                   batch_size=8, epochs=2, learning_rate=0.05,
                   momentum=0.9, test_samples=20, seed=3, heartbeat_interval=0.5,
                   device_timeout=2.0, reconnect_grace=1.0, options={"partition": (1, 2, 3)})


class _Run:
    """A coordinator and its devices over memory links, each device a task to cancel
    (a process killed: its links break, it says nothing)."""

    def __init__(self, config: RunConfig, clock: VirtualClock,
                 costs: CostTable = COSTS, links: dict[tuple[str, str], LinkSpec] | None = None
                 ) -> None:
        self.config, self.clock = config, clock
        self.node = Coordinator(config, clock=clock, cost_table=costs)
        self.fabric = MemoryFabric(clock, links=links or {})
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.outcomes: dict[int, BaseException | None] = {}

    async def device(self, k: int) -> None:
        device_end, server_end = open_memory_link_pair(self.clock)
        endpoint = self.fabric.endpoint(f"device{k}")
        serving = asyncio.ensure_future(self.node.serve_link(server_end))
        try:
            await run_device(device_end, k, clock=self.clock, clock_offset=0.0,
                             endpoint=endpoint, cost_table=self.node.cost_table)
            self.outcomes[k] = None
        except (AiopipeError, asyncio.CancelledError) as exc:
            self.outcomes[k] = exc
        finally:
            device_end.break_(f"device {k} is gone")
            await endpoint.aclose()
            with contextlib.suppress(AiopipeError):
                await serving

    async def train(self, during: Callable[[_Run], Any]) -> Any:
        async with asyncio.TaskGroup() as tasks:
            self.group = tasks
            for k in range(self.config.devices):
                self.tasks[k] = tasks.create_task(self.device(k))
            training = tasks.create_task(self._train())
            await during(self)
        await self.clock.aclose()
        return training.result()

    async def _train(self) -> Any:
        try:
            return await self.node.train()
        except TrainingError as exc:
            return exc

    async def mid_round(self, round_no: int, into: float = 0.3) -> None:
        """Until round ``round_no`` (0-based) has been under way for ``into`` seconds."""
        while self.node.rounds <= round_no:
            await self.clock.sleep(0.01)
        await self.clock.sleep(into)


def _reference(config: RunConfig, cuts_by_round: list[list[int]],
               split: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One process applying the rules round by round: each epoch's batches in rounds of
    ``global_replication_every``, round r under ``cuts_by_round[r]``; ``split`` = (r, c):
    round r is two, its first c batches and the others (a replay from a chain point)."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    batch, every = config.batch_size, config.options.global_replication_every
    rounds = []
    for epoch in range(config.epochs):
        order = datasets.epoch_order(device_indices(config, dataset, 0), epoch=epoch,
                                     seed=config.seed)
        batches = [dataset.batch(order[b * batch:(b + 1) * batch])
                   for b in range(len(order) // batch)]
        step = every or len(batches)
        for first in range(0, len(batches), step):
            part = batches[first:first + step]
            if split is not None and split[0] == len(rounds):
                rounds.append((cuts_by_round[len(rounds)], part[:split[1]]))
                split, part = None, part[split[1]:]
            rounds.append((cuts_by_round[len(rounds)], part))
    assert len(rounds) == len(cuts_by_round)
    delayed_sgd_rounds(model, rounds, lr=config.learning_rate, momentum=config.momentum,
                       every=config.options.version_aggregation)
    return model.state_dict()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


@pytest.mark.parametrize("every", [3, 0])
async def test_rounds_end_at_each_global_replication(every: int) -> None:
    """Global replication every 3 batches: each epoch's 10 batches in rounds of 3, 3, 3
    and 1, the pipeline flushed between them (0: one round an epoch)."""
    config = CONFIG.replace(options={"global_replication_every": every, "version_aggregation": 2})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    rounds = 8 if every else 2
    _assert_same(result.model.state_dict(), _reference(config, [[1, 2, 3]] * rounds))
    assert [e.samples for e in result.epochs] == [80, 80]
    # every round the devices send their stages up; only the run's first round sends
    # them down: then each device holds its stage ([Note: kept weights])
    first, second = result.epochs
    assert first.bytes_down > 0.5 * first.bytes_up / (4 if every else 1)
    assert second.bytes_down < 0.05 * second.bytes_up


@pytest.mark.parametrize("killed", [2, 3])
async def test_a_killed_worker_s_round_is_played_again_by_the_others(killed: int) -> None:
    """A middle worker, or the last stage, killed mid-round in epoch 2: that round is
    played again on the three devices left, with new cuts, and the run ends with the
    weights of the reference that trains epoch 1 under the old cuts and epoch 2 under the
    new ones, momentum carried across."""
    run = _Run(CONFIG, VirtualClock())

    async def kill(run: _Run) -> None:
        await run.mid_round(1)
        run.tasks[killed].cancel()

    result = await run.train(kill)
    assert not isinstance(result, Exception), result
    (recovery,) = run.node.replans
    left = [k for k in range(4) if k != killed]
    assert recovery["lost"] == [killed]
    assert recovery["workers"] == left
    assert recovery["before"] == [1, 2, 3]
    assert len(recovery["after"]) == 2
    assert recovery["replayed_as"] == 3  # rounds count from 1: epoch 2's is round 2
    first, second = result.epochs
    assert second.devices_lost == (killed,)
    assert [first.samples, second.samples] == [80, 80]  # each batch once
    assert [p["device"] for p in second.plan] == left
    for k in left:
        assert run.outcomes[k] is None  # they trained on to the end
    # recorded with the epoch, and on the timeline: a neighbour said its round stopped
    # as the link broke; the round was played again once the coordinator had given the
    # device up (reconnect_grace after its connection broke)
    assert second.changes == (recovery,)
    assert "the link to device" in recovery["stopped"]
    (span,) = [t for t in result.trace if t.track == "server/recovery"]
    assert span.start - result.trace_origin == pytest.approx(recovery["noticed_s"])
    assert span.end - result.trace_origin == pytest.approx(recovery["resumed_s"])
    (grace,) = [t for t in result.trace if t.track == f"device{killed}/connection"]
    assert grace.name == "lost"
    assert grace.duration == pytest.approx(CONFIG.reconnect_grace)
    assert span.start - 0.05 <= grace.start <= span.start + 0.05  # (link latency)
    assert grace.end <= span.end <= grace.end + 0.1
    _assert_same(result.model.state_dict(), _reference(CONFIG, [[1, 2, 3], recovery["after"]]))


@pytest.mark.slow
@pytest.mark.parametrize("killed", [2, 3])
async def test_a_round_is_played_again_from_its_latest_chain_replica(killed: int) -> None:
    """Chain replication every 3 batches: when a worker is killed mid-round, every stage's
    state after the same 3, 6 or 9 batches survived (the killed stage's on the next
    stage's device, the last stage's on the coordinator), so only the batches after that
    are played again. The run ends with the weights of the reference whose epoch 2 is
    two rounds split there, and every batch counted once (loss and correct too)."""
    config = CONFIG.replace(options={"chain_replication_every": 3})
    run = _Run(config, VirtualClock())

    async def kill(run: _Run) -> None:
        await run.mid_round(1, into=0.5)
        run.tasks[killed].cancel()

    result = await run.train(kill)
    assert not isinstance(result, Exception), result
    (recovery,) = run.node.replans
    assert recovery["from_chain"] is True
    resumed, end = recovery["batches"]
    assert recovery["committed"] == [0, resumed]  # applied by the attempt given up on
    assert resumed in (3, 6, 9)
    assert end == 10
    first, second = result.epochs
    assert [first.samples, second.samples] == [80, 80]
    _assert_same(result.model.state_dict(),
                 _reference(config, [[1, 2, 3], [1, 2, 3], recovery["after"]],
                            split=(1, resumed)))
    undisturbed = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    # the replicas travelled: device to device, and from the last stage to the coordinator
    sent = {s.track for s in result.trace if s.name == "replica"}
    assert {"device0->device1", "device3/uplink"} <= sent
    # the batches before the chain point count with the loss the first attempt saw
    assert second.loss == pytest.approx(undisturbed.epochs[1].loss, rel=0.05)
    assert second.train_accuracy >= 0.0


@pytest.mark.slow  # (about 2 s)
async def test_a_chain_replica_keeps_batch_norm_s_statistics_exact() -> None:
    """MobileNetV3 (batch norm: its running statistics are buffers that every forward
    moves): the snapshot holds them as the chain point's forward left them, not as the
    later forwards already run by then did, so the replay is exact."""
    config = CONFIG.replace(model="mobilenetv3-small", epochs=1,
                            options={"chain_replication_every": 3, "partition": (2, 5, 8)})
    run = _Run(config, VirtualClock(),
               CostTable.uniform(15, forward=0.01, backward=0.02, batch=8))

    async def kill(run: _Run) -> None:
        await run.mid_round(0, into=1.5)
        run.tasks[2].cancel()

    result = await run.train(kill)
    assert not isinstance(result, Exception), result
    (recovery,) = run.node.replans
    assert recovery["from_chain"] is True
    resumed = recovery["batches"][0]
    _assert_same(result.model.state_dict(),
                 _reference(config, [[2, 5, 8], recovery["after"]], split=(0, resumed)))


@pytest.mark.slow
async def test_two_workers_killed_at_once_leave_a_two_stage_pipeline() -> None:
    """Devices 1 and 2 killed together: stage 1's chain replicas were on both, so no
    point of the round survived whole, and it is played again from its start."""
    config = CONFIG.replace(options={"chain_replication_every": 3})
    run = _Run(config, VirtualClock())

    async def kill(run: _Run) -> None:
        await run.mid_round(1)
        run.tasks[1].cancel()
        run.tasks[2].cancel()

    result = await run.train(kill)
    assert not isinstance(result, Exception), result
    recoveries = run.node.replans
    assert recoveries[-1]["workers"] == [0, 3]
    cuts = recoveries[-1]["after"]
    assert len(cuts) == 1
    assert recoveries[-1]["from_chain"] is False
    assert recoveries[-1]["batches"] == [0, 10]
    assert result.epochs[1].samples == 80
    _assert_same(result.model.state_dict(), _reference(config, [[1, 2, 3], cuts]))


async def test_a_worker_restarted_at_once_takes_its_stage_in_the_replay() -> None:
    """Device 2 killed and started again at once (the paper's second case): its
    neighbours say their round stopped; the coordinator waits until the old connection is
    given up, by when the new process has said hello, so the round is played again on
    the same four devices with the same cuts (the new process gets its stage's weights
    with the round). It holds no chain replica (it is asked before it has set up): its
    stage's comes from device 3, so the round goes on from its latest chain point."""
    config = CONFIG.replace(options={"chain_replication_every": 3})
    run = _Run(config, VirtualClock())

    async def restart(run: _Run) -> None:
        await run.mid_round(1)
        run.tasks[2].cancel()
        await asyncio.wait([run.tasks[2]])  # (its endpoint closed: the name is free)
        run.tasks[2] = run.group.create_task(run.device(2))

    result = await run.train(restart)
    assert not isinstance(result, Exception), result
    (recovery,) = run.node.replans
    assert recovery["lost"] == []
    assert recovery["workers"] == [0, 1, 2, 3]
    assert recovery["after"] == recovery["before"] == [1, 2, 3]
    assert [e.samples for e in result.epochs] == [80, 80]
    assert run.outcomes[2] is None  # the new process trained to the end
    assert recovery["from_chain"] is True
    _assert_same(result.model.state_dict(),
                 _reference(config, [[1, 2, 3]] * 3, split=(1, recovery["batches"][0])))


@pytest.mark.slow
async def test_a_worker_back_after_the_grace_takes_part_from_the_next_round() -> None:
    """Device 2 killed, and started again only after it was given up: the round is played
    again on devices 0, 1 and 3; the next round (epoch 3) runs on all four again. Device
    0 keeps its units across both changes but not its stage's place in a pipeline of
    another length, so it is sent its weights again (not told to keep them)."""
    config = CONFIG.replace(epochs=3)
    run = _Run(config, VirtualClock())

    async def restart_late(run: _Run) -> None:
        await run.mid_round(1)
        run.tasks[2].cancel()
        await asyncio.wait([run.tasks[2]])
        while run.node.rounds < 3:  # the replay (round 3) has begun without it
            await run.clock.sleep(0.01)
        run.tasks[2] = run.group.create_task(run.device(2))

    result = await run.train(restart_late)
    assert not isinstance(result, Exception), result
    lost, back = run.node.replans
    assert lost["workers"] == [0, 1, 3]
    assert back["workers"] == [0, 1, 2, 3]
    assert [e.samples for e in result.epochs] == [80, 80, 80]
    _assert_same(result.model.state_dict(),
                 _reference(config, [[1, 2, 3], lost["after"], back["after"]]))


async def test_only_the_round_under_way_is_played_again() -> None:
    """Rounds of 4 batches (global replication every 4; 10 batches an epoch: rounds of 4,
    4 and 2): device 2 killed in epoch 2's second round (round 5). The rounds before
    stand; that one is played again by devices 0, 1 and 3 from the weights the one before
    ended with, and the last round keeps their cuts."""
    config = CONFIG.replace(options={"global_replication_every": 4})
    run = _Run(config, VirtualClock())

    async def kill(run: _Run) -> None:
        await run.mid_round(4, into=0.05)
        run.tasks[2].cancel()

    result = await run.train(kill)
    assert not isinstance(result, Exception), result
    (recovery,) = run.node.replans
    assert recovery["round"] == 5  # counted from 1, as the docstring and the log count
    assert recovery["replayed_as"] == 6
    assert [e.samples for e in result.epochs] == [80, 80]
    assert [p["batches"] for p in result.epochs[0].plan] == [4, 4, 4, 4]  # per round
    before, after = [1, 2, 3], recovery["after"]
    _assert_same(result.model.state_dict(),
                 _reference(config, [before] * 4 + [after] * 2))


@pytest.mark.slow
async def test_the_first_re_partition_comes_after_the_first_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """§III-D: with "auto" cuts the run re-partitions first after
    ``first_repartition_after`` batches (here 4; the paper's 10), not at the first global
    replication: device 3, declared alike but really 10x slower, loses units from batch
    5 on. The pipeline flushes there: the run ends with the weights of the reference
    whose first round is split after 4 batches, and every batch counted once."""
    from aiopipe.runtime import device_node as device_module

    honest = device_module.DeviceNode._run_config

    def slow_device_3(self: Any, plan: Any) -> RunConfig:
        config = honest(self, plan)
        return config.replace(device_slowdown=(1.0, 1.0, 1.0, 10.0))

    monkeypatch.setattr(device_module.DeviceNode, "_run_config", slow_device_3)
    config = CONFIG.replace(options={"partition": "auto", "first_repartition_after": 4})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    (change, *later) = result.epochs[0].changes
    assert change["round"] == 1  # the run's first round (counted from 1)
    assert change["after_batches"] == 4
    assert change["before"] != change["after"]
    assert not later  # (epoch 1's end measured no better cuts: no flapping)
    assert [e.samples for e in result.epochs] == [80, 80]
    # the weights: round 1 split after 4 batches, the rest under the new cuts
    rounds = [change["before"], change["after"], change["after"]]
    _assert_same(result.model.state_dict(), _reference(config, rounds, split=(0, 4)))
    slower = await simulate(config.replace(options={"first_repartition_after": 0}),
                            clock=VirtualClock(),
                            cost_table=COSTS)
    assert result.epochs[0].time_s < slower.epochs[0].time_s


async def test_a_re_partition_takes_the_links_as_measured() -> None:
    """§III-B: each worker measures its bandwidth to the next. Declared unshaped ("lan"),
    but device 0's link to device 1 really carries 20 Mbit/s: the first re-partition
    (after 4 batches) knows the link's rate from how long device 0's activations took on
    it, and cuts where stage 0's output is smaller."""
    config = CONFIG.replace(epochs=1,
                            options={"partition": "auto", "first_repartition_after": 4})
    run = _Run(config, VirtualClock(), links={("device0", "device1"): LinkSpec(2e7)})

    async def nothing(run: _Run) -> None:
        return None

    result = await run.train(nothing)
    assert not isinstance(result, Exception), result
    (change,) = result.epochs[0].changes
    first_link, *others = change["link_rates"]
    assert first_link == pytest.approx(2e7 / 8, rel=0.01)
    assert others == [None, None]  # unshaped: nothing to measure
    sizes = run.node.system.planner().sizes
    assert sizes[change["after"][0] - 1] < sizes[change["before"][0] - 1]


async def test_without_device_0_the_run_ends_with_an_error_naming_it() -> None:
    run = _Run(CONFIG, VirtualClock())

    async def kill(run: _Run) -> None:
        await run.mid_round(1)
        run.tasks[0].cancel()

    result = await run.train(kill)
    assert isinstance(result, TrainingError)
    assert "device 0 is gone: it holds the data" in str(result)


def _slow_device_2(monkeypatch: pytest.MonkeyPatch, rounds: set[int] | None) -> None:
    """Device 2 computes 1000x slower in ``rounds`` (every round: None)."""
    from aiopipe.runtime.device_half import DeviceHalf

    honest = DeviceHalf.run_round

    async def run_round(self: Any, message: Any) -> int:
        if self.node.device_id == 2:
            self.node.compute.slowdown = (1000.0 if rounds is None or message.round in rounds
                                          else 1.0)
        return await honest(self, message)

    monkeypatch.setattr(DeviceHalf, "run_round", run_round)


async def test_a_stalled_pipeline_is_timed_out_and_played_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection stays up, but device 2 hangs in round 2: device 0 has waited
    device_timeout for the same gradients (FTPipeHD's timer), stops its round and says
    so; every device is still there, so the round is played again on the same devices
    (the paper's first case), and the run ends where an undisturbed one does."""
    _slow_device_2(monkeypatch, {1})
    run = _Run(CONFIG, VirtualClock())

    async def nothing(run: _Run) -> None:
        return None

    result = await run.train(nothing)
    assert not isinstance(result, Exception), result
    (recovery,) = run.node.replans
    assert "no gradient came within 2 s" in recovery["stopped"]
    assert recovery["lost"] == []
    assert recovery["workers"] == [0, 1, 2, 3]
    _assert_same(result.model.state_dict(), _reference(CONFIG, [[1, 2, 3], [1, 2, 3]]))


async def test_a_round_that_stalls_every_time_ends_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_device_2(monkeypatch, None)
    run = _Run(CONFIG.replace(epochs=1), VirtualClock())

    async def nothing(run: _Run) -> None:
        return None

    result = await run.train(nothing)
    assert isinstance(result, TrainingError)
    assert ("the round of batches 1..10 of epoch 1 stopped 4 times with the same devices"
            in str(result))
    assert "no gradient came within" in str(result)


@pytest.mark.slow
async def test_a_restarted_server_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """FTPipeHD's central node checkpoints to disk (§III-E): the coordinator holds every
    stage's weights and momentum between rounds, so a server killed mid-round and
    started again with ``resume`` plays that round again from the checkpoint, and the
    run ends bit for bit where an undisturbed one does."""
    config = CONFIG.replace(options={"global_replication_every": 4})
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks, cost_table=COSTS, fabric=MemoryFabric(clock))
        fleet.node.checkpoints.directory = tmp_path
        for k in range(4):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 4)  # round 4 (epoch 2's first)
        await clock.sleep(0.1)
        training.cancel()
        for k in range(4):
            fleet.device_links[k].break_("the server process died")
        with contextlib.suppress(asyncio.CancelledError):
            await training
        assert load_checkpoint(tmp_path)[1]["rounds"] == 3  # rounds 0-2; 3 runs again
        fleet.node = Coordinator(config, clock=clock, cost_table=COSTS,
                                 checkpoint_dir=tmp_path, resume=True)
        result = await fleet.node.train()
    await clock.aclose()
    assert [e.samples for e in result.epochs] == [80, 80]
    undisturbed = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    _assert_same(result.model.state_dict(), undisturbed.model.state_dict())
