"""Differential privacy on the devices (PiPar §5.6.2): classic noise on the uploaded
model half, PixelDP's noise on the training inputs; reproducible by seed."""

from __future__ import annotations

import math

import pytest
import torch
from fleet import COSTS

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.privacy import noisy_inputs, noisy_state, round_generator

CONFIG = RunConfig(mode="fl", model="vgg5", devices=2, samples_per_device=40, batch_size=10,
                   epochs=1, test_samples=0, network="lan")


async def test_classic_noise_reaches_the_global_model_as_fedavg_averages_it() -> None:
    """Two devices each add noise of std sigma to their upload: FedAvg's mean of them
    differs from the noiseless run's by noise of std sigma / sqrt(2); the same seed
    gives the same noise."""
    plain = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    private = CONFIG.replace(options={"privacy": "classic", "privacy_noise": 0.05})
    noisy = await simulate(private, clock=VirtualClock(), cost_table=COSTS)
    again = await simulate(private, clock=VirtualClock(), cost_table=COSTS)
    diffs = torch.cat([(noisy.model.state_dict()[k] - v).reshape(-1)
                       for k, v in plain.model.state_dict().items() if v.is_floating_point()])
    assert math.isclose(float(diffs.std()), 0.05 / math.sqrt(2), rel_tol=0.05)
    for k, v in noisy.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k])


async def test_pixeldp_trains_on_noised_inputs_in_the_split_modes() -> None:
    """PiPar's device forward sees noised inputs: the trained model differs from the
    noiseless run's, reproducibly."""
    config = CONFIG.replace(mode="pipar", split_point=2, parallel_batches=2)
    plain = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    private = config.replace(options={"privacy": "pixeldp", "privacy_noise": 0.5})
    noisy = await simulate(private, clock=VirtualClock(), cost_table=COSTS)
    again = await simulate(private, clock=VirtualClock(), cost_table=COSTS)
    weight = "0.0.weight"
    assert not torch.equal(noisy.model.state_dict()[weight], plain.model.state_dict()[weight])
    assert torch.equal(noisy.model.state_dict()[weight], again.model.state_dict()[weight])


def test_the_noise_has_the_asked_spread_and_leaves_integers_alone() -> None:
    state = {"w": torch.zeros(100_000), "n": torch.tensor(7)}
    out = noisy_state(state, 0.1, round_generator(0, 1, 2))
    assert math.isclose(float(out["w"].std()), 0.1, rel_tol=0.02)
    assert int(out["n"]) == 7
    x = noisy_inputs(torch.ones(100_000), 2.0, round_generator(0, 1, 2))
    assert math.isclose(float(x.mean()), 1.0, abs_tol=0.03)
    assert math.isclose(float(x.std()), 2.0, rel_tol=0.02)
    first = noisy_inputs(torch.zeros(8), 1.0, round_generator(3, 0, 0))
    assert torch.equal(first, noisy_inputs(torch.zeros(8), 1.0, round_generator(3, 0, 0)))
    assert not torch.equal(first, noisy_inputs(torch.zeros(8), 1.0, round_generator(3, 1, 0)))


def test_privacy_is_for_the_star_modes() -> None:
    with pytest.raises(ConfigError, match="privacy"):
        RunConfig(mode="hadfl", options={"privacy": "classic"})
