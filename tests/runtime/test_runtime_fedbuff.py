"""FedBuff: the server buffer's update rule against hand-computed values, one device
with a buffer of one as plain SGD, and devices of unequal speed in virtual time."""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fleet import COSTS, suite_fleet, vgg5_shaped

from aiopipe import RunConfig, RunResult, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.errors import ConfigError
from aiopipe.runtime.factories import build_model, make_loss, make_optimizer
from aiopipe.runtime.plan import device_data
from aiopipe.runtime.systems.fedbuff.buffer import ServerBuffer, delta_of, staleness_weight
from aiopipe.testing import open_fleet

BATCH = 16


def _config(**changes: Any) -> RunConfig:
    values: dict[str, Any] = {
        "mode": "fedbuff", "model": vgg5_shaped, "devices": 3, "batch_size": BATCH,
        "samples_per_device": 4 * BATCH, "epochs": 2, "test_samples": 64,
        "network": "wifi", "learning_rate": 0.05}
    values.update(changes)
    return RunConfig(**values)


def _epochs(result: RunResult) -> list[dict[str, Any]]:
    return [c for e in result.epochs for c in e.changes if c.get("kind") == "fedbuff-epoch"]


def test_staleness_weights() -> None:
    assert staleness_weight(0, "sqrt") == 1.0
    assert staleness_weight(3, "sqrt") == 0.5
    assert staleness_weight(7, "none") == 1.0
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(-1, "sqrt")


def test_the_buffer_applies_every_k_arrivals_by_the_papers_rule() -> None:
    """Three devices, K = 2, eta_g = 0.5: A and B start at version 0 and arrive (tau 0):
    w1 = w0 + 0.5/2 (dA + dB); C, started at version 0, arrives after that update
    (tau 1, weight 1/sqrt 2), then A again from version 1 (tau 0):
    w2 = w1 + 0.5/2 (dC / sqrt 2 + dA'). An integer tensor takes the newest value."""
    w0 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    buffer = ServerBuffer(2, 0.5, "sqrt")
    d_a = delta_of({"w": torch.tensor([2.0, 2.0]), "n": torch.tensor(4)}, w0)
    d_b = delta_of({"w": torch.tensor([1.0, 4.0]), "n": torch.tensor(5)}, w0)
    assert not buffer.add(d_a, 0)
    assert buffer.add(d_b, 0)
    w1 = buffer.apply(w0)
    assert buffer.version == 1
    assert not buffer.entries
    assert torch.allclose(w1["w"], torch.tensor([1.25, 2.5]))
    assert int(w1["n"]) == 5
    d_c = {"w": torch.tensor([2.0, 2.0], dtype=torch.float64)}  # started at version 0
    d_a2 = {"w": torch.tensor([-1.0, 1.0], dtype=torch.float64)}  # started at version 1
    assert not buffer.add(d_c, 0)
    assert buffer.add(d_a2, 1)
    assert buffer.taus == [1, 0]
    w2 = buffer.apply(w1)
    s = 1 / math.sqrt(2)
    expected = torch.tensor([1.25 + 0.25 * (2 * s - 1), 2.5 + 0.25 * (2 * s + 1)])
    assert torch.allclose(w2["w"], expected, atol=1e-7)
    assert w2["w"].dtype == torch.float32
    assert int(w2["n"]) == 5
    assert buffer.version == 2


def test_arrivals_past_the_kth_wait_for_the_next_update() -> None:
    """Three arrivals before the server gets to apply (real time: an update computes
    while others arrive): the update takes the first K = 2, the third waits."""
    w0 = {"w": torch.tensor([0.0])}
    buffer = ServerBuffer(2, 1.0, "none")
    for value in (1.0, 3.0, 10.0):
        buffer.add({"w": torch.tensor([value], dtype=torch.float64)}, 0)
    assert buffer.full
    w1 = buffer.apply(w0)
    assert torch.equal(w1["w"], torch.tensor([2.0]))  # (1 + 3) / 2
    assert not buffer.full
    assert buffer.taus == [0]
    assert buffer.version == 1


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="'staleness'"):
        _config(options={"staleness": "linear"})
    with pytest.raises(ConfigError, match="'devices_per_round'"):
        _config(devices_per_round=2)
    assert _config(options={"buffer_size": 2}).options.buffer_size == 2


def _plain_sgd(config: RunConfig, epochs: int) -> torch.nn.Module:
    """Plain PyTorch: one device, its data in each epoch's order, one SGD step a batch."""
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    optimizer = make_optimizer(model, config)
    loss = make_loss(config)
    data = device_data(config, 0)
    for epoch in range(epochs):
        order = datasets.epoch_order(np.arange(len(data)), epoch=epoch, seed=config.seed)
        for j in range(len(data) // BATCH):
            x, y = data.batch(order[j * BATCH:(j + 1) * BATCH])
            loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model


async def test_one_device_with_a_buffer_of_one_is_plain_sgd() -> None:
    """K = 1, eta_g = 1, one device: every delta is applied as it arrives (staleness
    0), so the server's model is what Q steps of plain SGD at a time train."""
    config = _config(devices=1, epochs=2, momentum=0.0,
                     options={"buffer_size": 1, "local_steps": 2,
                              "server_learning_rate": 1.0})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    epochs = _epochs(result)
    assert [e["version"] for e in epochs] == [2, 4]  # 4 batches / (K Q) an epoch
    assert all(t == 0 for e in epochs for t in e["staleness"][0])
    reference = _plain_sgd(config, 2)
    for name, value in reference.state_dict().items():
        assert torch.allclose(result.model.state_dict()[name], value, atol=1e-6), name


@pytest.mark.slow
async def test_fast_devices_contribute_more_and_the_loss_falls() -> None:
    """Slowdowns 1, 2, 10 in virtual time: every device trains at its own pace, the
    fast ones' deltas are more of the updates, the slow one's arrive stale; the run
    finishes and its training loss falls."""
    config = _config(epochs=4, device_slowdown=(1, 2, 10), samples_per_device=8 * BATCH,
                     options={"buffer_size": 2, "local_steps": 2})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    epochs = _epochs(result)
    assert len(result.epochs) == 4
    rounds = [sum(e["rounds"][k] for e in epochs) for k in range(3)]
    assert rounds[0] > rounds[1] > rounds[2] >= 1, rounds
    assert max(t for e in epochs for t in e["staleness"][2]) >= 1  # the slow one is stale
    assert epochs[-1]["version"] >= 4 * math.ceil(3 * 8 / 4)
    assert result.epochs[-1].loss < result.epochs[0].loss
    samples = [sum(e.device_samples[k] for e in result.epochs) for k in range(3)]
    assert samples[0] > samples[2]


@pytest.mark.slow
async def test_a_lost_device_s_round_is_dropped_and_the_others_go_on() -> None:
    """Device 2 killed in the middle of epoch 2: its round under way is dropped, the two
    others finish the epoch's updates without it; restarted, it trains again from the
    next epoch on."""
    config = _config(epochs=4, heartbeat_interval=0.5, device_timeout=2.0,
                     reconnect_grace=1.0, options={"buffer_size": 2, "local_steps": 2})
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: len(fleet.node.epochs) == 1)
        await clock.sleep(0.01)
        fleet.kill(2)
        await fleet.until(lambda: len(fleet.node.epochs) == 2)
        fleet.start_device(2)
        result = await training
    await clock.aclose()
    assert not fleet.crashes
    epochs = _epochs(result)
    assert len(result.epochs) == 4
    assert 2 in result.epochs[1].devices_lost
    assert epochs[1]["version"] >= 2 * math.ceil(12 / 4)  # the others made the updates
    assert epochs[-1]["rounds"][2] >= 1  # back
    assert all(math.isfinite(e.loss) for e in result.epochs)


@pytest.mark.slow
async def test_concurrency_trains_a_few_devices_at_a_time_drawn_from_all() -> None:
    """Six devices, two at a time ([Note: FedBuff concurrency]): never more than two
    train at once, every device is drawn over the run, and the same config draws the
    same devices (virtual time)."""
    config = _config(devices=6, epochs=2, samples_per_device=2 * BATCH,
                     options={"buffer_size": 2, "local_steps": 1, "concurrency": 2})
    first = _epochs(await simulate(config, clock=VirtualClock(), cost_table=COSTS))
    again = _epochs(await simulate(config, clock=VirtualClock(), cost_table=COSTS))
    assert [e["most_at_once"] for e in first] == [2, 2]
    rounds = [sum(e["rounds"][k] for e in first) for k in range(6)]
    assert all(r >= 1 for r in rounds), rounds
    assert sum(rounds) >= first[-1]["version"] * 2  # K = 2 deltas an update
    assert [e["rounds"] for e in again] == [e["rounds"] for e in first]
    every = _epochs(await simulate(
        _config(devices=6, epochs=2, samples_per_device=2 * BATCH,
                options={"buffer_size": 2, "local_steps": 1}),
        clock=VirtualClock(), cost_table=COSTS))
    assert [e["most_at_once"] for e in every] == [6, 6]
    with pytest.raises(ConfigError, match="'concurrency'"):
        _config(options={"concurrency": 4})  # (3 devices)


@pytest.mark.slow
async def test_a_killed_server_resumes_at_its_epoch_and_ends_where_an_undisturbed_run_does(
        tmp_path: Path) -> None:
    """The server killed in epoch 2 of 3, restarted from its checkpoint of epoch 1:
    the model, the version and the deltas left in the buffer come back, and the run
    ends with the undisturbed run's model (virtual time, same costs)."""
    config = _config(epochs=3, momentum=0.0, device_slowdown=(1, 2, 3),
                     options={"buffer_size": 3, "local_steps": 2})
    async with open_fleet(config, cost_table=COSTS) as fleet:
        undisturbed = await fleet.train()
    assert _epochs(undisturbed)[0]["buffered"] == 2  # (two deltas wait in the checkpoint)
    async with open_fleet(config, cost_table=COSTS, checkpoint_dir=tmp_path) as fleet:
        training = fleet.train()
        await fleet.until(lambda: len(fleet.node.epochs) == 1 and fleet.node.rounds > 1)
        fleet.kill_server(training)
        with contextlib.suppress(asyncio.CancelledError):
            await training
        fleet.restart_server()
        result = await fleet.train()
    assert len(result.epochs) == 3
    assert _epochs(result)[-1]["version"] == _epochs(undisturbed)[-1]["version"]
    for key, value in undisturbed.model.state_dict().items():
        assert torch.equal(result.model.state_dict()[key], value), key
