"""HADFL's options: the mutual negotiation (§III-B), local steps and synchronisation
periods, the ring and its groups (§III-C). Light: a config's checks load it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aiopipe.config_values import fail, positive_int
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["OPTIONS", "HADFLOptions"]


@dataclass(frozen=True, slots=True)
class HADFLOptions:
    """HADFL's options.

    Attributes:
        warmup_epochs: epochs of the mutual negotiation (§III-B), E_warmup: each is one
            round in which every device trains one epoch of its data at
            ``warmup_learning_rate`` and the whole fleet averages; the strategy comes
            from the seconds they took. 0: none (only with a fixed ``local_steps``).
        warmup_learning_rate: the negotiation's (small) learning rate.
        local_steps: "capacity" (Algorithm 1: each device trains as many mini-batches
            as fit its speed in a period of ``sync_periods`` hyperperiods) or a number
            of mini-batches every device trains per round (with ``ring_size`` =
            devices: synchronous decentralized FedAvg; 1: every step all-reduced, as
            PyTorch DDP).
        sync_periods: T_sync, hyperperiods between synchronisations.
        ring_size: N_p, the devices that average their models each round (0: half the
            devices, at least 2).
        version_smoothing: Holt's smoothing factor alpha (Eq. 7), in (0, 1).
        ring_timeout: seconds a ring member waits for its upstream before it asks
            whether it is alive (a handshake); an upstream that does not answer within
            as long again (or whose link broke) is bypassed.
        group_size: devices per group when there are many (§III-C): each round every
            group averages within itself (``ring_size`` of its devices, its sender
            sending on to the rest of the group); 0: one group of all.
        inter_group_every: with groups: every this many rounds the round is an
            inter-group synchronisation instead: one device of each group (drawn as
            rings are) average, and the average goes to every other device.
    """

    warmup_epochs: int = 1
    warmup_learning_rate: float = 0.002
    local_steps: int | str = "capacity"
    sync_periods: int = 1
    ring_size: int = 0
    version_smoothing: float = 0.5
    ring_timeout: float = 5.0
    group_size: int = 0
    inter_group_every: int = 4

    def ring_members(self, devices: int) -> int:
        """N_p among ``devices`` (the fleet, or a group's size): ``ring_size``, or half of
        them (at least 2, at most all)."""
        return min(devices, self.ring_size or max(2, math.ceil(devices / 2)))

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
    options = config.options_as(HADFLOptions)
    warmup = options.warmup_epochs
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise fail("warmup_epochs", warmup, "an integer >= 0")
    steps = options.local_steps
    if steps != "capacity":
        positive_int("local_steps", steps)
    elif warmup == 0:
        raise fail("warmup_epochs", 0, '>= 1 with local_steps "capacity" (its times '
                   "size the local steps)")
    positive_int("sync_periods", options.sync_periods)
    positive_int("inter_group_every", options.inter_group_every)
    group = options.group_size
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise fail("group_size", group, "an integer >= 0 (0: one group)")
    size = options.ring_size
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= config.devices:
        raise fail("ring_size", size, f"an integer in 0..{config.devices} (0: half the "
                   "devices)")
    for key, low, high in (("warmup_learning_rate", 0.0, math.inf),
                           ("version_smoothing", 0.0, 1.0), ("ring_timeout", 0.0, math.inf)):
        value = getattr(options, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                low < value < high):
            raise fail(key, value, f"a number in ({low:g}, {high:g})")
        object.__setattr__(options, key, float(value))
    if config.aggregation_every:
        raise fail("aggregation_every", config.aggregation_every,
                   "0 for hadfl (its rounds are its synchronisation periods)")


OPTIONS = SystemOptions(HADFLOptions, _KEYS, check)
