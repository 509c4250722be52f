"""A user's model that is not an ``nn.Sequential`` (issue 44, item 1, one tensor across
each cut): aiopipe traces it into units (`aiopipe.models.split_units`) and every system
trains it as plain PyTorch trains the model itself."""

from __future__ import annotations

import pytest
import torch
from plain_training import train_in_turns
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.models import unit_count
from aiopipe.runtime.plan import build_model, train_dataset

BATCH = 10
LR = 0.05


class SkipNet(nn.Module):
    """A stem, a body with a skip around it, and a head: ``head(body(y) + y)``. The skip
    ends before the head, so it crosses no cut: units [stem] [body, +] [head]."""

    def __init__(self, num_classes: int, in_shape: tuple[int, ...]) -> None:
        super().__init__()
        features = 1
        for side in in_shape:
            features *= side
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(features, 24), nn.ReLU())
        self.body = nn.Sequential(nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.head(self.body(y) + y)


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="pipar", model=SkipNet, devices=1, samples_per_device=4 * BATCH,
                     batch_size=BATCH, epochs=2, split_point=1, parallel_batches=1,
                     learning_rate=LR, momentum=0.9, test_samples=20, seed=11)
    return base.replace(**changes)


def _plain_pytorch(config: RunConfig) -> dict[str, torch.Tensor]:
    """``SkipNet`` itself (not split) trained by plain SGD on device 0's batches, in its
    epoch order, under the run's seed."""
    dataset = train_dataset(config)
    torch.manual_seed(config.seed)
    model = SkipNet(dataset.num_classes, dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    train_in_turns(model, optimizer, config, [0], BATCH)
    return model.state_dict()


def test_the_model_is_traced_into_units_between_its_children() -> None:
    config = _config()
    dataset = train_dataset(config)
    units = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    assert unit_count(units) == 3


@pytest.mark.parametrize("changes", [
    {},  # pipar: units 0 on the device, 1-2 on the server
    {"mode": "pipeline", "devices": 2, "options": {"partition": [2], "schedule": "1f1b"}},
    {"mode": "asteroid", "devices": 2,
     "options": {"partition": [1], "stage_groups": [[0], [1]]}},
], ids=["pipar", "pipeline-1f1b", "asteroid"])
async def test_a_traced_model_trains_as_plain_pytorch_trains_it(
        changes: dict[str, object]) -> None:
    config = _config(**changes)
    result = await simulate(config, clock=VirtualClock())
    want = _plain_pytorch(config)
    got = {key.partition(".")[2]: value for key, value in result.model.state_dict().items()}
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-7), key


def test_any_module_is_a_model_even_of_one_unit() -> None:
    config = RunConfig(mode="fl", model=nn.Linear(3072, 10), initial_weights="given")
    units = build_model(config, num_classes=10, in_shape=(3072,))
    assert unit_count(units) == 1
    x = torch.randn(2, 3072)
    assert torch.equal(units(x), config.model(x))


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.b(x)


def test_a_model_that_cannot_be_traced_is_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as info:
        build_model(RunConfig(model=Branching(), initial_weights="given"), num_classes=2,
                    in_shape=(4,))
    message = str(info.value)
    assert "\n" not in message
    assert "cannot split Branching: torch.fx cannot trace its forward" in message
