"""Balanced partitions of a model into the consecutive stages of a pipeline (pure).

A synchronous pipeline is as fast as its slowest stage (in the steady state of 1F1B or
GPipe every stage does the same micro-batches, one at a time). `balanced_partition`
cuts the units into S non-empty stages minimizing the slowest stage's compute, device p
taking ``slowdown[p]`` times the cost table's forward + backward time of its units, by
dynamic programming over (stage, first unit): O(S Q^2). Transfers are not modelled
(FTPipeHD's planner, `aiopipe.scheduler.ftpipehd`, weighs them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from aiopipe.errors import ConfigError
from aiopipe.scheduler.costs import CostTable

__all__ = ["balanced_partition"]


def balanced_partition(costs: CostTable, stages: int, batch: int,
                       slowdowns: Sequence[float] | None = None) -> list[int]:
    """The S - 1 cut points whose slowest stage computes fastest (module docstring).

    ``batch``: the micro-batch size the costs are read at; ``slowdowns[p]``: device p's
    compute over the table's (default 1). Ties go to the earliest cuts.

    Raises:
        ConfigError: fewer units than stages, or a slowdown list of the wrong length.
    """
    q = costs.units
    if stages < 1 or stages > q:
        raise ConfigError(f"cannot cut a model of {q} units into {stages} non-empty stages")
    slow = list(slowdowns) if slowdowns is not None else [1.0] * stages
    if len(slow) != stages:
        raise ConfigError(f"{len(slow)} slowdowns for {stages} stages")
    unit = [costs.forward_time(u, u + 1, batch) + costs.backward_time(u, u + 1, batch)
            for u in range(q)]
    prefix = [0.0]
    for t in unit:
        prefix.append(prefix[-1] + t)
    # best[p][u]: the slowest of stages p..S-1 when stage p starts at unit u
    best = [[math.inf] * (q + 1) for _ in range(stages + 1)]
    cut = [[q] * (q + 1) for _ in range(stages + 1)]
    best[stages][q] = 0.0
    for p in range(stages - 1, -1, -1):
        for u in range(q - (stages - p) + 1):
            last = q if p == stages - 1 else q - (stages - p - 1)
            for stop in range(u + 1, last + 1):
                here = slow[p] * (prefix[stop] - prefix[u])
                value = max(here, best[p + 1][stop])
                if value < best[p][u]:
                    best[p][u], cut[p][u] = value, stop
    points, u = [], 0
    for p in range(stages - 1):
        u = cut[p][u]
        points.append(u)
    return points
