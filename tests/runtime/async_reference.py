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

from aiopipe.scheduler.async_pipeline import aggregates_before

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def delayed_sgd(stages: Sequence[nn.Module], epochs: Sequence[Batches], *, lr: float,
                momentum: float, every: int,
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] =
                nn.functional.cross_entropy) -> list[dict[str, torch.Tensor]]:
    """Train ``stages`` (consecutive parts of one model) on ``epochs`` (each a list of
    batches); each stage's final parameters."""
    n = len(stages)
    buffers: list[dict[str, torch.Tensor]] = [{} for _ in stages]
    start = [{k: p.detach().clone() for k, p in s.named_parameters()} for s in stages]
    for batches in epochs:
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
        start = [h[len(batches) - 1] for h in history]
    return start
