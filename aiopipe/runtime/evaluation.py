"""How good the global model is: on the coordinator's evaluation set, and on the devices'
own held-out data (federated evaluation: the data stays where it is).

After each epoch the coordinator evaluates the global model on its test set, if it has
one (`test_accuracy`), and asks every device that announced held-out data (`Ready.held_out`)
to evaluate it on that (`held_out_accuracy`): the device gets the whole global model
(`EvalRequest`: in the split modes the server's half too, which a device otherwise never
holds) and answers with its counts (`EvalResult`), computed on a copy of the model
(`aiopipe.runtime.holdings.Holdings.evaluate`). The accuracy over all held-out samples and
per device go into the epoch's metrics. The exchange comes after the epoch's time and
bytes are taken, so it shows in neither.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch

from aiopipe import data as datasets
from aiopipe.clock import Clock, wait_for
from aiopipe.errors import DeviceLostError
from aiopipe.models.crossing import joined, leaves
from aiopipe.protocol import EvalRequest, EvalResult
from aiopipe.runtime.factories import Loss, Metric, scored

__all__ = ["evaluated", "held_out_accuracy", "test_accuracy"]

log = logging.getLogger("aiopipe.server")


def evaluated(model: torch.nn.Sequential, data: datasets.Dataset, loss: Loss,
              metric: Metric | None, *, step: int = 500) -> tuple[float, float]:
    """``model``'s loss and accuracy on ``data``, each summed over its samples (in eval
    mode, batches of ``step``; the model is left in train mode); compute thread."""
    device = next(model.parameters(), torch.empty(0)).device
    loss_sum = correct = 0.0
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, len(data), step):
                x, y = data.batch(range(first, min(first + step, len(data))))
                y = y.to(device)
                output = model(joined([t.to(device) for t in leaves(x)]))
                batch_loss, batch_correct = scored(output, y, loss(output, y), metric)
                loss_sum += batch_loss
                correct += batch_correct
    finally:
        model.train()
    return loss_sum, correct


def test_accuracy(model: torch.nn.Sequential, test_set: datasets.Dataset | None,
                  loss: Loss, metric: Metric | None) -> float:
    """The run's metric of ``model`` on ``test_set`` (NaN without one, or without a
    metric); compute thread."""
    if test_set is None or metric is None:
        return math.nan
    return evaluated(model, test_set, loss, metric)[1] / max(1, len(test_set))


async def held_out_accuracy(
    ask: Mapping[int, Callable[[EvalRequest], Awaitable[EvalResult]]], request: EvalRequest,
    *, clock: Clock, timeout: float,  # noqa: ASYNC109 - seconds on the injected clock
) -> tuple[float, dict[str, float]]:
    """Ask each device in ``ask`` (its session's `evaluate`) at once; the accuracy over
    all their held-out samples (NaN when none answered) and per device. A device that
    does not answer within ``timeout`` seconds, or is lost, is left out (logged)."""
    results: dict[int, EvalResult] = {}

    async def one(k: int) -> None:
        try:
            results[k] = await wait_for(clock, ask[k](request), timeout)
        except (TimeoutError, DeviceLostError) as exc:
            log.warning("device %d did not evaluate epoch %d: %s", k, request.epoch + 1,
                        exc or "timed out")

    async with asyncio.TaskGroup() as tasks:
        for k in ask:
            tasks.create_task(one(k))
    return _summary(list(results.items()))


def _summary(results: Sequence[tuple[int, EvalResult]]) -> tuple[float, dict[str, float]]:
    total = sum(r.samples for _, r in results)
    overall = sum(r.correct for _, r in results) / total if total else math.nan
    return overall, {str(k): r.correct / max(1, r.samples) for k, r in sorted(results)}
