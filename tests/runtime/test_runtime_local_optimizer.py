"""[Note: a round's local optimizer]: a device's optimizer starts each round fresh
(textbook FedAvg, the default) or from the state its last round left (``kept``), and
between its rounds a device holds no stage: what it keeps is nothing, or its momentum."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.metrics.results import EpochMetrics
from aiopipe.protocol import RoundStart
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.device_node import DeviceNode
from aiopipe.runtime.plan import build_model, train_dataset
from aiopipe.runtime.sampling import sampled_devices
from aiopipe.runtime.systems.star.replicas import ReplicaPool
from aiopipe.scheduler.costs import CostTable
from tests.plain_training import train_one_epoch

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)
SAMPLES = 20


def _config(local_optimizer: str | None = None, **changes: object) -> RunConfig:
    values: dict[str, object] = {
        "mode": "fl", "model": "vgg5", "dataset": "synthetic-cifar10", "devices": 4,
        "samples_per_device": SAMPLES, "batch_size": 10, "epochs": 3, "test_samples": 20,
        "seed": 3, "learning_rate": 0.05, "momentum": 0.9, "devices_per_round": 2}
    values.update(changes)
    if local_optimizer is not None:
        values["options"] = {"local_optimizer": local_optimizer}
    return RunConfig(**values)  # type: ignore[arg-type]


def _plain_fedavg(config: RunConfig, *, kept: bool) -> nn.Module:
    """FedAvg in plain PyTorch: per epoch (one round), the drawn devices each train a copy
    of the global model on their epoch's batches; the copies averaged by samples. Each
    round's SGD starts fresh (Flower's, the papers'), or, ``kept``, each device's SGD
    (its momentum) carries over from its last round (aiopipe before the option)."""
    data = train_dataset(config)
    model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
    own: dict[int, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for epoch in range(config.epochs):
        drawn = sampled_devices(config.seed, epoch, 0, range(config.devices),
                                config.round_size(config.devices))
        states = []
        for k in drawn:
            if kept and k in own:
                local, optimizer = own[k]
                local.load_state_dict(model.state_dict())
            else:
                local = copy.deepcopy(model)
                optimizer = torch.optim.SGD(local.parameters(), lr=config.learning_rate,
                                            momentum=config.momentum)
                own[k] = (local, optimizer)
            train_one_epoch(local, optimizer, config, k, epoch, config.batch_size)
            states.append({key: v.detach().clone() for key, v in local.state_dict().items()})
        model.load_state_dict(fedavg(states, [SAMPLES] * len(states)))
    return model


def _assert_equal(got: nn.Module, want: nn.Module) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key


@pytest.mark.parametrize("local_optimizer", ["fresh", "kept"])
async def test_fl_equals_plain_pytorch_fedavg_bit_for_bit(local_optimizer: str) -> None:
    config = _config(local_optimizer)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    draws = [list(e.sampled[0]) for e in result.epochs]
    assert len({tuple(d) for d in draws}) > 1  # new draws, and a device drawn again:
    assert len({k for d in draws for k in d}) < 2 * 3  # its optimizer fresh, or kept
    _assert_equal(result.model, _plain_fedavg(config, kept=local_optimizer == "kept"))


async def test_fresh_is_the_default_and_differs_from_kept() -> None:
    assert _config().options.local_optimizer == "fresh"
    fresh = await simulate(_config(), clock=VirtualClock(), cost_table=COSTS)
    kept = await simulate(_config("kept"), clock=VirtualClock(), cost_table=COSTS)
    assert not all(torch.equal(a, b) for a, b in zip(
        fresh.model.state_dict().values(), kept.model.state_dict().values(), strict=True))


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ConfigError, match="local_optimizer"):
        _config("momentum")


def _devices() -> list[DeviceNode]:
    """The device nodes of the run under way (an earlier run's were told goodbye)."""
    gc.collect()
    return sorted((o for o in gc.get_objects() if type(o) is DeviceNode and o.ended is None),
                  key=lambda node: node.device_id)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "local_optimizer"),
                         [("fl", "fresh"), ("fl", "kept"), ("pipar", "fresh"),
                          ("pipar", "kept")])
async def test_between_rounds_a_device_holds_no_stage(mode: str, local_optimizer: str) -> None:
    """After each round: no device holds a stage or an optimizer, nor the round's
    bookkeeping (its assignment, the delivery's pieces and shapes, the round's task:
    ~4 KB a device that has trained, which a population gained with every device that
    trained); one not drawn again holds no round result (it was told it is held); with
    ``kept``, each device that trained holds its optimizer's state alone; the
    coordinator's replicas keep momentum only with ``kept``."""
    config = _config(local_optimizer, mode=mode, devices=6, epochs=4,
                     **({"split_point": 2, "parallel_batches": 2} if mode == "pipar" else {}))
    seen: list[tuple[int, list[tuple[bool, bool, int]]]] = []
    weights: list[int] = []  # the run's round starts with weights alive after each round
    # (round starts alive before the run, such as other tests' module-level samples in
    # the same worker, are not the run's: held here, so that no id is reused)
    earlier = [o for o in gc.get_objects() if type(o) is RoundStart]
    earlier_ids = {id(o) for o in earlier}

    def look(metrics: EpochMetrics) -> None:
        seen.append((metrics.epoch, [(node.work is None, node.holdings.aside is not None,
                                      len(node.reports.unacked)) for node in _devices()]))
        assert all(node.assignment is None and node.round_task is None
                   and node.delivery.assignment is None and not node.delivery.parameters
                   for node in _devices())
        weights.append(sum(1 for o in gc.get_objects()
                           if type(o) is RoundStart and o.tensors and id(o) not in earlier_ids))

    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS, progress=look)
    trained: set[int] = set()
    for (_, nodes), epoch in zip(seen, result.epochs, strict=True):
        (drawn,) = epoch.sampled
        trained.update(drawn)
        assert [held for held, _, _ in nodes] == [True] * 6
        assert [aside for _, aside, _ in nodes] == [
            local_optimizer == "kept" and k in trained for k in range(6)]
        # the round's own devices keep their result until the next round's draw
        assert [n for _, _, n in nodes] == [2 if k in drawn else 0 for k in range(6)]
    assert [len(e.sampled[0]) for e in result.epochs] == [2] * 4
    assert weights == [0] * 4  # (a device's control loop let its round's go)


def test_a_fresh_replica_pool_keeps_no_momentum() -> None:
    model = build_model(_config(), num_classes=10, in_shape=(3, 32, 32))
    config = _config(mode="pipar", split_point=2)
    for keeps in (False, True):
        pool = ReplicaPool(model, "cpu", keeps=keeps)
        half, optimizer = pool.open(0, 2, config)
        sum(p.sum() for p in half.parameters()).backward()
        optimizer.step()
        pool.close([0])
        assert all((m is not None) == keeps for m in pool.momentum(0, 2))


@pytest.mark.parametrize("mode", ["fl", "sfl"])
async def test_the_devices_of_one_split_point_share_one_copy_of_the_round_s_weights(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator copies each split point's half of the global model once a round
    for the RoundStarts, not once per device (at 1,000 devices, 100 a round, a copy each
    was 220 MB of vgg5 held through every round); the run is the same either way."""
    import aiopipe.runtime.systems.star.coordinator as star

    copies: list[int] = []
    real = star.state_to_wire

    def counting(state: dict[str, torch.Tensor]) -> object:
        copies.append(len(state))
        return real(state)

    config = _config(mode=mode, devices_per_round=0, devices=4, epochs=2,
                     **({} if mode == "fl" else {"split_point": 2}))
    before = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    monkeypatch.setattr(star, "state_to_wire", counting)
    after = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert len(copies) == config.epochs  # one a round: every device has the same split
    for (key, a), (_, b) in zip(before.model.state_dict().items(),
                                after.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("mode", ["fl", "sfl"])
async def test_a_device_lets_go_of_the_round_s_weights_once_they_are_loaded(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device's RoundStart's tensors are views into its frame: held through the round
    they kept a second copy of the weights per device in a round (220 MiB for a round of
    100 vgg5 devices); once loaded into the stage they are let go, and the run is the
    same."""
    from aiopipe.runtime.holdings import Holdings

    config = _config(mode=mode, devices=4, devices_per_round=2, epochs=2,
                     **({} if mode == "fl" else {"split_point": 2}))
    before = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    starts: list[Any] = []
    real = Holdings.assign

    def recording(self: Holdings, message: Any, *args: Any, **kwargs: Any) -> Any:
        sent = len(message.tensors)
        out = real(self, message, *args, **kwargs)
        starts.append((sent, dict(message.tensors)))
        return out

    monkeypatch.setattr(Holdings, "assign", recording)
    after = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert len(starts) == 2 * config.epochs  # two devices a round
    assert all(sent > 0 and kept == {} for sent, kept in starts)
    assert before.epochs == after.epochs
    for (key, a), (_, b) in zip(before.model.state_dict().items(),
                                after.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
