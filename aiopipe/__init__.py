"""aiopipe: asyncio-native pipelined split learning between one server and many devices.

The public API (DESIGN §6): `RunConfig`, `simulate`, `Server` (and its `ConnectionLimits`),
`Device`, `RunResult`,
`EpochMetrics`, the clocks, and the error tree. Models are built by `aiopipe.models`,
datasets opened by `aiopipe.data`.
"""

from __future__ import annotations

import typing

from aiopipe._version import __version__ as __version__
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

if typing.TYPE_CHECKING:
    from aiopipe.api import Device, Server, simulate
    from aiopipe.clock import Clock, SystemClock, VirtualClock
    from aiopipe.config import RunConfig
    from aiopipe.metrics.results import EpochMetrics, RunResult
    from aiopipe.runtime.guard import ConnectionLimits
    from aiopipe.scheduler.costs import CostTable

#: Where each public name lives. They are imported on first use (PEP 562), so that
#: ``python -m aiopipe.auth`` and every ``--help`` start without importing torch.
_LAZY = {
    "Device": "aiopipe.api", "Server": "aiopipe.api", "simulate": "aiopipe.api",
    "Clock": "aiopipe.clock", "SystemClock": "aiopipe.clock", "VirtualClock": "aiopipe.clock",
    "RunConfig": "aiopipe.config",
    "EpochMetrics": "aiopipe.metrics.results", "RunResult": "aiopipe.metrics.results",
    "ConnectionLimits": "aiopipe.runtime.guard",
    "CostTable": "aiopipe.scheduler.costs",
}


def __getattr__(name: str) -> typing.Any:
    """The public name ``name``, imported from its module on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiopipe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


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
