"""A user's model that is not an ``nn.Sequential`` (issue 44, item 1): aiopipe traces it
into units (`aiopipe.models.split_units`), carries what crosses each cut (one tensor,
or several: a skip connection across the cut, a model's second input) and every system
trains it as plain PyTorch trains the model itself."""

from __future__ import annotations

import math

import pytest
import torch
from plain_training import train_in_turns
from torch import nn
from two_views import HALF, TwoViews
from two_views import dataset as two_views

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.models import unit_count
from aiopipe.runtime.plan import build_model, train_dataset

BATCH = 10
LR = 0.05


def _stem(in_shape: tuple[int, ...]) -> nn.Sequential:
    """Flattened inputs to 24 features."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), 24), nn.ReLU())


class SkipNet(nn.Module):
    """A stem, a body with a skip around it, and a head: ``head(body(y) + y)``. The skip
    ends before the head, so it crosses no cut: units [stem] [body, +] [head]."""

    def __init__(self, num_classes: int, in_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.stem = _stem(in_shape)
        self.body = nn.Sequential(nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.head(self.body(y) + y)


class SkipAcross(nn.Module):
    """A skip connection across a cut: ``head(b(a(y)) + y)`` with ``y = stem(x)``; the
    cut before ``b`` carries ``y`` and ``a``'s output. Units [stem] [a] [b, +] [head]."""

    def __init__(self, num_classes: int, in_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.stem = _stem(in_shape)
        self.a = nn.Sequential(nn.Linear(24, 24), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.head(self.b(self.a(y)) + y)


class TwoTowers(nn.Module):
    """Two inputs (`two_views`), a tower each, and a head: the cut after the first tower
    carries its output and the second input. Units [top] [bottom] [head]."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.top = nn.Sequential(nn.Linear(HALF, 16), nn.ReLU())
        self.bottom = nn.Sequential(nn.Linear(HALF, 16), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.top(top), self.bottom(bottom)], 1))


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="pipar", model=SkipNet, devices=1, samples_per_device=4 * BATCH,
                     batch_size=BATCH, epochs=2, split_point=1, parallel_batches=1,
                     learning_rate=LR, momentum=0.9, test_samples=20, seed=11,
                     options={"local_optimizer": "kept"})  # one SGD over the epochs
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


#: How each system runs a model of four units on two devices (pipar: one device and the
#: server), cut at unit ``CUT``: where two values cross
CUT = 2
SYSTEMS = [
    {"split_point": CUT},
    {"mode": "pipeline", "devices": 2, "options": {"partition": [CUT], "schedule": "1f1b"}},
    {"mode": "asteroid", "devices": 2,
     "options": {"partition": [CUT], "stage_groups": [[0], [1]]}},
]
SYSTEM_IDS = ["pipar", "pipeline-1f1b", "asteroid"]


def _trained_plainly(model: nn.Module, config: RunConfig,
                     own: list[TwoViews] | None = None) -> dict[str, torch.Tensor]:
    """``model`` itself (not split) trained by plain SGD on device 0's batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    train_in_turns(model, optimizer, config, [0], BATCH, own)
    return model.state_dict()


def _same_weights(result_model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = {key.partition(".")[2]: value for key, value in result_model.state_dict().items()}
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("changes", SYSTEMS, ids=SYSTEM_IDS)
async def test_a_skip_across_a_cut_trains_as_plain_pytorch_trains_it(
        changes: dict[str, object]) -> None:
    config = _config(model=SkipAcross, **changes)
    dataset = train_dataset(config)
    units = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    assert unit_count(units) == 4
    crossing = units[:CUT](dataset.batch([0, 1])[0])
    assert isinstance(crossing, tuple)
    assert len(crossing) == 2
    result = await simulate(config, clock=VirtualClock())
    torch.manual_seed(config.seed)
    _same_weights(result.model, _trained_plainly(SkipAcross(dataset.num_classes,
                                                            dataset.in_shape), config))


def _two_towers(num_classes: int) -> TwoTowers:
    return TwoTowers(num_classes)


@pytest.mark.parametrize("changes", SYSTEMS, ids=SYSTEM_IDS)
async def test_a_model_of_two_inputs_trains_as_plain_pytorch_trains_it(
        changes: dict[str, object]) -> None:
    config = _config(model=_two_towers, dataset="two_views:dataset", **{
        **changes, "split_point": 1, "options": {
            **changes.get("options", {}), "partition": [1]}} if "options" in changes
        else {"split_point": 1})
    own = [two_views("train", seed=k, size=4 * BATCH) for k in range(config.devices)]
    result = await simulate(config, clock=VirtualClock(), datasets=own)
    torch.manual_seed(config.seed)
    _same_weights(result.model, _trained_plainly(TwoTowers(10), config, own))


#: gpt-tiny's units: embed (and the mask), four blocks, norm, head; the cuts between
#: blocks carry the residual stream and the mask
GPT_UNITS = 7


@pytest.mark.parametrize("changes", [
    {"split_point": 3},
    {"mode": "pipeline", "devices": 2, "options": {"partition": [3], "schedule": "1f1b"}},
    {"mode": "asteroid", "devices": 2,
     "options": {"partition": [3], "stage_groups": [[0], [1]]}},
], ids=SYSTEM_IDS)
async def test_the_zoo_transformer_with_its_mask_trains_as_plain_pytorch_trains_it(
        changes: dict[str, object]) -> None:
    from aiopipe.models.gpt import build_gpt_tiny
    from aiopipe.scheduler.costs import CostTable

    config = _config(model="gpt-tiny", dataset="stdlib-text", samples_per_device=2 * BATCH,
                     epochs=1, momentum=0.0, test_samples=0, **changes)
    dataset = train_dataset(config)
    units = build_model(config, num_classes=256, in_shape=dataset.in_shape)
    assert unit_count(units) == GPT_UNITS
    crossing = units[:3](dataset.batch([0, 1])[0])
    assert [t.dtype for t in crossing] == [torch.bool, torch.float32]  # the mask, the stream
    costs = CostTable.uniform(GPT_UNITS, forward=0.001, backward=0.002, step=0.001, batch=10)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    assert result.epochs[0].loss < math.log(256) + 0.2
    torch.manual_seed(config.seed)
    _same_weights(result.model, _trained_plainly(build_gpt_tiny(256, dataset.in_shape),
                                                 config))


@pytest.mark.slow
async def test_the_zoo_transformer_averages_over_hadfl_rings_and_learns() -> None:
    """gpt-tiny trained whole on three devices' windows, averaged over a ring of all
    three device to device (HADFL): the loss falls and the averages went peer to peer.
    (Between processes, HADFL's rings: tests/test_hadfl_processes.py.)"""
    from aiopipe.scheduler.costs import CostTable

    config = _config(mode="hadfl", model="gpt-tiny", dataset="stdlib-text", devices=3,
                     samples_per_device=4 * BATCH, epochs=3, learning_rate=0.05,
                     test_samples=0, options={"ring_size": 3})
    costs = CostTable.uniform(GPT_UNITS, forward=0.001, backward=0.002, step=0.001, batch=10)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    losses = [e.loss for e in result.epochs]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    rounds = [c for e in result.epochs for c in e.changes if c.get("kind") == "hadfl-round"]
    assert rounds
    assert all(sorted(r["rings"][0]) == [0, 1, 2] for r in rounds), rounds
    assert all(sum(e.peer_bytes) > 0 for e in result.epochs)


class SharedMask(nn.Module):
    """A (T, T) mask made in ``forward`` from the input and given to every block: it
    holds no rows, so it cannot cross a cut between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.new_ones(4, 4).triu()
        return self.b(self.a(x) @ mask) @ mask


def test_a_value_without_the_rows_across_a_cut_is_one_line_saying_what_to_do() -> None:
    from aiopipe.data import DataKind
    from aiopipe.runtime.factories import model_template

    config = RunConfig(model=SharedMask(), initial_weights="given")
    with pytest.raises(ConfigError, match=r"^unit 0 passes on value \d of shape \(4, 4\), "
                                          r"which does not hold the samples' rows first.*"
                                          r"expand a mask to the batch"):
        model_template(config, DataKind.classified((4,), 4))


class ConstantMask(nn.Module):
    """A mask made in ``forward`` from constants alone: fx keeps it as a constant of the
    model, which every unit reads; nothing about it crosses a cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(4, 4).triu()
        return self.b(self.a(x) @ mask) @ mask


def test_a_constant_made_in_forward_is_read_by_every_unit() -> None:
    torch.manual_seed(0)
    model = ConstantMask()
    units = build_model(RunConfig(model=model, initial_weights="given"), num_classes=4,
                        in_shape=(4,))
    assert unit_count(units) == 2
    x = torch.randn(3, 4)
    assert torch.equal(units(x), model(x))
