"""HADFL's options: the mutual negotiation (§III-B), local steps and synchronisation
periods, the ring and its groups (§III-C). Light: a config's checks load it."""

from __future__ import annotations

import math
from typing import Any

from aiopipe.config_values import fail, positive_int
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["OPTIONS"]

_KEYS = {
    "warmup_epochs": "epochs of the mutual negotiation (each device one epoch at "
                     "warmup_learning_rate, then the whole fleet averages); its times size "
                     "the local steps",
    "warmup_learning_rate": "the negotiation's small learning rate",
    "local_steps": "capacity (each device as many mini-batches as fit its speed in a "
                   "period) or a number every device trains a round",
    "sync_periods": "T_sync, hyperperiods between synchronisations",
    "ring_size": "N_p, devices that average each round (0: half)",
    "version_smoothing": "Holt's smoothing factor for version prediction",
    "ring_timeout": "seconds a ring member waits for its upstream before it asks it; as "
                    "long again without an answer and it is bypassed",
    "group_size": "devices per group, each averaging within itself (0: one group)",
    "inter_group_every": "with groups: rounds between inter-group averages",
}


def check(config: Any) -> None:
    """HADFL's options."""
    warmup = config.warmup_epochs
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise fail("warmup_epochs", warmup, "an integer >= 0")
    steps = config.local_steps
    if steps != "capacity":
        positive_int("local_steps", steps)
    elif warmup == 0:
        raise fail("warmup_epochs", 0, '>= 1 with local_steps "capacity" (its times '
                   "size the local steps)")
    positive_int("sync_periods", config.sync_periods)
    positive_int("inter_group_every", config.inter_group_every)
    group = config.group_size
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise fail("group_size", group, "an integer >= 0 (0: one group)")
    size = config.ring_size
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= config.devices:
        raise fail("ring_size", size, f"an integer in 0..{config.devices} (0: half the "
                   "devices)")
    for key, low, high in (("warmup_learning_rate", 0.0, math.inf),
                           ("version_smoothing", 0.0, 1.0), ("ring_timeout", 0.0, math.inf)):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                low < value < high):
            raise fail(key, value, f"a number in ({low:g}, {high:g})")
        object.__setattr__(config, key, float(value))
    if config.aggregation_every:
        raise fail("aggregation_every", config.aggregation_every,
                   "0 for hadfl (its rounds are its synchronisation periods)")


OPTIONS = SystemOptions(_KEYS, check)
