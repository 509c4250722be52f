"""Devices train on data of their own; the coordinator plans and weights FedAvg from what
they announce (`Ready`), opens no training data, and refuses a device whose data or
model do not fit the run with one line naming it."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re

import pytest
import torch
from torch import nn

from aiopipe import CostTable, RunConfig, TrainingError, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.errors import AiopipeError, ConfigError
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.runtime.plan import build_model
from aiopipe.transport import open_memory_link_pair

BATCH = 10
COSTS = CostTable.uniform(5, forward=0.001, backward=0.001)


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A user's own map-style dataset: ``count`` learnable 3x32x32 images."""

    def __init__(self, count: int, seed: int, shape: tuple[int, ...] = (3, 32, 32),
                 classes: int = 10) -> None:
        self.classes = [str(c) for c in range(classes)]  # as torchvision's have them
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (count,), generator=generator)
        self.x = torch.randn(count, *shape, generator=generator) + self.labels.view(
            -1, *[1] * len(shape)) * 0.1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.labels[i])


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="fl", model="vgg5", devices=2, batch_size=BATCH, epochs=1,
                     learning_rate=0.05, momentum=0.9, test_samples=20, seed=4)
    return base.replace(**changes)


def _local_training(config: RunConfig, data: Images) -> dict[str, torch.Tensor]:
    """One epoch of plain SGD with momentum on ``data`` in the device's epoch-0 order."""
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    order = datasets.epoch_order(torch.arange(len(data)).numpy(), epoch=0, seed=config.seed)
    for first in range(0, len(data) - BATCH + 1, BATCH):
        batch = order[first:first + BATCH]
        x = torch.stack([data[int(i)][0] for i in batch])
        y = torch.tensor([data[int(i)][1] for i in batch])
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


async def test_fedavg_weights_the_devices_by_the_samples_they_announced() -> None:
    """FL over two devices holding 20 and 60 samples of their own: the global model is
    the 1:3 average of their local trainings, and each trained what it holds."""
    config = _config()
    own = [Images(20, seed=1), Images(60, seed=2)]
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS, datasets=own)
    assert result.final.device_samples == (20, 60)
    want = copy.deepcopy(result.model)
    want.load_state_dict(fedavg([_local_training(config, d) for d in own], [20.0, 60.0]))
    for key, value in want.state_dict().items():
        got = result.model.state_dict()[key]
        assert (got - value).norm() <= 1e-5 * value.norm(), key


async def test_the_plan_follows_the_announced_sizes() -> None:
    """PiPar with unequal own data: iterations per device follow what each holds."""
    config = _config(mode="pipar", split_point=2, parallel_batches=2)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS,
                            datasets=[Images(30, seed=1), Images(55, seed=2)])
    assert result.final.device_samples == (30, 50)  # 3 and 5 whole iterations of 10


async def test_unequal_shards_of_an_emulated_fleet() -> None:
    config = _config(mode="sfl", split_point=2, samples_per_device=[20, 40],
                     dataset="synthetic-cifar10")
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert result.final.device_samples == (20, 40)


@pytest.mark.parametrize(("own", "reason"), [
    (Images(20, seed=3, shape=(1, 28, 28)), r"device 1's data has inputs float32 \(1, 28, 28\), "
                                            r"target int64 \(\) of 10 classes; the run's has "
                                            r"inputs float32 \(3, 32, 32\)"),
    (Images(20, seed=3, classes=12), "device 1's labels range over 12 classes, the run's "
                                     "model has 10"),
])
async def test_a_device_whose_data_does_not_fit_is_refused_with_the_reason(
        own: Images, reason: str) -> None:
    """Device 1's data is not of the run's kind: it is refused with one line naming it;
    the run waits for a device that fits (and gives up after join_timeout)."""
    clock = VirtualClock()
    node = Coordinator(_config(), clock=clock, cost_table=COSTS, join_timeout=30.0)
    outcomes: dict[int, BaseException | None] = {}

    async def device(k: int, data: object) -> None:
        device_end, server_end = open_memory_link_pair(clock)
        serving = asyncio.ensure_future(node.serve_link(server_end))
        try:
            await run_device(device_end, k, clock=clock, clock_offset=0.0, cost_table=COSTS,
                             dataset=datasets.as_dataset(data))
            outcomes[k] = None
        except AiopipeError as exc:
            outcomes[k] = exc
        finally:
            await device_end.aclose()
            with contextlib.suppress(AiopipeError):
                await serving

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(device(0, Images(20, seed=1)))
        tasks.create_task(device(1, own))
        with pytest.raises(TrainingError, match=r"devices \[1\] did not join"):
            await node.train()
    await clock.aclose()
    refused = outcomes[1]
    assert isinstance(refused, TrainingError)
    assert str(refused).startswith("server refused device 1: ")
    assert len(str(refused).splitlines()) == 1
    assert re.search(reason, str(refused)), refused


def test_a_torch_dataset_becomes_a_dataset_with_its_shape_and_classes() -> None:
    data = datasets.as_dataset(Images(7, seed=0))
    assert (len(data), data.in_shape, data.num_classes) == (7, (3, 32, 32), 10)
    x, y = data.batch([6, 0])
    assert x.shape == (2, 3, 32, 32)
    assert x.dtype == torch.float32
    assert y.tolist() == [int(Images(7, seed=0).labels[6]), int(Images(7, seed=0).labels[0])]


def test_a_torch_dataset_of_two_inputs_and_float_targets_is_a_regression_of_two_inputs(
        ) -> None:
    source = [((torch.full((3,), float(i)), torch.arange(2)), torch.tensor([0.5 * i]))
              for i in range(4)]
    data = datasets.as_dataset(source)
    assert (len(data), data.in_shape, data.num_classes) == (4, (3,), 0)
    (a, b), y = data.batch([3, 1])
    assert (a.dtype, b.dtype, y.dtype) == (torch.float32, torch.int64, torch.float32)
    assert a[:, 0].tolist() == [3.0, 1.0]
    assert y.tolist() == [[1.5], [0.5]]
    assert datasets.kind_of(data) == datasets.DataKind(
        (("float32", (3,)), ("int64", (2,))), ("float32", (1,)), 0)


@pytest.mark.parametrize(("source", "reason"), [
    ([], "holds no samples"),
    ([(torch.zeros(2), "cat")], "target 'cat' is neither an integer label nor a tensor"),
    ([(torch.zeros(2), 1), (torch.zeros(3), 0)], r"sample 1 has inputs of shape \[\(3,\)\], "
                                                 r"sample 0 \[\(2,\)\]"),
    ([(torch.zeros(2), torch.zeros(2)), (torch.zeros(2), torch.zeros(3))],
     r"sample 1's target has shape \(3,\), sample 0's \(2,\)"),
    ([(torch.zeros(2), -1)], "label -1 is negative"),
    (3, "expected a map-style dataset"),
])
def test_a_dataset_that_cannot_train_is_refused_with_the_reason(source: object,
                                                                reason: str) -> None:
    def read_all() -> None:
        data = datasets.as_dataset(source)
        data.batch(range(len(data)))

    with pytest.raises(ConfigError, match=reason):
        read_all()


@pytest.mark.parametrize("mode", ["fl", "pipar"])
async def test_devices_evaluate_the_global_model_on_their_own_held_out_data(mode: str) -> None:
    """Federated evaluation: after each epoch every device that holds held-out data
    evaluates the global model on it; the epoch reports the accuracy over all of it and
    per device, exactly what the final model gives on those samples. A device without
    held-out data is not asked."""
    config = _config(mode=mode, epochs=2, split_point=2, parallel_batches=2)
    held = [Images(30, seed=7), None, Images(50, seed=8)]
    result = await simulate(config.replace(devices=3), clock=VirtualClock(), cost_table=COSTS,
                            datasets=[Images(20, seed=k) for k in range(3)], held_out=held)
    model = result.model.eval()
    correct = {}
    with torch.no_grad():
        for k, data in enumerate(held):
            if data is not None:
                correct[k] = int((model(data.x).argmax(1) == data.labels).sum())
    final = result.final
    assert final.device_accuracy == {"0": correct[0] / 30, "2": correct[2] / 50}
    assert final.held_out_accuracy == pytest.approx((correct[0] + correct[2]) / 80)
    assert len(result.epochs[0].device_accuracy) == 2
