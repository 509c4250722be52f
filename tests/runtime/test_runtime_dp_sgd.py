"""DP-SGD on the devices (aiopipe.runtime.dp_sgd, issue 45 item 5): a step is plain
PyTorch's per-sample gradients, clipped, summed, noised with the round's generator and
divided by the batch, on a whole model and on a device's half whose gradients come
from the server, with PiPar's micro-batches, and Opacus's own DPOptimizer's step;
runs in fl, sl, sfl and pipar report each device's epsilon as Opacus's accountant gives
it for the same noise, rate and steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from aiopipe import CostTable, RunConfig, SystemClock, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.checkpoint import save_checkpoint
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.factories import cross_entropy
from aiopipe.runtime.privacy import round_generator
from aiopipe.runtime.systems.star.coordinator import Star
from aiopipe.testing import joined

accountants = pytest.importorskip("opacus.accountants")
from aiopipe.runtime.dp_sgd import DpSgdWork  # noqa: E402 (needs Opacus)

COSTS = CostTable.uniform(3, forward=0.001, backward=0.002)
SEED, DEVICE, ROUND = 11, 1, 3
B_MICRO, N = 4, 2  # micro-batch rows, micro-batches an iteration


def mlp(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Three small units, nothing batch norm would make non-private."""
    features = math.prod(in_shape)
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 16), nn.ReLU()),
                         nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
                         nn.Linear(16, num_classes))


def _batches(iterations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(B_MICRO, 5, generator=gen), torch.randint(0, 3, (B_MICRO,),
                                                                   generator=gen))
            for _ in range(iterations * N)]


def _dp_work(module: nn.Sequential, *, clip: float, sigma: float, last: bool = True
             ) -> DpSgdWork:
    work = DpSgdWork(module, torch.optim.SGD(module.parameters(), lr=0.3, momentum=0.5),
                     noise_multiplier=sigma, max_grad_norm=clip, seed=SEED,
                     device_id=DEVICE, first=True, last=last, parallel_batches=N,
                     num_classes=3)
    work.begin_round(ROUND, B_MICRO * N)
    return work


def _dp_step(params: list[nn.Parameter], per_sample: list[list[torch.Tensor]], clip: float,
             sigma: float, generator: torch.Generator) -> None:
    """Plain PyTorch's DP-SGD gradient: per sample, one norm over ``params``, clipped
    by min(1, C / (norm + 1e-6)), summed, N(0, (sigma C)^2) added in the parameters'
    order, divided by the batch."""
    total = [torch.zeros_like(p) for p in params]
    for grads in per_sample:
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for t, g in zip(total, grads, strict=True):
            t += factor * g
    for p, t in zip(params, total, strict=True):
        noise = torch.randn(p.shape, generator=generator)
        p.grad = (t + sigma * clip * noise) / len(per_sample)


def _whole_reference(reference: nn.Sequential, batches: list, clip: float, sigma: float
                     ) -> None:
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.5)
    generator = round_generator(SEED, DEVICE, ROUND)
    params = list(reference.parameters())
    for i in range(len(batches) // N):
        per_sample = []
        for x, y in batches[i * N:(i + 1) * N]:
            for row in range(B_MICRO):
                loss = cross_entropy(reference(x[row:row + 1]), y[row:row + 1])
                per_sample.append(list(torch.autograd.grad(loss, params)))
        _dp_step(params, per_sample, clip, sigma, generator)
        optimizer.step()


@pytest.mark.parametrize("clip", [0.2, 1e6])
def test_a_whole_models_step_is_plain_pytorchs_dp_sgd(clip: float) -> None:
    """Micro-batches in PiPar's order (F0 F1 B0 B1): each backward gets its own
    micro-batch's per-sample gradients ([Note: micro-batches and Opacus's stack])."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    reference = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    reference.load_state_dict(module.state_dict())
    work = _dp_work(module, clip=clip, sigma=0.7)
    batches = _batches(3)
    work.batch = lambda i, n: batches[N * i + n]
    for i in range(3):
        for n in range(N):
            work.forward(i, n)
        for n in range(N):
            work.backward(i, n)
        work.step()
    _whole_reference(reference, batches, clip, 0.7)
    for mine, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert work.steps == 3
    assert (work.clipped > 0) == (clip < 1)  # a small norm does clip ...
    if clip < 1:  # ... and skipping the clipping would train something else
        unclipped = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        torch.manual_seed(0)
        unclipped.load_state_dict(nn.Sequential(nn.Linear(5, 6), nn.Tanh(),
                                                nn.Linear(6, 3)).state_dict())
        _whole_reference(unclipped, batches, 1e6, 0.7)
        assert not torch.allclose(unclipped[0].weight, module[0].weight, atol=1e-4)


def test_a_device_halfs_step_clips_the_per_sample_gradients_the_server_sends() -> None:
    """sfl / pipar: the device's half never sees the loss; its per-sample gradients come
    through the activation gradient (the micro-batch's mean loss / N)."""
    torch.manual_seed(1)
    device = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
    server = nn.Linear(6, 3)
    reference = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
    reference.load_state_dict(device.state_dict())
    work = _dp_work(device, clip=0.1, sigma=1.5, last=False)
    batches = _batches(1)
    work.batch = lambda i, n: batches[n]
    sent = [work.forward(0, n) for n in range(N)]
    for n, out in enumerate(sent):
        assert out is not None
        activation = out[0][0].detach().requires_grad_()
        (cross_entropy(server(activation), out[1]) / N).backward()
        assert activation.grad is not None
        work.backward(0, n, (activation.grad,))
    work.step()
    params = list(reference.parameters())
    per_sample = []
    for x, y in batches:
        for row in range(B_MICRO):
            loss = cross_entropy(server(reference(x[row:row + 1])), y[row:row + 1])
            per_sample.append(list(torch.autograd.grad(loss, params)))
    _dp_step(params, per_sample, 0.1, 1.5, round_generator(SEED, DEVICE, ROUND))
    torch.optim.SGD(params, lr=0.3, momentum=0.5).step()
    for mine, theirs in zip(device.parameters(), params, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert work.clipped == B_MICRO * N


def test_batch_norm_is_refused_with_opacus_reason() -> None:
    module = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match="BatchNorm cannot support training with "
                                          "differential privacy"):
        _dp_work(module, clip=1.0, sigma=1.0)


def _direct_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    """What Opacus's RDP accountant says when stepped by hand."""
    accountant = accountants.RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=rate)
    return float(accountant.get_epsilon(delta))


CONFIG = RunConfig(mode="fl", model=mlp, dataset="synthetic-mnist", devices=2,
                   samples_per_device=40, batch_size=10, epochs=2, test_samples=20,
                   learning_rate=0.1, seed=3,
                   options={"privacy": "dp-sgd", "dp_noise_multiplier": 1.1,
                            "dp_max_grad_norm": 0.5, "dp_delta": 1e-4})


@pytest.mark.parametrize("changes", [
    {"mode": "fl"},
    pytest.param({"mode": "sl", "split_point": 1}, marks=pytest.mark.slow),  # (about 2 s
    pytest.param({"mode": "sfl", "split_point": 2}, marks=pytest.mark.slow),  # each on a
    pytest.param({"mode": "pipar", "split_point": 1, "parallel_batches": 2},  # loaded
                 marks=pytest.mark.slow),  # machine)
], ids=["fl", "sl", "sfl", "pipar"])
async def test_each_devices_epsilon_is_the_accountants_for_its_noise_rate_and_steps(
        changes: dict[str, object]) -> None:
    config = CONFIG.replace(**changes)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    steps_per_epoch = 40 // 10
    for epoch, m in enumerate(result.epochs, start=1):
        want = _direct_epsilon(1.1, 10 / 40, steps_per_epoch * epoch, 1e-4)
        assert m.device_epsilon.keys() == {"0", "1"}
        for value in m.device_epsilon.values():
            assert math.isclose(value, want, rel_tol=1e-9)
        assert m.epsilon == max(m.device_epsilon.values())
        assert (m.delta, m.privacy_unit) == (1e-4, "sample")
    assert math.isfinite(result.final.loss)


@pytest.mark.slow  # (three trainings)
async def test_a_dp_sgd_run_is_reproducible_and_noised() -> None:
    config = CONFIG.replace(mode="sfl", split_point=1, epochs=1)
    first = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    again = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    plain = await simulate(config.replace(options={"privacy": "none"}), clock=VirtualClock(),
                           cost_table=COSTS)
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key])
    assert not torch.equal(first.model.state_dict()["0.1.weight"],
                           plain.model.state_dict()["0.1.weight"])
    # the server's half in sfl is not trained by DP-SGD, but it trained
    assert not torch.equal(first.model.state_dict()["2.weight"],
                           plain.model.state_dict()["2.weight"])


async def test_a_model_with_batch_norm_is_refused_before_devices_train() -> None:
    def with_batch_norm(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
        return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), 8),
                                           nn.BatchNorm1d(8)), nn.Linear(8, num_classes))

    with pytest.raises(ConfigError, match=r"units 1\.\.2 privately: BatchNorm"):
        await simulate(CONFIG.replace(model=with_batch_norm), clock=VirtualClock(),
                       cost_table=CostTable.uniform(2, forward=0.001, backward=0.002))


@pytest.mark.slow
async def test_the_step_ledger_survives_a_checkpoint(tmp_path: Path) -> None:
    """A resumed run goes on from the steps its devices were given."""
    config = RunConfig(mode="sfl", devices=2, samples_per_device=40, batch_size=20,
                       epochs=1, split_point=2, test_samples=20,
                       options={"privacy": "dp-sgd", "dp_noise_multiplier": 0.9})
    node = Coordinator(config, clock=SystemClock(), checkpoint_dir=tmp_path)
    node.system.prepare([40, 40])
    star = node.system
    assert isinstance(star, Star)
    ledger = star.privacy.ledger
    assert ledger is not None
    ledger.add(0, 7, 0.5)
    ledger.add(1, 3, 0.25)
    ledger.add(1, 2, 0.5)
    spent = star.privacy_spent()
    save_checkpoint(tmp_path, star.checkpoint_tensors(), node._checkpoint_meta(1, 0, 0.0))
    resumed = await joined(Coordinator(config, clock=SystemClock(), checkpoint_dir=tmp_path,
                                       resume=True))
    again = resumed.system
    assert isinstance(again, Star)
    assert again.privacy.ledger is not None
    assert again.privacy.ledger.steps == {0: {0.5: 7}, 1: {0.25: 3, 0.5: 2}}
    assert again.privacy_spent() == spent
    assert spent is not None
    assert math.isclose(spent.device_epsilon["1"], float(
        _accountant([(0.9, 0.25, 3), (0.9, 0.5, 2)]).get_epsilon(1e-5)), rel_tol=1e-12)


def _accountant(history: list[tuple[float, float, int]]) -> Any:
    accountant = accountants.RDPAccountant()
    for sigma, rate, steps in history:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=rate)
    return accountant


def test_a_round_dropped_midway_leaves_nothing_behind() -> None:
    """`clear` after two forwards and one backward: the next iteration steps as a fresh
    stage's would (no stacked inputs, counts or per-sample sums left over)."""
    torch.manual_seed(3)
    module = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    fresh = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    fresh.load_state_dict(module.state_dict())
    batches = _batches(2)
    dropped, clean = _dp_work(module, clip=0.3, sigma=1.0), _dp_work(fresh, clip=0.3,
                                                                        sigma=1.0)
    dropped.batch = clean.batch = lambda i, n: batches[N * i + n]
    dropped.forward(0, 0)
    dropped.forward(0, 1)
    dropped.backward(0, 0)
    dropped.clear()
    dropped.begin_round(ROUND, B_MICRO * N)
    for work in (dropped, clean):
        for n in range(N):
            work.forward(1, n)
        for n in range(N):
            work.backward(1, n)
        work.step()
    for mine, theirs in zip(module.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("sigma", [0.0, 0.7])
def test_a_step_is_opacus_dp_optimizers(sigma: float) -> None:
    """Against Opacus's own GradSampleModule and DPOptimizer (one batch of 8 an
    iteration as one micro-batch; its noise drawn from the round's generator): the same
    clipped, noised mean gradient, the same step."""
    from opacus.grad_sample import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(4)
    module = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    reference = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    reference.load_state_dict(module.state_dict())
    work = DpSgdWork(module, torch.optim.SGD(module.parameters(), lr=0.3), noise_multiplier=sigma,
                     max_grad_norm=0.2, seed=SEED, device_id=DEVICE, first=True, last=True,
                     parallel_batches=1, num_classes=3)
    work.begin_round(ROUND, 8)
    wrapped = GradSampleModule(reference)
    optimizer = DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.3),
                            noise_multiplier=sigma, max_grad_norm=0.2, expected_batch_size=8,
                            generator=round_generator(SEED, DEVICE, ROUND))
    gen = torch.Generator().manual_seed(6)
    batches = [(torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen))
               for _ in range(3)]
    work.batch = lambda i, n: batches[i]
    for i, (x, y) in enumerate(batches):
        work.forward(i, 0)
        work.backward(i, 0)
        work.step()
        optimizer.zero_grad()
        cross_entropy(wrapped(x.clone().requires_grad_()), y).backward()  # (as ours)
        optimizer.step()
    for mine, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert work.clipped > 0
