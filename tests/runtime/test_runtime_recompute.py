"""[Note: recomputed activations]: in virtual time a device keeps each micro-batch's input,
not its graph, and forwards it again at its backward; the run is the same bit for bit,
dropout included (the generator's state is replayed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.runtime import stage_round
from aiopipe.runtime.stage import StageWork, recomputable
from aiopipe.scheduler.costs import CostTable

COSTS = CostTable.uniform(3, forward=0.001, backward=0.002, step=0.0005, batch=1)


def _model(*, dropout: bool = False, norm: bool = False) -> nn.Sequential:
    torch.manual_seed(3)
    first: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    if norm:
        first.append(nn.BatchNorm2d(8))
    first += [nn.ReLU(), nn.MaxPool2d(4)]
    if dropout:
        first.append(nn.Dropout(0.3))
    return nn.Sequential(nn.Sequential(*first),
                         nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
                         nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 10)))


async def _run(model: nn.Sequential, monkeypatch: pytest.MonkeyPatch, *, recompute: bool
               ) -> tuple[Any, int]:
    again = 0
    real = StageWork._again

    def counting(work: StageWork, saved: Any) -> torch.Tensor:
        nonlocal again
        again += 1
        return real(work, saved)

    with monkeypatch.context() as patch:
        patch.setattr(StageWork, "_again", counting)
        if not recompute:
            patch.setattr(stage_round, "recomputable", lambda module: False)
        config = RunConfig(mode="pipar", model=model, devices=3, samples_per_device=40,
                           batch_size=10, epochs=2, split_point=1, parallel_batches=2,
                           test_samples=20)
        result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    return result, again


@pytest.mark.parametrize("dropout", [False, True])
async def test_recomputing_changes_nothing_but_memory(
        dropout: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(dropout=dropout)
    kept, none = await _run(model, monkeypatch, recompute=False)
    recomputed, again = await _run(model, monkeypatch, recompute=True)
    assert none == 0
    assert again == 3 * 2 * 4 * 2  # devices x epochs x iterations x micro-batches
    assert recomputed.epochs == kept.epochs  # losses, accuracies and times alike
    for (name, a), (_, b) in zip(recomputed.model.state_dict().items(),
                                 kept.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


async def test_a_stage_with_buffers_keeps_its_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(norm=True)
    assert not recomputable(model[0])
    assert recomputable(model[1])
    _, again = await _run(model, monkeypatch, recompute=True)
    assert again == 0  # batch norm would count each micro-batch twice


def test_a_round_result_shares_the_stage_and_a_snapshot_does_not() -> None:
    """A star device's result is kept until its next round and shares the stage's memory
    (`current_state`); a backup taken while training goes on is a copy (`trained_state`)."""
    module = _model()[0]
    work = StageWork(module, torch.optim.SGD(module.parameters(), lr=0.1), first=True,
                     last=False, parallel_batches=1, num_classes=10)
    shared, copied = work.current_state(), work.trained_state()
    for name, value in module.state_dict().items():
        assert shared[name].data_ptr() == value.data_ptr()
        assert copied[name].data_ptr() != value.data_ptr()
        assert torch.equal(copied[name], value)
