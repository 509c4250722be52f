"""Server checkpoints on the system clock ([Note: background checkpoints]): the state is
copied when the next round has started (a traced "ckpt" slice, while the devices work)
and written while training goes on; one write in flight; a failed write raises; the last
checkpoint is whole when training returns; replica weights equal to the global model's
are not stored twice."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fleet import suite_fleet

from aiopipe import RunConfig, SystemClock
from aiopipe.errors import TrainingError
from aiopipe.metrics.results import RunResult
from aiopipe.runtime import checkpoint as checkpoint_module
from aiopipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.systems.star.coordinator import Star
from aiopipe.testing import joined

# (replicas keep their momentum between rounds: what checkpoints must hold; with the
# default, "fresh", they keep nothing: [Note: a round's local optimizer])
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=20, epochs=2,
                   split_point=2, parallel_batches=2, aggregation_every=1, test_samples=20,
                   network={"up_mbps": 1000, "down_mbps": 1000, "latency_ms": 0},
                   options={"local_optimizer": "kept"})


def real_node(tmp_path: Path, config: RunConfig = CONFIG) -> Coordinator:
    """A server on the system clock with real compute (no cost table), planned for its
    devices as if they had joined."""
    node = Coordinator(config, clock=SystemClock(), checkpoint_dir=tmp_path)
    node.system.prepare([config.device_samples_of(k) for k in range(config.devices)])
    return node


async def save(node: Coordinator, epoch: int, next_round: int) -> None:
    """Checkpoint as the coordinator does after a round (``next_round`` 0: an epoch)."""
    await node.checkpoints.save(node._checkpoint_meta(epoch, next_round, 0.0),
                                epoch if next_round else epoch - 1)


def write_now(node: Coordinator, directory: Path) -> None:
    """Write a checkpoint at once, in this thread."""
    save_checkpoint(directory, node.system.checkpoint_tensors(),
                    node._checkpoint_meta(0, 1, 0.0))


async def train(tmp_path: Path) -> RunResult:
    """Train CONFIG with 2 devices over memory links, checkpointing to ``tmp_path``."""
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(CONFIG, SystemClock(), tasks, cost_table=None)
        fleet.node = real_node(tmp_path)
        for k in range(2):
            fleet.start_device(k)
        return await fleet.node.train()


async def test_the_round_does_not_wait_for_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, started = threading.Event(), threading.Event()

    def slow_save(directory: Path, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any]) -> Path:
        started.set()
        assert release.wait(30), "the test never released the write"
        return save_checkpoint(directory, tensors, meta)

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", slow_save)
    node = real_node(tmp_path)
    # the weights change after the copy was taken: the checkpoint holds the copy
    before = {k: v.clone() for k, v in node.model.state_dict().items()}
    await save(node, 0, 1)
    node.checkpoints.copy()  # as when the next round starts; the write is blocked
    assert await asyncio.to_thread(started.wait, 30)
    with torch.no_grad():
        for p in node.model.parameters():
            p.add_(1.0)
    release.set()
    await node.checkpoints.written()
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["tally"]["next_round"] == 1
    for k, v in before.items():
        torch.testing.assert_close(tensors[f"model/{k}"], v, rtol=0, atol=0)


async def test_the_tally_is_saved_as_it_was_at_the_round_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow_save(directory: Path, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any]) -> Path:
        assert release.wait(30), "the test never released the write"
        return save_checkpoint(directory, tensors, meta)

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", slow_save)
    node = real_node(tmp_path)
    node._tally = {"epoch": 0, "next_round": 1, "device_samples": [20, 20], "loss_sum": 1.0,
                   "correct": 3, "lost": [], "elapsed_before": 0.0}
    await save(node, 0, 1)
    node.checkpoints.copy()
    node._tally["device_samples"][0] += 20  # the next round ends while the file is written
    node._tally["lost"].append(1)
    release.set()
    await node.checkpoints.written()
    _, meta = load_checkpoint(tmp_path)
    assert meta["tally"]["device_samples"] == [20, 20]
    assert meta["tally"]["lost"] == []


async def test_one_write_in_flight_and_a_failed_write_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    running = threading.Lock()

    def failing_save(directory: Path, tensors: dict[str, torch.Tensor],
                     meta: dict[str, Any]) -> Path:
        assert running.acquire(blocking=False), "two writes at once"
        try:
            calls.append(meta["tally"]["next_round"])
            raise OSError("disk full")
        finally:
            running.release()

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", failing_save)
    node = real_node(tmp_path)
    await save(node, 0, 1)
    with pytest.raises(OSError, match="disk full"):
        await save(node, 0, 2)  # waits for the first write, which failed
    assert calls == [1]


@pytest.mark.slow
async def test_training_returns_with_its_last_checkpoint_written(tmp_path: Path) -> None:
    result = await train(tmp_path)
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["epoch"] == CONFIG.epochs
    assert meta["rounds"] == 4
    # 2 rounds per epoch: after the first, and after each epoch (not its last round too);
    # each copy is traced on the server's compute track
    copies = [s for s in result.trace if s.name == "ckpt"]
    assert [s.epoch for s in copies] == [0, 0, 1, 1]
    assert {s.track for s in copies} == {"server/compute"}
    assert len(meta["epochs"]) == len(result.epochs)
    # after each aggregation every replica equals the global model: stored once
    assert not [name for name in tensors if name.startswith("replica/")]
    assert [name for name in tensors if name.startswith("momentum/")]
    resumed = await joined(Coordinator(CONFIG, clock=SystemClock(), checkpoint_dir=tmp_path,
                                       resume=True))
    assert resumed.rounds == 4
    whole = result.model.state_dict()
    for k, plan in enumerate(resumed.system.plans):  # each replica's momentum, restored
        momentum = resumed.system.replicas.momentum(k, plan.split_point)
        assert all(m is not None for m in momentum)
        for i, buffer in enumerate(momentum):
            torch.testing.assert_close(buffer, tensors[f"momentum/{k}/{i}"], rtol=0, atol=0)
        half, _ = resumed.system.replicas.open(k, plan.split_point, resumed.system.config)
        for name, value in half.state_dict().items():  # a round starts from the model
            torch.testing.assert_close(value, whole[name], rtol=0, atol=0)


@pytest.mark.slow  # (about 2 s)
async def test_the_copy_runs_while_the_devices_start_the_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = Star.checkpoint_tensors

    def slow_copy(system: Star) -> dict[str, torch.Tensor]:
        time.sleep(0.3)  # a deep model's replicas and momentum
        return copy(system)

    monkeypatch.setattr(Star, "checkpoint_tensors", slow_copy)
    result = await train(tmp_path)
    copies = sorted((s for s in result.trace if s.name == "ckpt"), key=lambda s: s.start)
    assert len(copies) == 4
    for ckpt in copies[:-1]:  # the last one is made when training ends
        later = [s for s in result.trace if s.start >= ckpt.start]
        # the devices had their RoundStart: their forward passes ran during the copy ...
        assert [s for s in later if s.track.startswith("device") and s.name == "f"
                and s.start < ckpt.end]
        # ... and the server's work of the round came after it (it saves the old state)
        assert all(s.start >= ckpt.end for s in later
                   if s.track == "server/compute" and s is not ckpt)
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["epoch"] == CONFIG.epochs
    whole = result.model.state_dict()
    for k, v in whole.items():
        torch.testing.assert_close(tensors[f"model/{k}"], v, rtol=0, atol=0)


async def test_a_pending_copy_is_saved_when_no_round_can_start(tmp_path: Path) -> None:
    node = Coordinator(CONFIG, clock=SystemClock(), checkpoint_dir=tmp_path,
                      join_timeout=0.05)
    await save(node, 1, 0)
    with pytest.raises(TrainingError, match="every device was lost"):
        await node._participants()  # nobody there: waits, but not with the copy
    await node.checkpoints.written()
    _, meta = load_checkpoint(tmp_path)
    assert meta["epoch"] == 1


def test_a_replica_starts_every_round_from_the_global_model(tmp_path: Path) -> None:
    """A replica left with weights of its own (a round that ended without aggregation)
    is not kept: the device's next round starts from the global model, and checkpoints
    store no replica weights."""
    node = real_node(tmp_path)
    system = node.system
    half, _ = system.replicas.open(1, 2, system.config)
    with torch.no_grad():
        for p in half.parameters():
            p.mul_(2.0)
    system.replicas.close([1])
    assert 1 not in system.replicas
    write_now(node, tmp_path)
    tensors, _ = load_checkpoint(tmp_path)
    assert not any(name.startswith("replica/") for name in tensors)
    again, _ = system.replicas.open(1, 2, system.config)
    whole = system.model.state_dict()
    for name, value in again.state_dict().items():
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0)


def test_only_the_devices_in_a_round_hold_replicas(tmp_path: Path) -> None:
    """[Note: replicas while training]: none before a round, one per device in it, none
    after it; what a replica keeps between rounds is its momentum."""
    node = real_node(tmp_path)
    system = node.system
    assert len(system.replicas) == 0
    system._prepare(0)
    assert 0 in system.replicas
    assert len(system.replicas) == 1
    half, optimizer = system.replicas[0]
    for p in half.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    system.replicas.close([0])
    assert len(system.replicas) == 0
    momentum = system.replicas.momentum(0, system.plans[0].split_point)
    assert momentum
    assert all(m is not None and torch.equal(m, torch.ones_like(m)) for m in momentum)
    assert system.replicas.momentum(1, system.plans[1].split_point) == [None] * len(momentum)


async def test_a_dropped_rounds_replica_optimizer_goes_back_to_the_rounds_start(
        tmp_path: Path) -> None:
    """Device 1's round is dropped after its replica stepped: the replica's optimizer
    (its momentum) is as it was when the round started, so the round leaves no trace."""
    node = await joined(Coordinator(CONFIG, clock=SystemClock(), checkpoint_dir=tmp_path))
    system = node.system
    p1 = system.plans[1].split_point
    system._prepare(1)  # an earlier round left momentum behind
    half, optimizer = system.replicas[1]
    for p in half.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    system.replicas.close([1])
    before = [m.clone() for m in system.replicas.momentum(1, p1) if m is not None]
    system._prepare(1)  # the round starts
    half, optimizer = system.replicas[1]
    for p in half.parameters():  # ... and the replica steps in it
        p.grad = torch.full_like(p, 3.0)
    optimizer.step()
    assert not torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], before[0])
    system.replicas.roll_back([1])  # the device was lost: its round is dropped
    after = system.replicas.momentum(1, p1)
    assert len(after) == len(before)
    for was, now in zip(before, after, strict=True):
        assert now is not None
        assert torch.equal(now, was)


def test_with_fresh_optimizers_no_replica_keeps_momentum(tmp_path: Path) -> None:
    node = real_node(tmp_path, CONFIG.replace(options={"local_optimizer": "fresh"}))
    system = node.system
    system._prepare(0)
    half, optimizer = system.replicas[0]
    for p in half.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    system.replicas.close([0])
    assert set(system.replicas.momentum(0, system.plans[0].split_point)) == {None}
    write_now(node, tmp_path)
    tensors, _ = load_checkpoint(tmp_path)
    assert not [name for name in tensors if name.startswith("momentum/")]
