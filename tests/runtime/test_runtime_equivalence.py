"""Split training computes what unsplit training computes (PiPar §4.2, Eq. 26).

Each test runs the real runtime (server and devices over memory links, real codec) for
exactly one iteration and compares the resulting global model with an independent
computation on the unsplit model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.plan import build_model, device_indices, train_dataset

BATCH = 20
LR = 0.1


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="pipar", model="vgg5", dataset="synthetic-cifar10", devices=1,
                     samples_per_device=BATCH, batch_size=BATCH, epochs=1, split_point=2,
                     parallel_batches=1, learning_rate=LR, test_samples=50, seed=7, momentum=0.0)
    return base.replace(**changes)


def _reference_step(config: RunConfig, device_id: int, samples: int) -> nn.Sequential:
    """One plain SGD step of the whole model on the first ``samples`` of the device's
    epoch-0 order, with the mean loss over them."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    order = datasets.epoch_order(device_indices(config, dataset, device_id), epoch=0,
                                 seed=config.seed)
    x, y = dataset.batch(order[:samples])
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return model


def _assert_same_weights(got: nn.Module, want: nn.Module, *, rtol: float = 1e-5) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    initial = build_model(_config(), num_classes=10, in_shape=(3, 32, 32)).state_dict()
    for key in want_state:
        diff = (got_state[key] - want_state[key]).norm()
        scale = want_state[key].norm()
        assert diff <= rtol * scale, f"{key}: relative difference {diff / scale:.2e}"
        # the step really moved the weights, so the comparison means something
        assert not torch.equal(want_state[key], initial[key]) or "bias" in key


@pytest.mark.parametrize("n", [1, 2, 4, 5])
async def test_pipar_iteration_equals_unsplit_step(n: int) -> None:
    config = _config(parallel_batches=n)
    result = await simulate(config, clock=VirtualClock())
    assert result.final.samples == BATCH
    _assert_same_weights(result.model, _reference_step(config, 0, BATCH))


@pytest.mark.parametrize("split_point", [1, 3, 4])
async def test_equivalence_holds_at_every_split_point(split_point: int) -> None:
    config = _config(parallel_batches=4, split_point=split_point)
    result = await simulate(config, clock=VirtualClock())
    _assert_same_weights(result.model, _reference_step(config, 0, BATCH))


async def test_sfl_and_fl_match_their_definitions() -> None:
    for mode in ("sfl", "fl"):
        config = _config(mode=mode, devices=2, samples_per_device=BATCH)
        result = await simulate(config, clock=VirtualClock())
        # FedAvg of two independent full-batch steps, equal sample counts
        steps = [_reference_step(config, k, BATCH) for k in range(2)]
        want = copy.deepcopy(steps[0])
        want.load_state_dict(fedavg([m.state_dict() for m in steps], [BATCH, BATCH]))
        _assert_same_weights(result.model, want)


async def test_sl_passes_weights_from_device_to_device() -> None:
    config = _config(mode="sl", devices=2)
    result = await simulate(config, clock=VirtualClock())
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for k in range(2):  # device 0's step, then device 1's step from those weights
        order = datasets.epoch_order(device_indices(config, dataset, k), epoch=0,
                                     seed=config.seed)
        x, y = dataset.batch(order[:BATCH])
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    _assert_same_weights(result.model, model)


async def test_aggregation_every_iteration_averages_between_steps() -> None:
    """aggregation_every=1: FedAvg after each iteration, so the devices' second steps
    start from the average of their first ones (SFL, two devices, two iterations)."""
    config = _config(mode="sfl", devices=2, samples_per_device=2 * BATCH, aggregation_every=1)
    result = await simulate(config, clock=VirtualClock())
    assert len(result.epochs) == 1
    assert result.final.samples == 4 * BATCH
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    orders = [datasets.epoch_order(device_indices(config, dataset, k), epoch=0, seed=config.seed)
              for k in range(2)]
    for iteration in range(2):
        states = []
        for k in range(2):
            local = copy.deepcopy(model)
            x, y = dataset.batch(orders[k][iteration * BATCH:(iteration + 1) * BATCH])
            nn.functional.cross_entropy(local(x), y).backward()
            torch.optim.SGD(local.parameters(), lr=LR).step()
            states.append(local.state_dict())
        model.load_state_dict(fedavg(states, [BATCH, BATCH]))
    _assert_same_weights(result.model, model)
