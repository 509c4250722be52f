"""FedBuff's options: the buffer size K, the local steps Q, the server learning rate
eta_g and the staleness weight. Light: a config's checks load it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aiopipe.config_values import fail, positive_int
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["OPTIONS", "STALENESS", "FedBuffOptions"]

#: The staleness weights s(tau) a run may choose.
STALENESS = ("sqrt", "none")


@dataclass(frozen=True, slots=True)
class FedBuffOptions:
    """FedBuff's options.

    Attributes:
        buffer_size: K, the device updates the server buffers before it applies them.
        local_steps: Q, the mini-batches a device trains from the model it was sent
            before it uploads its delta.
        server_learning_rate: eta_g: the server applies w <- w + eta_g / K * sum of the
            buffered s(tau) * delta.
        staleness: s(tau): "sqrt", 1 / sqrt(1 + tau) (the paper's), or "none" (1).
        concurrency: the devices that train at once (the paper's concurrency): 0, every
            device all the time; else that many, and each time one of them uploads,
            the next is drawn from the devices not training (seeded by the run's seed
            and the epoch: [Note: FedBuff concurrency]).
    """

    buffer_size: int = 4
    local_steps: int = 5
    server_learning_rate: float = 1.0
    staleness: str = "sqrt"
    concurrency: int = 0


_KEYS = {
    "buffer_size": "K, device updates buffered per server update",
    "local_steps": "Q, mini-batches a device trains before it uploads its delta",
    "server_learning_rate": "eta_g: w <- w + eta_g/K * sum of s(staleness) * delta",
    "staleness": 'the weight of a stale delta: "sqrt" (1/sqrt(1+tau)) or "none"',
    "concurrency": "devices training at once, each next one drawn from the idle (0: all)",
}


def check(config: Any) -> None:
    """FedBuff's options; a run of it aggregates by its own rule, per K arrivals.

    Raises:
        ConfigError: naming the key.
    """
    options = config.options_as(FedBuffOptions)
    positive_int("buffer_size", options.buffer_size)
    positive_int("local_steps", options.local_steps)
    rate = options.server_learning_rate
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not (
            0 < rate < math.inf):
        raise fail("server_learning_rate", rate, "a finite number > 0")
    object.__setattr__(options, "server_learning_rate", float(rate))
    concurrency = options.concurrency
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not (
            0 <= concurrency <= config.devices):
        raise fail("concurrency", concurrency,
                   f"0 (every device) or an integer 1..{config.devices} (the devices)")
    if options.staleness not in STALENESS:
        raise fail("staleness", options.staleness, " or ".join(f'"{s}"' for s in STALENESS))
    if config.aggregation_every:
        raise fail("aggregation_every", config.aggregation_every,
                   "0 for fedbuff (the server updates every buffer_size arrivals)")


OPTIONS = SystemOptions(FedBuffOptions, _KEYS, check)
