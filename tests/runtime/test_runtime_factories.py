"""Users' own model, loss and optimizer, named as ``module:function`` (examples/mylab.py):
the run trains what plain PyTorch trains with them; a bad factory is one clear line."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.data import DataKind
from aiopipe.errors import ConfigError
from aiopipe.models import model_digest, unit_count
from aiopipe.runtime import factories
from aiopipe.runtime.factories import (
    build_model,
    make_loss,
    make_optimizer,
    model_template,
    optimizer_states,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BATCH = 16


@pytest.fixture(autouse=True)
def mylab(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="fl", model="mylab:net", loss="mylab:loss", optimizer="mylab:adam",
                     dataset="mylab:data", devices=1, batch_size=BATCH, epochs=1,
                     learning_rate=0.01, test_samples=200, seed=2)
    return base.replace(**changes)


async def test_a_run_with_the_users_model_loss_and_optimizer_equals_plain_pytorch() -> None:
    import mylab  # type: ignore[import-not-found]

    config = _config()
    data = datasets.as_dataset(mylab.data(seed=5))
    result = await simulate(config, clock=VirtualClock(), datasets=[data],
                            cost_table=CostTable.uniform(3, forward=0.001, backward=0.001))
    torch.manual_seed(config.seed)
    model = mylab.net(3, (12,))
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    order = datasets.epoch_order(torch.arange(len(data)).numpy(), epoch=0, seed=config.seed)
    for first in range(0, len(data) - BATCH + 1, BATCH):
        x, y = data.batch(order[first:first + BATCH])
        loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for key, value in model.state_dict().items():
        got = result.model.state_dict()[key]
        assert torch.allclose(got, value, rtol=1e-5, atol=1e-7), key
    assert result.final.accuracy > 0.6


def test_the_factories_build_what_they_name() -> None:
    config = _config()
    model = build_model(config, num_classes=3, in_shape=(12,))
    assert [type(u).__name__ for u in model] == ["Sequential", "Sequential", "Linear"]
    assert model_digest(model) == model_digest(build_model(config, num_classes=3,
                                                           in_shape=(12,)))
    assert model_digest(model) != model_digest(build_model(config, num_classes=4,
                                                           in_shape=(12,)))
    assert isinstance(make_loss(config), torch.nn.CrossEntropyLoss)
    optimizer = make_optimizer(model, config)
    assert isinstance(optimizer, torch.optim.Adam)
    # a stage rebuilt for a new plan keeps each kept parameter's optimizer state
    model(torch.randn(4, 12)).sum().backward()
    optimizer.step()
    again = copy.deepcopy(model)
    moved = make_optimizer(again, config, previous=optimizer_states(model, optimizer))
    first = next(again.parameters())
    assert torch.equal(moved.state[first]["exp_avg"],
                       optimizer.state[next(model.parameters())]["exp_avg"])


@pytest.mark.parametrize(("changes", "reason"), [
    ({"model": "mylab:nothing"}, "model 'mylab:nothing': mylab has no nothing"),
    ({"model": "nolab:net"}, "model 'nolab:net': cannot import nolab"),
    ({"model": "mylab:FEATURES"}, "model 'mylab:FEATURES': FEATURES is not callable"),
    ({"model": "mylab:data"}, "model 'mylab:data' returned TensorDataset"),
    ({"loss": "mylab:net"}, "loss 'mylab:net' failed: TypeError"),
])
def test_a_factory_that_cannot_serve_says_why(changes: dict[str, str], reason: str) -> None:
    config = _config(**changes)

    def build() -> None:
        build_model(config, num_classes=3, in_shape=(12,))
        make_loss(config)

    with pytest.raises(ConfigError, match=reason):
        build()


@pytest.mark.parametrize(("key", "value"), [("model", "my lab:net"), ("loss", "huber"),
                                            ("optimizer", "adam")])
def test_a_malformed_name_is_refused_by_the_config(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        _config(**{key: value})


def test_a_template_is_built_once_and_leaves_the_generator_as_a_build_does() -> None:
    """[Note: shared templates]: one model per (model, seed, shapes) in a process; the
    global generator after each call is where a fresh build would leave it."""
    config = RunConfig(model="vgg5", seed=11)
    first = model_template(config, DataKind.classified((3, 32, 32), 10))
    after_first = torch.get_rng_state()
    torch.rand(5)  # someone draws meanwhile
    second = model_template(config, DataKind.classified((3, 32, 32), 10))
    assert second is first
    assert torch.equal(torch.get_rng_state(), after_first)
    built = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    assert torch.equal(torch.get_rng_state(), after_first)
    assert first.digest == model_digest(built)
    assert first.crossings[0] == (("float32", (3, 32, 32)),)
    assert len(first.crossings) == unit_count(built) + 1
    other = model_template(config.replace(seed=12), DataKind.classified((3, 32, 32), 10))
    assert other is not first
    assert not torch.equal(next(other.model.parameters()), next(first.model.parameters()))


def test_a_users_model_changed_between_runs_gets_a_new_template() -> None:
    model = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)), nn.Linear(4, 2))
    config = RunConfig(model=model, initial_weights="given")  # its own weights count
    first = model_template(config, DataKind.classified((3, 2, 2), 2))
    assert model_template(config, DataKind.classified((3, 2, 2), 2)) is first
    with torch.no_grad():
        model[1].weight.mul_(2.0)  # e.g. weights loaded into it before the next run
    again = model_template(config, DataKind.classified((3, 2, 2), 2))
    assert again is not first
    assert torch.equal(again.model[1].weight, model[1].weight)


def test_templates_built_in_threads_at_once_are_the_seeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes on the system clock open their holdings in their own compute threads: two
    first builds at once must not draw each other's numbers from the global generator."""
    monkeypatch.setattr(factories, "_TEMPLATES", {})
    config = RunConfig(model="vgg5", seed=5)
    start = threading.Barrier(6)
    built: list[Any] = []

    def build() -> None:
        start.wait()
        built.append(model_template(config, DataKind.classified((3, 32, 32), 10)))

    threads = [threading.Thread(target=build) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    want = build_model(config, num_classes=10, in_shape=(3, 32, 32)).state_dict()
    for template in built:
        for name, value in template.model.state_dict().items():
            assert torch.equal(value, want[name]), name
