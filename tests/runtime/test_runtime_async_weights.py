"""A stage's weight versions (aiopipe/runtime/async_weights.py) compute what FTPipeHD's
rules define (aiopipe/scheduler/async_pipeline.py): three stages driven pass by pass in
1F1B order, each holding only its own units, end with exactly the weights of one process
that applies the rules in batch order to the whole model: SGD whose batch b uses the
weights after update b − n, with each stage's aggregation. And the interleaving of the
stages does not matter."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch
import torch.nn.functional as F
from async_reference import delayed_sgd
from torch import nn

from aiopipe.runtime.systems.ftpipehd.async_weights import StageWeights
from aiopipe.scheduler.async_pipeline import one_f_one_b

STAGES, BATCHES, LR = 3, 14, 0.1


def _units(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten()),
            nn.Sequential(nn.Linear(4 * 8 * 8, 32), nn.Tanh()),
            nn.Linear(32, 10)]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g))
            for _ in range(BATCHES)]


def _reference(momentum: float, every: int) -> list[dict[str, torch.Tensor]]:
    """The rules applied in batch order to the whole model, in one process."""
    return delayed_sgd(_units(), [_data()], lr=LR, momentum=momentum, every=every)


def _pipeline(momentum: float, every: int, pick: random.Random | None
              ) -> tuple[list[dict[str, torch.Tensor]], list[StageWeights]]:
    """Each stage its own units and versions; a pass runs once its input is there
    (``pick``: choose among the ready stages at random; None: round-robin)."""
    n, data = STAGES, _data()
    stages = [StageWeights(u, n, i, lr=LR, momentum=momentum, aggregate_every=every)
              for i, u in enumerate(_units())]
    orders = [deque(one_f_one_b(n, i, BATCHES)) for i in range(n)]
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}

    def ready(i: int) -> bool:
        if not orders[i]:
            return False
        kind, b = orders[i][0]
        if kind == "F":
            return i == 0 or (i, b) in inputs
        return b in losses if i == n - 1 else (i, b) in grads

    def run(i: int) -> None:
        kind, b = orders[i].popleft()
        if kind == "F":
            (out,) = stages[i].forward(b, data[b][0] if i == 0 else inputs.pop((i, b)))
            if i == n - 1:
                losses[b] = F.cross_entropy(out, data[b][1])
            else:
                inputs[i + 1, b] = out.detach()
        else:
            back = (stages[i].backward(b, loss=losses.pop(b)) if i == n - 1
                    else stages[i].backward(b, (grads.pop((i, b)),)))
            if i > 0:
                assert back is not None
                (grads[i - 1, b],) = back

    while any(orders):
        candidates = [i for i in range(n) if ready(i)]
        assert candidates, "deadlock"
        if pick is None:
            for i in candidates:
                run(i)
        else:
            run(pick.choice(candidates))
    return [s.current() for s in stages], stages


@pytest.mark.parametrize(("momentum", "every"), [(0.0, 0), (0.0, 1), (0.9, 1), (0.9, 2)])
def test_a_driven_pipeline_computes_what_the_rules_define(momentum: float, every: int) -> None:
    want = _reference(momentum, every)
    got, stages = _pipeline(momentum, every, pick=None)
    for mine, theirs in zip(got, want, strict=True):
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0)
    assert all(not s.stashes for s in stages)
    assert max(len(s.versions) for s in stages) <= STAGES + 1  # only what may be asked for


def test_the_interleaving_of_stages_does_not_matter() -> None:
    first, _ = _pipeline(0.9, 1, pick=random.Random(0))
    second, _ = _pipeline(0.9, 1, pick=random.Random(7))
    for a, b in zip(first, second, strict=True):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_updates_out_of_order_are_refused() -> None:
    stage = StageWeights(nn.Linear(2, 2), 2, 1, lr=0.1)
    x = torch.randn(3, 2)
    stage.forward(0, x)
    stage.forward(1, x)
    with pytest.raises(ValueError, match="update 1 after -1"):
        stage.backward(1, (torch.ones(3, 2),))


def test_an_input_gradient_that_is_refused_leaves_the_weights_as_they_were() -> None:
    """A hostile activation that makes the input's gradient non-finite is refused before
    its update is applied: the stage's weights and version are untouched."""
    from aiopipe.errors import RemoteProtocolError

    stage = StageWeights(_units()[2], STAGES, 2, lr=LR, momentum=0.9)  # the last stage
    before = stage.current()
    (out,) = stage.forward(0, torch.full((6, 32), 3e38))  # finite, but the logits overflow
    loss = F.cross_entropy(out, torch.zeros(6, dtype=torch.long))
    with pytest.raises(RemoteProtocolError, match="NaN or Inf"):
        stage.backward(0, loss=loss)
    assert stage.applied == -1
    for name, value in stage.current().items():
        assert torch.equal(value, before[name])
