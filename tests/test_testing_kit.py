"""`aiopipe.testing` as users get it: a fleet with the defaults (a uniform table of the
model's units, links paced as the config's network), the server killed and restarted
from its checkpoint, the plugin's fixture; stalled and slowed links, faults at an
iteration, and the assertions on a result."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from aiopipe import RunConfig, VirtualClock
from aiopipe.clock import SystemClock
from aiopipe.errors import ConfigError
from aiopipe.testing import (
    assert_exact_accounting,
    assert_same_weights,
    expected_samples,
    open_fleet,
    run_undisturbed,
    uniform_costs,
)
from aiopipe.transport import LinkSpec

pytest_plugins = ["aiopipe.testing.plugin"]

CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=10, epochs=2,
                   split_point=2, parallel_batches=2, aggregation_every=2, test_samples=20,
                   network="4g")


@pytest.mark.slow
async def test_a_killed_server_resumes_and_ends_where_an_undisturbed_run_does(
        tmp_path: Path) -> None:
    async with open_fleet(CONFIG) as fleet:
        undisturbed = await fleet.train()
    async with open_fleet(CONFIG, checkpoint_dir=tmp_path) as fleet:
        training = fleet.train()
        await fleet.until(lambda: fleet.node.rounds == 2 and fleet.activations_in(1, 2) > 0)
        fleet.kill_server(training)
        with contextlib.suppress(asyncio.CancelledError):
            await training
        fleet.restart_server()
        result = await fleet.train()
    assert [e.device_samples for e in result.epochs] == [(40, 40)] * 2
    for key, value in undisturbed.model.state_dict().items():
        assert torch.equal(result.model.state_dict()[key], value), key


async def test_the_defaults_follow_the_config(virtual_clock: VirtualClock) -> None:
    async with open_fleet(CONFIG.replace(epochs=1), clock=virtual_clock) as fleet:
        assert fleet.cost_table == uniform_costs(CONFIG)
        assert fleet.cost_table is not None
        assert fleet.cost_table.units == 5  # vgg5's
        result = await fleet.train()
        up = fleet.device_links[0]
    assert result.final.device_samples == (40, 40)
    assert up.spec == CONFIG.device_network(0).up  # 4g's uplink, not a preset wire


async def test_a_restart_without_checkpoints_is_refused() -> None:
    async with open_fleet(CONFIG, start=False) as fleet:
        with pytest.raises(ConfigError, match="checkpoint_dir"):
            fleet.restart_server()


# -- link faults -----------------------------------------------------------------------

@pytest.mark.slow
async def test_a_stall_holds_the_link_for_its_time_and_loses_nothing() -> None:
    undisturbed = await run_undisturbed(CONFIG)
    async with open_fleet(CONFIG) as fleet:
        training = fleet.train()
        await fleet.at_iteration(1, 2)
        link, before, start = fleet.device_links[1], fleet.activations_in(1, 1), fleet.clock.now()
        fleet.stall(1, 2.0, direction="up")
        await fleet.until(lambda: fleet.activations_in(1, 1) > before)
        held = fleet.clock.now() - start
        result = await training
    assert 2.0 <= held <= 2.002  # the next activation arrived when the stall ended
    assert fleet.device_links[1] is link  # no reconnection: the link never failed
    assert fleet.outcomes[1]
    assert all(not isinstance(o, BaseException) for o in fleet.outcomes[1])
    assert_exact_accounting(result)  # nothing lost ...
    assert_same_weights(result, undisturbed)  # ... nor changed
    assert result.epochs[0].time_s > undisturbed.epochs[0].time_s + 1.5  # only later


async def test_a_stall_until_released_in_each_direction() -> None:
    async with open_fleet(CONFIG.replace(epochs=1)) as fleet:
        training = fleet.train()
        await fleet.at_iteration(0, 1)
        fleet.stall(0, direction="down")  # the gradients wait
        device, server = fleet.device_links[0], fleet.server_links[0]
        got = device.statistics().received.frames
        await fleet.clock.sleep(30.0)
        assert device.statistics().received.frames == got  # held ...
        sent = server.statistics().sent.frames
        assert sent > got  # ... though sent
        fleet.release(0)
        await fleet.clock.sleep(0.0)
        await fleet.until(lambda: device.statistics().received.frames >= sent)
        result = await training
    assert result.final.time_s > 30.0
    assert fleet.device_links[0] is device
    assert_exact_accounting(result)
    with pytest.raises(ConfigError, match="direction"):
        fleet.stall(0, direction="sideways")  # type: ignore[arg-type]


async def test_a_stall_longer_than_the_timeout_is_a_silent_device() -> None:
    config = CONFIG.replace(device_timeout=5.0, heartbeat_interval=1.0, reconnect_grace=3.0)
    async with open_fleet(config) as fleet:
        training = fleet.train()
        await fleet.at_iteration(1, 2)
        link = fleet.device_links[1]
        fleet.stall(1, 100.0, direction="up")
        result = await training
    assert fleet.device_links[1] is not link  # given up after 5 s; a new connection
    assert result.epochs[0].time_s < 10.0  # not the stall's 100 s
    assert_exact_accounting(result)  # back within the grace: its round goes on


async def test_a_stall_on_the_system_clock() -> None:
    # 10 iterations: device 1 has more to send when the stall begins
    config = RunConfig(mode="pipar", model=_tiny_model(), devices=2, samples_per_device=100,
                       batch_size=10, epochs=1, split_point=1, parallel_batches=2,
                       test_samples=0, network="lan")
    clock = SystemClock()
    async with open_fleet(config, clock=clock) as fleet:
        training = fleet.train()
        await fleet.until(lambda: fleet.activations_in(1, 1) > 0)
        link, start = fleet.device_links[1], clock.now()
        fleet.stall(1, 0.3)
        assert fleet.activations_in(1, 1) < 20
        result = await training  # device 1's last activations and its result were held
        took = clock.now() - start
    assert took >= 0.29
    assert fleet.device_links[1] is link
    assert_exact_accounting(result)


async def test_slow_stretches_the_wire_time_by_the_factor() -> None:
    config = CONFIG.replace(epochs=1)
    undisturbed = await run_undisturbed(config)
    async with open_fleet(config) as fleet:
        fleet.slow(1, 4.0, direction="up")  # before device 1 connects: its link is born slow
        result = await fleet.train()
        up, down = fleet.device_links[1].statistics().sent, fleet.server_links[1].statistics().sent
    assert up.busy_s == pytest.approx(up.bytes * 8 / 2.5e6)  # 4g's 10 Mbit/s over 4
    assert down.busy_s == pytest.approx(down.bytes * 8 / 25e6)  # the downlink as it was
    assert result.final.time_s > undisturbed.final.time_s
    assert_exact_accounting(result)
    assert_same_weights(result, undisturbed)


async def test_a_slow_link_for_a_while_and_across_reconnections() -> None:
    async with open_fleet(CONFIG.replace(epochs=1)) as fleet:
        training = fleet.train()
        await fleet.at_iteration(1, 2)
        up = fleet.device_links[1]
        normal = up.spec
        fleet.slow(1, 4.0, direction="up", seconds=0.5)
        assert up.spec == LinkSpec(2.5e6, normal.latency_s)
        assert fleet.server_links[1].spec == CONFIG.device_network(1).down  # not down
        await fleet.clock.sleep(0.5)
        assert up.spec == normal  # back after its seconds
        fleet.slow(1, bandwidth_bps=1e6)  # for good, both ways, on new connections too
        fleet.slow(1, bandwidth_bps=0.5e6, direction="up", seconds=1.0)  # and slower a while
        fleet.cut(1)
        await fleet.until(lambda: fleet.device_links[1] is not up)
        assert fleet.device_links[1].spec == LinkSpec(0.5e6, normal.latency_s)
        assert fleet.server_links[1].spec.bandwidth_bps == 1e6
        await fleet.clock.sleep(1.0)
        assert fleet.device_links[1].spec == LinkSpec(1e6, normal.latency_s)
        result = await training
    assert_exact_accounting(result)
    with pytest.raises(ConfigError, match="either"):
        fleet.slow(1)
    with pytest.raises(ConfigError, match="positive"):
        fleet.slow(1, 0.0)


async def test_slowing_an_unshaped_link_needs_a_rate() -> None:
    async with open_fleet(CONFIG, start=False, wire=LinkSpec(None)) as fleet:
        with pytest.raises(ConfigError, match="unshaped"):
            fleet.slow(0, 2.0)
        fleet.slow(0, bandwidth_bps=1e6, direction="down")
        device_end, server_end = fleet.connect(0)
        assert server_end.spec == LinkSpec(1e6)
        assert device_end.spec == LinkSpec(None)
        await device_end.aclose()
        with pytest.raises(ConfigError, match="no link"):
            fleet.stall(1)


# -- faults at an iteration -------------------------------------------------------------

async def test_at_iteration_fires_at_that_iterations_first_activation() -> None:
    # 4 iterations an epoch, rounds of 2: iteration 4 is the second of round 2 (all
    # numbered from 1; the session's window and keys are the protocol's, from 0)
    async with open_fleet(CONFIG) as fleet:
        training = fleet.train()
        await fleet.at_iteration(1, 4)
        session = fleet.node.sessions[1]
        assert session.window is not None
        assert session.window.first_iteration == 2
        assert sorted(key for key in session.seen if key[1] == 3) == [(0, 3, 0)]
        fleet.kill(1)
        fleet.start_device(1)
        with pytest.raises(AssertionError, match="past iteration 2 of epoch 1"):
            await fleet.at_iteration(0, 2)
        await fleet.at_iteration(1, 1, epoch=2)  # back in the next epoch
        result = await training
    assert [e.device_samples for e in result.epochs] == [(40, 20), (40, 40)]
    assert_exact_accounting(result, lost={1: [(1, 2)]})  # epoch 1's round 2


async def test_at_iteration_needs_activations() -> None:
    async with open_fleet(CONFIG.replace(mode="fl"), start=False) as fleet:
        with pytest.raises(ConfigError, match="fl"):
            await fleet.at_iteration(0, 1)


async def test_at_iteration_counts_from_1() -> None:
    async with open_fleet(CONFIG, start=False) as fleet:
        with pytest.raises(ConfigError, match="count from 1"):
            await fleet.at_iteration(0, 0)
        with pytest.raises(ConfigError, match="count from 1"):
            await fleet.at_iteration(0, 1, epoch=0)


# -- assertions on the result -----------------------------------------------------------

async def test_exact_accounting_follows_plans_and_sampled_rounds() -> None:
    # unequal shares, N not dividing B, a device per round drawn from three
    config = RunConfig(mode="pipar", devices=3, samples_per_device=(40, 30, 25), batch_size=10,
                       epochs=2, split_point=2, parallel_batches=(2, 3, 2), aggregation_every=1,
                       test_samples=0, devices_per_round=1, network="lan")
    result = await run_undisturbed(config)
    assert_exact_accounting(result)
    first = result.epochs[0]
    assert first.sampled
    assert len(first.sampled) == 4  # the longest share: 4 iterations
    # device 1 trains micro-batches of 3: 9 a round, for 3 rounds; its rounds as sampled
    assert expected_samples(config, first, 1) == 9 * sum(
        1 in members for members in first.sampled[:3])
    assert expected_samples(config, first, 1, lost=range(1, 5)) == 0  # rounds 1 to 4
    # round 1 lost: device 1 counts what the other rounds it was drawn for train
    assert expected_samples(config, first, 1, lost=[1]) == 9 * sum(
        1 in members for members in first.sampled[1:3])


async def test_exact_accounting_says_what_differs() -> None:
    result = await run_undisturbed(CONFIG)
    first = result.epochs[0]
    wrong = [dataclasses.replace(first, device_samples=(40, 30), samples=70)]
    with pytest.raises(AssertionError,
                       match=r"epoch 1: device 1 counted 30 samples, expected 40"):
        assert_exact_accounting(dataclasses.replace(result, epochs=wrong))
    wrong = [dataclasses.replace(first, samples=60)]
    with pytest.raises(AssertionError, match=r"samples is 60, the devices' sum 80"):
        assert_exact_accounting(dataclasses.replace(result, epochs=wrong))
    with pytest.raises(AssertionError, match=r"device 0 counted 40 samples, expected 20 \(its "
                                             r"plan trains 40 in its rounds, less round\(s\) "
                                             r"\[2\] it lost\)"):
        assert_exact_accounting(result, lost={0: [(1, 2)]})
    wrong = [dataclasses.replace(first, devices_lost=(1,))]
    with pytest.raises(AssertionError, match=r"devices_lost names \[1\]"):
        assert_exact_accounting(dataclasses.replace(result, epochs=wrong))
    with pytest.raises(ConfigError, match="round 3 of epoch 1"):
        assert_exact_accounting(result, lost={0: [(1, 3)]})
    with pytest.raises(ConfigError, match="round 1 of epoch 0"):  # epochs count from 1
        assert_exact_accounting(result, lost={0: [(0, 1)]})
    with pytest.raises(ConfigError, match="round 0 of epoch 1"):  # rounds too
        assert_exact_accounting(result, lost={0: [(1, 0)]})
    with pytest.raises(ConfigError, match="device 5"):
        assert_exact_accounting(result, lost={5: [(1, 1)]})
    with pytest.raises(ConfigError, match="hadfl"):
        assert_exact_accounting(dataclasses.replace(result, config=CONFIG.replace(
            mode="hadfl", aggregation_every=0, split_point=1,
            options={"local_steps": 1, "warmup_epochs": 0})))


async def test_same_weights_names_what_differs() -> None:
    result = await run_undisturbed(CONFIG.replace(epochs=1))
    assert_same_weights(result, result.model)
    other = copy.deepcopy(result.model)
    key, tensor = next(iter(other.state_dict().items()))
    with torch.no_grad():
        tensor.view(-1)[0] += 0.5
    with pytest.raises(AssertionError, match=rf"{key}: 1 of {tensor.numel()} values differ, "
                                             r"by up to 0\.5"):
        assert_same_weights(other, result)
    assert_same_weights(other, result, atol=0.6)
    fewer = nn.Sequential(*list(other.children())[:-1])
    with pytest.raises(AssertionError, match="only in the second"):
        assert_same_weights(fewer, result)


def _tiny_model() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.ReLU()),
                         nn.Linear(16, 10))
