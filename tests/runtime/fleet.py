"""The suite's presets for `aiopipe.testing.Fleet`: one cost table and one wire for
every fault test, whatever the config's network (the tests' timings were written
against them)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiopipe import CostTable, RunConfig
from aiopipe.clock import Clock
from aiopipe.testing import Fleet
from aiopipe.transport import LinkSpec

__all__ = ["COSTS", "NETWORK", "WIRE", "suite_fleet"]

COSTS = CostTable.uniform(5, forward=0.01, backward=0.02, step=0.001, batch=10)
#: the run's network, as config (what planning and shaping assume) ...
NETWORK = {"up_mbps": 50, "down_mbps": 50, "latency_ms": 5}
#: ... and as the memory links' wire
WIRE = LinkSpec(50e6, 0.005)


def suite_fleet(config: RunConfig, clock: Clock, tasks: asyncio.TaskGroup,
                **options: Any) -> Fleet:
    """A `Fleet` charged from `COSTS` over `WIRE` unless ``options`` say otherwise."""
    return Fleet(config, clock, tasks, **{"cost_table": COSTS, "wire": WIRE, **options})
