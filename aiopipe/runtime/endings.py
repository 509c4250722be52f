"""What the coordinator keeps for a run that ends before its last epoch ([Note: results
on every ending] in aiopipe/metrics/results.py): the global model as the last epoch
with finite weights left it, and the finished epochs' results written with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from aiopipe.config import RunConfig
from aiopipe.metrics.results import EpochMetrics, write_unfinished
from aiopipe.wording import plural

__all__ = ["finite_state", "keep_unfinished"]

log = logging.getLogger("aiopipe.server")


def finite_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A copy of ``model``'s state, or None when a floating entry is not finite."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point()):
        return state
    return None


def keep_unfinished(config: RunConfig, epochs: Sequence[EpochMetrics],
                    last_good: dict[str, torch.Tensor] | None, reason: str) -> None:
    """Training ended before its last epoch: write what the finished ``epochs``
    measured, the ``last_good`` model and ``reason`` into ``config.out_dir``; nothing
    when no epoch finished. A failure to write is logged (the run's own error goes on)."""
    out_dir = config.out_dir
    if not out_dir or not epochs:
        return
    try:  # on the loop, as the run ends: a few files, no thread to wait for
        write_unfinished(config, list(epochs), last_good, out_dir, reason)
    except OSError as exc:
        log.error("the finished epochs' results could not be written: %s", exc)
        return
    log.warning("%s: the metrics and model of %s are in %s", reason,
                plural(len(epochs), "finished epoch"), out_dir)
