"""aiopipe: asyncio-native pipelined split learning between one server and many devices.

The public API (DESIGN §6): `RunConfig`, `simulate`, `Server` (and its `ConnectionLimits`),
`Device`, `RunResult`,
`EpochMetrics`, the clocks, and the error tree. Models are built by `aiopipe.models`,
datasets opened by `aiopipe.data`.
"""

from __future__ import annotations

from aiopipe.api import Device, Server, simulate
from aiopipe.clock import Clock, SystemClock, VirtualClock
from aiopipe.config import RunConfig
from aiopipe.errors import (
    AiopipeError,
    AuthenticationError,
    ConfigError,
    FrameTooLargeError,
    LinkBrokenError,
    LinkClosedError,
    LocalProtocolError,
    ProtocolError,
    RefusedError,
    RemoteProtocolError,
    TrainingError,
    TransportError,
)
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.runtime.guard import ConnectionLimits
from aiopipe.scheduler.costs import CostTable

__all__ = [
    "AiopipeError",
    "AuthenticationError",
    "Clock",
    "ConfigError",
    "ConnectionLimits",
    "CostTable",
    "Device",
    "EpochMetrics",
    "FrameTooLargeError",
    "LinkBrokenError",
    "LinkClosedError",
    "LocalProtocolError",
    "ProtocolError",
    "RefusedError",
    "RemoteProtocolError",
    "RunConfig",
    "RunResult",
    "Server",
    "SystemClock",
    "TrainingError",
    "TransportError",
    "VirtualClock",
    "simulate",
]

__version__ = "0.1.0"
