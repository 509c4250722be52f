"""`aiopipe.testing` as users get it: a fleet with the defaults (a uniform table of the
model's units, links paced as the config's network), the server killed and restarted
from its checkpoint, and the plugin's fixture."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from aiopipe import RunConfig, VirtualClock
from aiopipe.errors import ConfigError
from aiopipe.testing import open_fleet, uniform_costs

pytest_plugins = ["aiopipe.testing.plugin"]

CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=10, epochs=2,
                   split_point=2, parallel_batches=2, aggregation_every=2, test_samples=20,
                   network="4g")


async def test_a_killed_server_resumes_and_ends_where_an_undisturbed_run_does(
        tmp_path: Path) -> None:
    async with open_fleet(CONFIG) as fleet:
        undisturbed = await fleet.train()
    async with open_fleet(CONFIG, checkpoint_dir=tmp_path) as fleet:
        training = fleet.train()
        await fleet.until(lambda: fleet.node.rounds == 2 and fleet.activations_in(1, 1) > 0)
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
    assert up._out.spec == CONFIG.device_network(0).up  # 4g's uplink, not a preset wire


async def test_a_restart_without_checkpoints_is_refused() -> None:
    async with open_fleet(CONFIG, start=False) as fleet:
        with pytest.raises(ConfigError, match="checkpoint_dir"):
            fleet.restart_server()
