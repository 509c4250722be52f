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
from torch import nn
from torch.func import functional_call

from aiopipe.runtime.async_weights import StageWeights
from aiopipe.scheduler.async_pipeline import aggregates_before, one_f_one_b

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
    units, n = _units(), STAGES
    history = [{-1: {k: p.detach().clone() for k, p in u.named_parameters()}} for u in units]
    buffers: list[dict[str, torch.Tensor]] = [{} for _ in units]
    for j, (x, y) in enumerate(_data()):
        used = max(j - n, -1)
        leaves = [{k: v.clone().requires_grad_(True) for k, v in h[used].items()}
                  for h in history]
        out = x
        for unit, params in zip(units, leaves, strict=True):
            out = functional_call(unit, params, (out,))
        loss = F.cross_entropy(out, y)
        flat = [t for params in leaves for t in params.values()]
        grads = iter(torch.autograd.grad(loss, flat))
        with torch.no_grad():
            for i, params in enumerate(leaves):
                k = n - i
                if aggregates_before(n, i, j, every):
                    recent = [history[i][u] for u in range(j - k, j)]
                    base = {name: torch.stack([r[name] for r in recent]).mean(dim=0)
                            for name in params}
                else:
                    base = history[i][j - 1]
                new = {}
                for name in params:
                    g = next(grads)
                    if momentum:
                        buf = buffers[i].get(name)
                        buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
                        buffers[i][name] = buf
                        g = buf
                    new[name] = base[name] - LR * g
                history[i][j] = new
    return [h[BATCHES - 1] for h in history]


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
            out = stages[i].forward(b, data[b][0] if i == 0 else inputs.pop((i, b)))
            if i == n - 1:
                losses[b] = F.cross_entropy(out, data[b][1])
            else:
                inputs[i + 1, b] = out.detach()
        else:
            back = (stages[i].backward(b, loss=losses.pop(b)) if i == n - 1
                    else stages[i].backward(b, grads.pop((i, b))))
            if i > 0:
                assert back is not None
                grads[i - 1, b] = back

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
        stage.backward(1, torch.ones(3, 2))
