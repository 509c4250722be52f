"""[Note: sampling per round]: ``devices_per_round`` devices train in each round, drawn
from the seed, epoch and round; only they count, and the draw repeats run after run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.coordinator import _epoch_from
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.sampling import sampled_devices
from aiopipe.runtime.systems.star import between_rounds as star_module
from aiopipe.runtime.systems.star import planning as star_planning
from aiopipe.runtime.systems.star.replicas import ReplicaPool
from aiopipe.scheduler.costs import CostTable

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)


def _config(mode: str, **changes: object) -> RunConfig:
    values: dict[str, object] = {
        "mode": mode, "model": "vgg5", "devices": 6, "samples_per_device": 20,
        "batch_size": 10, "epochs": 3, "test_samples": 20, "devices_per_round": 2}
    if mode in ("sl", "sfl", "pipar"):
        values.update(split_point=2, parallel_batches=2 if mode == "pipar" else 1)
    values.update(changes)
    return RunConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["fl", "sl", "sfl", "pipar"])
async def test_only_the_sampled_devices_train_and_the_draw_repeats(mode: str) -> None:
    config = _config(mode)
    first = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    again = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    draws = [e.sampled for e in first.epochs]
    assert all(len(rounds) == 1 and len(rounds[0]) == 2 for rounds in draws)
    assert len({rounds[0] for rounds in draws}) > 1  # a new draw each round
    for epoch in first.epochs:
        (chosen,) = epoch.sampled
        assert [k for k, n in enumerate(epoch.device_samples) if n] == list(chosen)
        assert epoch.samples == 2 * 20
    assert first.epochs == again.epochs  # draws, samples and times alike
    for (key, a), (_, b) in zip(first.model.state_dict().items(),
                                again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


async def test_the_draw_follows_the_seed_and_each_round() -> None:
    config = _config("fl", aggregation_every=1, epochs=1)  # two rounds in the epoch
    (epoch,) = (await simulate(config, clock=VirtualClock(), cost_table=COSTS)).epochs
    assert [list(r) for r in epoch.sampled] == [sampled_devices(0, 0, r, range(6), 2)
                                                 for r in range(2)]
    draws = {tuple(sampled_devices(seed, 0, 0, range(100), 10)) for seed in range(5)}
    assert len(draws) == 5
    assert sampled_devices(3, 1, 2, [5, 1, 3], 9) == [1, 3, 5]  # all, when too few


async def test_a_fraction_is_rounded_up_and_every_device_trains_without_sampling() -> None:
    config = _config("fl", devices_per_round=0.25, epochs=1)  # ceil(1.5) of 6
    (epoch,) = (await simulate(config, clock=VirtualClock(), cost_table=COSTS)).epochs
    assert len(epoch.sampled[0]) == 2
    (whole,) = (await simulate(config.replace(devices_per_round=0), clock=VirtualClock(),
                               cost_table=COSTS)).epochs
    assert whole.sampled == ()
    assert all(n == 20 for n in whole.device_samples)


async def test_the_draws_are_written_and_read_back() -> None:
    (epoch,) = (await simulate(_config("fl", epochs=1), clock=VirtualClock(),
                               cost_table=COSTS)).epochs
    line = epoch.to_mapping()
    assert line["sampled"] == [list(epoch.sampled[0])]
    assert _epoch_from(line).sampled == epoch.sampled


@pytest.mark.parametrize(("changes", "message"), [
    ({"devices_per_round": 7}, "an integer 1..6"),
    ({"devices_per_round": -1}, "an integer 1..6"),
    ({"devices_per_round": 1.5}, "a fraction in"),
    ({"devices_per_round": "2"}, "a fraction in"),
    ({"devices_per_round": True}, "a fraction in"),
    ({"mode": "ftpipehd", "devices_per_round": 2}, "sampled per round in fl, sl, sfl"),
])
def test_bad_sampling_is_refused_with_the_reason(changes: dict[str, object],
                                                 message: str) -> None:
    values = {"mode": "fl", "devices": 6, **changes}
    with pytest.raises(ConfigError, match=message):
        RunConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["sl", "pipar"])
async def test_only_the_devices_in_a_round_hold_weights(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: replicas while training] and [Note: shared templates]: a server replica
    exists only while its device's round runs, and a device builds its stage only once
    sampled; one never sampled holds no weights."""
    opened: list[int] = []
    most_open = 0
    built: set[int] = set()
    real_open, real_copy = ReplicaPool.open, Holdings.model_copy

    def counting_open(pool: ReplicaPool, device_id: int, *args: Any) -> Any:
        nonlocal most_open
        opened.append(device_id)
        found = real_open(pool, device_id, *args)
        most_open = max(most_open, len(pool))
        return found

    def recording_copy(holdings: Holdings, *args: Any) -> Any:
        built.add(holdings.plan.device_id)
        return real_copy(holdings, *args)

    monkeypatch.setattr(ReplicaPool, "open", counting_open)
    monkeypatch.setattr(Holdings, "model_copy", recording_copy)
    config = _config(mode, devices=8, epochs=3)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    trained = {k for epoch in result.epochs for chosen in epoch.sampled for k in chosen}
    assert set(opened) == trained == built
    assert len(trained) < config.devices  # some were never sampled
    assert most_open == (1 if mode == "sl" else 2)  # sl: one turn at a time


@pytest.mark.slow
async def test_auto_plans_are_made_for_each_rounds_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: plans per round]: with "auto" plans, each round's devices are planned as the
    fleet that shares the server in that round, and train with those plans."""
    planned: list[list[int] | None] = []
    real = star_module.choose_plans

    def spying(config: RunConfig, profile: Any, devices: Any, **options: Any) -> Any:
        members = options.get("members")
        planned.append(None if members is None else list(members))
        chosen = real(config, profile, devices, **options)
        if members is not None:
            rounds.append(dict(zip(members, chosen, strict=True)))
        return chosen

    rounds: list[dict[int, tuple[int, int]]] = []
    monkeypatch.setattr(star_module, "choose_plans", spying)  # each round's
    monkeypatch.setattr(star_planning, "choose_plans", spying)  # the first plans
    config = _config("pipar", devices=8, split_point="auto", parallel_batches="auto",
                     device_slowdown=(1, 1, 4, 4, 1, 1, 4, 4))
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    draws = [list(e.sampled[0]) for e in result.epochs]
    assert None not in planned  # the fleet as a whole is never planned
    assert planned[1:] == draws  # the first plans the first draw (before the run), then
    assert planned[0] == draws[0]  # each round plans its own draw
    for epoch, chosen in zip(result.epochs, rounds[1:], strict=True):
        for entry in epoch.plan:
            if entry["device"] in chosen:
                assert (entry["split_point"], entry["parallel_batches"]) == chosen[
                    entry["device"]]
    again = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert again.epochs == result.epochs
