"""Train hooks ([Note: train hooks] in aiopipe.runtime.stage; issue 45, item 2): FedProx's
step is plain SGD on loss + mu/2 ||w - w_global||^2, a run with it trains what plain
PyTorch trains with the term, and a hook of the user's own, named by ``train_hook``,
runs on every stage with the round's settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bench_scripts import load_bench
from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe import data as datasets
from aiopipe.errors import ConfigError
from aiopipe.runtime.factories import cross_entropy
from aiopipe.runtime.plan import device_indices, train_dataset
from aiopipe.runtime.stage import StageWork
from aiopipe.strategies import ProximalHook

BATCH = 10
COSTS = CostTable.uniform(4, forward=0.001, backward=0.002)
MODEL = load_bench("frozen_bases").everything_trained  # four small units


def _work(mu: float) -> tuple[StageWork, nn.Sequential]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    reference = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    reference.load_state_dict(module.state_dict())
    work = StageWork(module, torch.optim.SGD(module.parameters(), lr=0.3, momentum=0.5),
                     first=True, last=True, parallel_batches=2, num_classes=3)
    work.start_round(ProximalHook(mu=0.0), {"proximal_mu": mu})
    return work, reference


def test_a_proximal_step_is_sgd_on_the_loss_plus_the_proximal_term() -> None:
    mu = 0.7
    work, reference = _work(mu)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen))
               for _ in range(6)]  # 3 iterations of 2 micro-batches
    work.batch = lambda i, n: batches[2 * i + n]
    start = [p.detach().clone() for p in reference.parameters()]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.5)
    for i in range(3):
        for n in range(2):
            work.forward(i, n)
            work.backward(i, n)
        work.step()
        optimizer.zero_grad()
        loss = sum(cross_entropy(reference(x), y) for x, y in batches[2 * i:2 * i + 2]) / 2
        proximal = sum((p - s).square().sum() for p, s in zip(reference.parameters(), start,
                                                               strict=True))
        (loss + mu / 2 * proximal).backward()
        optimizer.step()
        for mine, theirs in zip(work.module.parameters(), reference.parameters(),
                                strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    moved = sum(float((p.detach() - s).abs().sum())
                for p, s in zip(work.module.parameters(), start, strict=True))
    assert moved > 0


def _proximal_reference(config: RunConfig, mu: float) -> nn.Module:
    """One device in fl: per epoch (a round), SGD on its batches with the term pulling
    to the epoch's starting weights (a fresh SGD each round: the default
    ``local_optimizer``)."""
    dataset = train_dataset(config)
    torch.manual_seed(config.seed)
    model = MODEL(dataset.num_classes, dataset.in_shape)
    for epoch in range(config.epochs):
        optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                    momentum=config.momentum)
        start = [p.detach().clone() for p in model.parameters()]
        order = datasets.epoch_order(device_indices(config, dataset, 0), epoch=epoch,
                                     seed=config.seed)
        for first in range(0, len(order) - BATCH + 1, BATCH):
            x, y = dataset.batch(order[first:first + BATCH])
            optimizer.zero_grad()
            proximal = sum((p - s).square().sum() for p, s in zip(model.parameters(), start,
                                                                   strict=True))
            (cross_entropy(model(x), y) + mu / 2 * proximal).backward()
            optimizer.step()
    return model


def _config(**changes: object) -> RunConfig:
    base = RunConfig(mode="fl", model=MODEL, devices=1, samples_per_device=4 * BATCH,
                     batch_size=BATCH, epochs=3, split_point=2, parallel_batches=1,
                     learning_rate=0.1, momentum=0.9, test_samples=20, seed=4)
    return base.replace(**changes)


async def test_a_fedprox_run_trains_what_plain_pytorch_trains_with_the_term() -> None:
    mu = 0.5
    config = _config(options={"aggregation": "fedprox", "aggregation_options": {"mu": mu}})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    want = _proximal_reference(config, mu).state_dict()
    got = result.model.state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    plain = (await simulate(_config(), clock=VirtualClock(), cost_table=COSTS)).model
    assert any(not torch.equal(plain.state_dict()[k], got[k]) for k in want)  # the term acts
    assert result.epochs[-1].loss < result.epochs[0].loss


async def test_fedprox_trains_in_pipar_on_both_halves() -> None:
    """Three devices of PiPar: the term on the devices' halves and on the server's
    replicas (a run with mu = 0 is FedAvg's, bit for bit; with mu it differs) and the
    loss falls."""
    config = _config(mode="pipar", devices=3, parallel_batches=2, epochs=3)
    fedavg = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    zero = await simulate(config.replace(options={"aggregation": "fedprox",
                                                  "aggregation_options": {"mu": 0.0}}),
                          clock=VirtualClock(), cost_table=COSTS)
    prox = await simulate(config.replace(options={"aggregation": "fedprox",
                                                  "aggregation_options": {"mu": 1.0}}),
                          clock=VirtualClock(), cost_table=COSTS)
    for key, value in fedavg.model.state_dict().items():
        assert torch.equal(zero.model.state_dict()[key], value), key
    split = config.split_point
    assert isinstance(split, int)
    changed = {key.split(".")[0] for key, value in prox.model.state_dict().items()
               if not torch.equal(fedavg.model.state_dict()[key], value)}
    assert {u for u in changed if int(u) < split}
    assert {u for u in changed if int(u) >= split}
    losses = [e.loss for e in prox.epochs]
    assert losses[-1] < losses[0], losses


#: what `counting_hook`'s hooks saw: (round's settings, stage was last, kept weights)
SEEN: list[tuple[dict[str, object], bool, int]] = []


class _Counting:
    def loss(self, work: StageWork, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def before_step(self, work: StageWork) -> None:
        SEEN.append((dict(work.round_settings), work.last, len(work.round_weights)))
        for p in work.module.parameters():  # clip, as a user's hook might
            if p.grad is not None:
                p.grad.clamp_(-1.0, 1.0)


def counting_hook() -> _Counting:
    """A train hook of the user's own (`train_hook = "module:function"`)."""
    return _Counting()


async def test_a_users_hook_runs_on_every_stage_with_the_rounds_settings() -> None:
    SEEN.clear()
    config = _config(mode="sfl", devices=2, epochs=1, train_hook=f"{__name__}:counting_hook",
                     options={"aggregation": "fedprox", "aggregation_options": {"mu": 0.2}})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert np.isfinite(result.epochs[0].loss)
    steps = 2 * (4 * BATCH // BATCH)  # two devices, four iterations each
    assert len(SEEN) == 2 * steps  # the device's stage and the server's replica
    assert {s[1] for s in SEEN} == {False, True}
    assert all(s[0] == {"proximal_mu": 0.2} and s[2] > 0 for s in SEEN)


def test_a_train_hook_is_refused_where_no_stage_runs_it() -> None:
    with pytest.raises(ConfigError, match=r"config key 'train_hook'.*mode hadfl"):
        RunConfig(mode="hadfl", devices=3, train_hook="aiopipe.strategies:ProximalHook")
    with pytest.raises(ConfigError, match="config key 'train_hook'"):
        RunConfig(mode="fl", train_hook="not a spec")
