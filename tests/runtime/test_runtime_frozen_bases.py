"""Frozen bases in fl, sl, sfl and pipar ([Note: frozen bases] in
aiopipe/runtime/systems/star/coordinator.py; issue 44, item 4): parameters with
``requires_grad`` false never travel, never change (bit for bit, through FedAvg), and the
run trains what plain PyTorch trains with the same layers frozen."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench
from plain_training import train_in_turns

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.runtime.plan import build_model, train_dataset

BATCH = 10
COSTS = CostTable.uniform(4, forward=0.001, backward=0.002)


#: four units, the first two frozen (a pretrained base under a trained head): the
#: model bench/frozen_bases.py measures
BENCH = load_bench("frozen_bases")
frozen_base = BENCH.frozen_base


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="fl", model=frozen_base, devices=1, samples_per_device=4 * BATCH,
                     batch_size=BATCH, epochs=2, split_point=2, parallel_batches=1,
                     learning_rate=0.05, momentum=0.9, test_samples=20, seed=4)
    return base.replace(**changes)


def _initial(config: RunConfig) -> dict[str, torch.Tensor]:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    return {k: v.clone() for k, v in model.state_dict().items()}


async def test_a_frozen_base_trains_as_plain_pytorch_and_stays_bit_for_bit() -> None:
    config = _config(options={"local_optimizer": "kept"})  # one SGD over both epochs
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    dataset = train_dataset(config)
    torch.manual_seed(config.seed)
    model = frozen_base(dataset.num_classes, dataset.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    train_in_turns(model, optimizer, config, [0], BATCH)
    got = result.model.state_dict()
    for key, value in model.state_dict().items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-7), key
    initial = _initial(config)
    for key in ("0.1.weight", "0.1.bias", "1.0.weight", "1.0.bias"):
        assert torch.equal(got[key], initial[key]), key


@pytest.mark.parametrize("mode", ["fl", "sfl", "pipar"])
async def test_frozen_parameters_do_not_travel_and_fedavg_does_not_round_them(
        mode: str) -> None:
    """Three devices of unequal shares: the frozen units come back bit for bit through
    FedAvg, and each epoch's traffic, both ways, is smaller than the same run's with
    nothing frozen by at least the frozen parameters' bytes a device."""
    config = _config(mode=mode, devices=3, parallel_batches=2,
                     samples_per_device=(40, 30, 70))
    frozen = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    initial = _initial(config)
    got = frozen.model.state_dict()
    for key in ("0.1.weight", "0.1.bias", "1.0.weight", "1.0.bias"):
        assert torch.equal(got[key], initial[key]), key

    everything = await simulate(config.replace(model=BENCH.everything_trained),
                                clock=VirtualClock(),
                                cost_table=COSTS)
    frozen_bytes = sum(v.numel() * v.element_size() for k, v in initial.items()
                       if k.startswith(("0.", "1.")))
    for mine, theirs in zip(frozen.epochs, everything.epochs, strict=True):
        # each device's round: its half down and up, both without the frozen units
        saved = (theirs.bytes_up - mine.bytes_up, theirs.bytes_down - mine.bytes_down)
        for fewer in saved:
            assert fewer >= 3 * frozen_bytes, (fewer, frozen_bytes)
