"""The suite's presets for `aiopipe.testing.Fleet`: one cost table and one wire for
every fault test, whatever the config's network (the tests' timings were written
against them)."""

from __future__ import annotations

import asyncio
from typing import Any

from torch import nn

from aiopipe import CostTable, RunConfig
from aiopipe.clock import Clock
from aiopipe.testing import Fleet
from aiopipe.transport import LinkSpec

__all__ = ["COSTS", "NETWORK", "WIRE", "suite_fleet", "vgg5_shaped"]

COSTS = CostTable.uniform(5, forward=0.01, backward=0.02, step=0.001, batch=10)
#: the run's network, as config (what planning and shaping assume) ...
NETWORK = {"up_mbps": 50, "down_mbps": 50, "latency_ms": 5}
#: ... and as the memory links' wire
WIRE = LinkSpec(50e6, 0.005)


def suite_fleet(config: RunConfig, clock: Clock, tasks: asyncio.TaskGroup,
                **options: Any) -> Fleet:
    """A `Fleet` charged from `COSTS` over `WIRE` unless ``options`` say otherwise."""
    return Fleet(config, clock, tasks, **{"cost_table": COSTS, "wire": WIRE, **options})


def vgg5_shaped(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Sequential:
    """A stand-in for vgg5 in tests whose subject is not the model: its 5 units, the same
    activation shapes after each (32x16x16, 64x8x8, 64x8x8, 128, X for 3x32x32 inputs)
    and nearly its weights (its 4096x128 layer is 90% of them), so the same bytes on the
    wire, at a tenth of its compute (1x1 convolutions after pooling)."""
    c, h, w = in_shape
    return nn.Sequential(
        nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(c, 32, 1), nn.ReLU()),
        nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(32, 64, 1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(64, 64, 1), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 128), nn.ReLU()),
        nn.Linear(128, num_classes),
    )
