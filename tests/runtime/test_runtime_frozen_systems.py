"""Frozen bases in the pipeline (1F1B), FTPipeHD, Asteroid and HADFL (issue 44, item 4;
[Note: frozen bases] in aiopipe/runtime/systems/star/coordinator.py): parameters with
``requires_grad`` false are never stepped and travel nowhere (round states, results,
chain replicas, stage backups, group gradients, ring chunks), so they come back bit for
bit and each epoch's traffic falls by at least their bytes; and each system trains what
its reference trains with the same layers frozen (plain PyTorch; FTPipeHD's rules in
batch order, tests/runtime/async_reference.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from async_reference import delayed_sgd
from bench_scripts import load_bench
from plain_training import train_in_turns

from aiopipe import CostTable, RunConfig, RunResult, VirtualClock, models, simulate
from aiopipe import data as datasets
from aiopipe.metrics.epoch import EpochMetrics
from aiopipe.runtime.factories import make_loss, make_optimizer
from aiopipe.runtime.groups import gradients_of
from aiopipe.runtime.memory import state_bytes
from aiopipe.runtime.plan import (
    build_model,
    device_data,
    device_indices,
    model_profile,
    train_dataset,
)
from aiopipe.runtime.systems.ftpipehd.options import FTPipeHDOptions
from aiopipe.scheduler.asteroid import HppModel

BATCH = 10
COSTS = CostTable.uniform(4, forward=0.001, backward=0.002)
#: four units, the first two frozen: the model bench/frozen_bases.py measures
BENCH = load_bench("frozen_bases")
FROZEN_UNITS = ("0.", "1.")

#: per system, a run that exercises what it moves: the pipeline's stages and momentum,
#: FTPipeHD's chain replicas, Asteroid's group all-reduce (a group whose stage holds a
#: frozen unit and trained ones) and stage backups, HADFL's ring of every device
SYSTEMS: dict[str, dict[str, Any]] = {
    "pipeline-1f1b": {"mode": "pipeline", "options": {"partition": [2], "schedule": "1f1b"}},
    "ftpipehd": {"mode": "ftpipehd", "parallel_batches": 1,
                 "options": {"partition": [2], "chain_replication_every": 2}},
    "asteroid": {"mode": "asteroid", "devices": 3,
                 "options": {"partition": [1], "stage_groups": [[0], [1, 2]],
                             "chain_replication_every": 2}},
    "hadfl": {"mode": "hadfl", "devices": 3, "parallel_batches": 1,
              "options": {"warmup_epochs": 0, "local_steps": 2, "ring_size": 3}},
}


def _config(system: str, **changes: Any) -> RunConfig:
    base = RunConfig(mode="fl", model=BENCH.frozen_base, devices=2,
                     samples_per_device=4 * BATCH, batch_size=BATCH, epochs=2,
                     parallel_batches=2, learning_rate=0.05, momentum=0.9, test_samples=20,
                     seed=4)
    return base.replace(**{**SYSTEMS[system], **changes})


def _initial(config: RunConfig) -> dict[str, torch.Tensor]:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _frozen_bytes(initial: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for k, v in initial.items()
               if k.startswith(FROZEN_UNITS))


def _saved(mine: EpochMetrics, theirs: EpochMetrics) -> tuple[int, int, int]:
    """Bytes up, down and between devices that an epoch with the frozen base moved
    fewer than the same epoch with everything trained."""
    return (theirs.bytes_up - mine.bytes_up, theirs.bytes_down - mine.bytes_down,
            sum(theirs.peer_bytes) - sum(mine.peer_bytes))


#: per system, how many times the frozen bytes an epoch saves at least (up, down,
#: between devices): the pipeline's stage 0 goes down and up with its momentum;
#: FTPipeHD's too, and its first round's chain replica (the second epoch's stages keep
#: their weights: nothing goes down); Asteroid's stages go down and up without momentum,
#: stage 0's backup goes to its backup node with momentum, and the group all-reduces
#: unit 1's gradients no more; HADFL's sender backs its model up once an epoch, and a
#: ring of three moves 4/3 of the vector per member in each of its two rounds
AT_LEAST = {"pipeline-1f1b": [(2, 2, 0), (2, 2, 0)],
            "ftpipehd": [(2, 2, 2), (2, 0, 2)],
            "asteroid": [(1, 1, 2), (1, 1, 2)],
            "hadfl": [(1, 0, 8), (1, 0, 8)]}


@pytest.mark.parametrize("system", list(SYSTEMS))
async def test_a_frozen_base_stays_bit_for_bit_and_does_not_travel(system: str) -> None:
    config = _config(system)
    frozen = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    initial = _initial(config)
    got = frozen.model.state_dict()
    for key, value in initial.items():
        if key.startswith(FROZEN_UNITS):
            assert torch.equal(got[key], value), key
        else:
            assert not torch.equal(got[key], value), key  # the head trained
    everything = await simulate(config.replace(model=BENCH.everything_trained),
                                clock=VirtualClock(), cost_table=COSTS)
    size = _frozen_bytes(initial)
    for epoch, (mine, theirs, least) in enumerate(zip(frozen.epochs, everything.epochs,
                                                      AT_LEAST[system], strict=True)):
        for saved, times, what in zip(_saved(mine, theirs), least, ("up", "down", "peer"),
                                      strict=True):
            assert saved >= times * size, (epoch, what, saved, size)


def _plain_pytorch(config: RunConfig) -> dict[str, torch.Tensor]:
    """The model trained by plain SGD on device 0's batches in its epoch order, the same
    layers frozen."""
    dataset = train_dataset(config)
    torch.manual_seed(config.seed)
    model = BENCH.frozen_base(dataset.num_classes, dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    train_in_turns(model, optimizer, config, [0], BATCH)
    return model.state_dict()


def _assert_close(result: RunResult, want: dict[str, torch.Tensor]) -> None:
    got = result.model.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("system", ["pipeline-1f1b", "asteroid"])
async def test_a_frozen_base_trains_as_plain_pytorch(system: str) -> None:
    config = _config(system)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    _assert_close(result, _plain_pytorch(config))


async def test_ftpipehd_with_a_frozen_base_computes_what_its_rules_define() -> None:
    """FTPipeHD's rules in batch order (weight stashing, vertical sync, aggregation,
    momentum) on the trainable parameters alone; the frozen ones are constants."""
    config = _config("ftpipehd", options={"partition": [1], "version_aggregation": 2,
                                          "chain_replication_every": 2})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    options = config.options_as(FTPipeHDOptions)
    assert isinstance(options.partition, tuple)
    stages = models.partition(model, list(options.partition))
    epochs = []
    for epoch in range(config.epochs):
        order = datasets.epoch_order(device_indices(config, dataset, 0), epoch=epoch,
                                     seed=config.seed)
        epochs.append([dataset.batch(order[b * BATCH:(b + 1) * BATCH])
                       for b in range(len(order) // BATCH)])
    final = delayed_sgd(stages, epochs, lr=config.learning_rate, momentum=config.momentum,
                        every=options.version_aggregation)
    with torch.no_grad():
        for stage, weights in zip(stages, final, strict=True):
            for name, param in stage.named_parameters():
                if param.requires_grad:
                    param.copy_(weights[name])
    _assert_close(result, model.state_dict())


async def test_hadfl_with_a_frozen_base_averages_what_plain_pytorch_trains() -> None:
    """Every device in the ring, two local steps a round: plain PyTorch on each device's
    data, then the mean of the three models; the frozen units as they began."""
    config = _config("hadfl")
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    dataset = train_dataset(config)
    nets = [build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
            for _ in range(config.devices)]
    optimizers = [make_optimizer(net, config) for net in nets]
    loss = make_loss(config)
    data = [device_data(config, d) for d in range(config.devices)]
    steps = [0] * config.devices
    batches = len(data[0]) // BATCH
    for _ in range(config.epochs * batches // 2):  # rounds of two steps
        for d, net in enumerate(nets):
            for _ in range(2):
                epoch, j = divmod(steps[d], batches)
                order = datasets.epoch_order(np.arange(len(data[d])), epoch=epoch,
                                             seed=config.seed)
                x, y = data[d].batch(order[j * BATCH:(j + 1) * BATCH])
                loss(net(x), y).backward()
                optimizers[d].step()
                optimizers[d].zero_grad(set_to_none=True)
                steps[d] += 1
        with torch.no_grad():
            states = [net.state_dict() for net in nets]
            mean = {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}
            for net in nets:
                for name, param in net.named_parameters():
                    if param.requires_grad:
                        param.copy_(mean[name])
    _assert_close(result, nets[0].state_dict())
    initial = _initial(config)
    for key in initial:
        if key.startswith(FROZEN_UNITS):
            assert torch.equal(result.model.state_dict()[key], initial[key]), key


def test_asteroid_counts_no_gradient_nor_optimizer_state_for_frozen_parameters() -> None:
    """Asteroid's Eq. 3 (the planner's memory) and the measured `state_bytes` count a
    frozen parameter's weights but no gradient and no momentum for it, and a group
    all-reduces the trainable parameters' gradients alone."""
    config = _config("asteroid")
    dataset = train_dataset(config)
    nets = {name: build_model(config.replace(model=factory), num_classes=dataset.num_classes,
                              in_shape=dataset.in_shape)
            for name, factory in (("frozen", BENCH.frozen_base),
                                  ("full", BENCH.everything_trained))}
    size = _frozen_bytes({k: v for k, v in nets["frozen"].state_dict().items()})
    hpp = {name: HppModel.of(model_profile(net, dataset.in_shape, COSTS))
           for name, net in nets.items()}
    assert hpp["full"].memory(0, 4, 5, 2) - hpp["frozen"].memory(0, 4, 5, 2) == 2 * size
    assert hpp["full"].stage_gradients(0, 4) - hpp["frozen"].stage_gradients(0, 4) == size
    assert hpp["full"].stage_weights(0, 4) == hpp["frozen"].stage_weights(0, 4)
    measured = {}
    for name, net in nets.items():
        optimizer = make_optimizer(net, config)
        x, y = dataset.batch(range(BATCH))
        make_loss(config)(net(x), y).backward()
        optimizer.step()
        measured[name] = state_bytes(net, optimizer)
        sent = gradients_of(net)
        assert set(sent) == {k for k, p in net.named_parameters() if p.requires_grad}
    assert measured["full"] - measured["frozen"] == 2 * size
