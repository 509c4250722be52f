"""FTPipeHD's asynchronous pipeline as one process that applies its rules in batch order
(aiopipe/scheduler/async_pipeline.py): what every asynchronous run must end with.

Batch b computes, through every stage, with the weights each stage had just after the
update of batch ``b − n`` (the epoch's starting weights while ``b < n``); stage i applies
update j to the average of its last ``n − i`` versions when `aggregates_before` says so,
else to its previous version; SGD with momentum (torch's rule), whose buffers live on
across epochs. Each epoch starts from the weights the last one ended with (the pipeline
flushes at an epoch's end)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from aiopipe import models
from aiopipe.scheduler.async_pipeline import aggregates_before

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def delayed_sgd(stages: Sequence[nn.Module], epochs: Sequence[Batches], *, lr: float,
                momentum: float, every: int,
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] =
                nn.functional.cross_entropy) -> list[dict[str, torch.Tensor]]:
    """Train ``stages`` (consecutive parts of one model) on ``epochs`` (each a list of
    batches); each stage's final trainable parameters (a frozen one is the stage's own
    throughout: it is never stepped)."""
    buffers: list[dict[str, torch.Tensor]] = [{} for _ in stages]
    weights = [{k: p.detach().clone() for k, p in s.named_parameters() if p.requires_grad}
               for s in stages]
    for batches in epochs:
        weights = _flush_to_flush(stages, weights, batches, buffers, lr=lr,
                                  momentum=momentum, every=every, loss=loss)
    return weights


def delayed_sgd_rounds(model: nn.Sequential, rounds: Sequence[tuple[Sequence[int], Batches]],
                       *, lr: float, momentum: float, every: int) -> None:
    """Train ``model`` in place round by round, each ``(cuts, batches)``: the pipeline
    flushes between rounds, and may be cut differently in each; a parameter's momentum
    follows it wherever it goes."""
    buffers: dict[str, torch.Tensor] = {}
    for cuts, batches in rounds:
        stages = models.partition(model, list(cuts))
        names = [[k for k, _ in s.named_parameters()] for s in stages]
        mine = [{k: buffers[k] for k in ks if k in buffers} for ks in names]
        start = [{k: p.detach().clone() for k, p in s.named_parameters()} for s in stages]
        final = _flush_to_flush(stages, start, batches, mine, lr=lr, momentum=momentum,
                                every=every, loss=nn.functional.cross_entropy)
        for stage, weights, held in zip(stages, final, mine, strict=True):
            buffers.update(held)
            with torch.no_grad():
                for name, param in stage.named_parameters():
                    param.copy_(weights[name])


def _flush_to_flush(stages: Sequence[nn.Module], start: list[dict[str, torch.Tensor]],
                    batches: Batches, buffers: list[dict[str, torch.Tensor]], *, lr: float,
                    momentum: float, every: int,
                    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                    ) -> list[dict[str, torch.Tensor]]:
    n = len(stages)
    history = [{-1: weights} for weights in start]
    for j, (x, y) in enumerate(batches):
        used = max(j - n, -1)
        leaves = [{k: v.clone().requires_grad_(True) for k, v in h[used].items()}
                  for h in history]
        out = x
        for stage, params in zip(stages, leaves, strict=True):
            out = functional_call(stage, params, (out,))
        flat = [t for params in leaves for t in params.values()]
        grads = iter(torch.autograd.grad(loss(out, y), flat))
        with torch.no_grad():
            for i, params in enumerate(leaves):
                if aggregates_before(n, i, j, every):
                    recent = [history[i][u] for u in range(j - (n - i), j)]
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
                    new[name] = base[name] - lr * g
                history[i][j] = new
    return [h[len(batches) - 1] for h in history]
