"""Plans a model cannot train on are refused before training, with one line saying why."""

from __future__ import annotations

import pytest
import torch

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import build_model, check_trainable, train_dataset
from aiopipe.runtime.systems.star.planning import device_plans

#: mobilenetv3-small's maps shrink to 1x1 before a batch norm: it cannot train on one sample
BASE = RunConfig(mode="pipar", model="mobilenetv3-small", devices=2, samples_per_device=16,
                 batch_size=8, epochs=1, split_point=3, parallel_batches=8, test_samples=8,
                 seed=0)


@pytest.mark.slow
async def test_a_run_at_one_sample_per_micro_batch_is_refused_before_it_starts() -> None:
    # before this check, the server's first pass failed and the devices reconnected and
    # resent it, over and over
    with pytest.raises(ConfigError, match=r"mobilenetv3-small cannot train on 1 sample per "
                       r"micro-batch \(device 0: batch_size 8 / parallel_batches 8\): "
                       r"Expected more than 1 value per channel.*use fewer parallel_batches"):
        await simulate(BASE, clock=VirtualClock())


@pytest.mark.parametrize("config", [
    BASE.replace(parallel_batches=(4, 8)),  # the smallest micro-batch is device 1's
    BASE.replace(mode="fl", batch_size=1, parallel_batches=1, samples_per_device=4),  # fl: B
])
def test_the_smallest_micro_batch_of_any_device_is_checked(config: RunConfig) -> None:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    plans = device_plans(config, 15, [config.samples_per_device] * config.devices)
    with pytest.raises(ConfigError, match="cannot train on 1 sample per micro-batch"):
        check_trainable(model, dataset.in_shape, plans, config)


def test_a_trainable_plan_passes_and_leaves_the_model_and_random_state_alone() -> None:
    config = BASE.replace(parallel_batches=4)  # two samples per micro-batch
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    check_trainable(model, dataset.in_shape, device_plans(config, 15, [16, 16]), config)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
