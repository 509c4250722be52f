"""The options of fl, sl, sfl and PiPar: how a round's device models become the global
model (robust aggregation, outliers), the devices' differential privacy, sampling per
round, re-planning, and the server's concurrent passes (sfl and pipar, which hold a
server replica per device). Light: a config's checks load it."""

from __future__ import annotations

import math
from typing import Any

from aiopipe.config_values import AGGREGATIONS, OUTLIERS, PRIVACY_METHODS, above, fail
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["FL", "PIPAR", "SFL", "SL", "devices_to_trim"]

#: What every star mode takes.
_KEYS = {
    "aggregation": "how device models are combined (default fedavg; the others bound what "
                   "a few bad devices can do)",
    "trim_fraction": "trimmed-mean: the fraction of models trimmed at each end",
    "outliers": "a device update far above the round's median: keep (default), clip or "
                "drop it",
    "outlier_limit": "how many times the round's median update norm is an outlier",
    "privacy": "differential privacy on the devices: classic (noise on the uploaded model "
               "half) or pixeldp (noise on every training input)",
    "privacy_noise": "the privacy noise's standard deviation",
    "devices_per_round": "devices sampled to train in each round: a count, or a fraction "
                         "in (0, 1) of the devices; 0: every device",
    "replan": 'with "auto" plans, re-plan between rounds from live measurements '
              "(experimental: off by default)",
    "replan_threshold": "re-plan when the estimated epoch would be this fraction shorter",
}
#: What the modes that hold a server replica per device add.
_REPLICA_KEYS = {
    "server_lanes": "server passes of different devices' replicas run at once (threads; "
                    "for a server with that many cores or a GPU)",
}


def check(config: Any) -> None:
    """The star's options: known aggregation, outliers and privacy methods, a trimmed
    mean that trims, a sampling that is a count or a fraction, server lanes >= 1."""
    if config.aggregation not in AGGREGATIONS:
        raise fail("aggregation", config.aggregation, f"one of {', '.join(AGGREGATIONS)}")
    trim = config.trim_fraction
    if isinstance(trim, bool) or not isinstance(trim, int | float) or not 0 <= trim < 0.5:
        raise fail("trim_fraction", trim, "a number in [0, 0.5)")
    object.__setattr__(config, "trim_fraction", float(trim))
    if config.aggregation == "krum" and config.devices < config.byzantine_devices + 3:
        raise fail("byzantine_devices", config.byzantine_devices,
                   f"at most devices - 3 ({config.devices - 3}) for krum")
    if config.outliers not in OUTLIERS:
        raise fail("outliers", config.outliers, f"one of {', '.join(OUTLIERS)}")
    object.__setattr__(config, "outlier_limit", above("outlier_limit", config.outlier_limit, 1))
    if config.privacy not in PRIVACY_METHODS:
        raise fail("privacy", config.privacy, f"one of {', '.join(PRIVACY_METHODS)}")
    object.__setattr__(config, "privacy_noise", above("privacy_noise", config.privacy_noise, 0))
    lanes = config.server_lanes
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise fail("server_lanes", lanes, "an int >= 1")
    _check_devices_per_round(config)
    _check_trim(config)


def devices_to_trim(trim: float) -> int:
    """The fewest models of which a trimmed mean with fraction ``trim`` (in (0, 0.5))
    drops one at each end: the least n with floor(trim x n) >= 1. 0 for a ``trim`` of 0
    (no count of models is trimmed)."""
    if not trim > 0:
        return 0
    n = max(1, math.ceil(1 / trim) - 1)
    while math.floor(trim * n) < 1:  # (1 / trim may round either way)
        n += 1
    return n


def _check_devices_per_round(config: Any) -> None:
    """Sampling per round: 0, a count up to ``devices``, or a fraction in (0, 1)."""
    value = config.devices_per_round
    expected = f"0 (every device), an integer 1..{config.devices} or a fraction in (0, 1)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail("devices_per_round", value, expected)
    if isinstance(value, int) and not 0 <= value <= config.devices:
        raise fail("devices_per_round", value, expected)
    if isinstance(value, float) and not 0 < value < 1:
        raise fail("devices_per_round", value, expected)


def _check_trim(config: Any) -> None:
    """A trimmed mean must trim something from a whole fleet's round (a round that
    lost devices and trims nothing is warned about: `Star`)."""
    if config.aggregation != "trimmed-mean":
        return
    trim, size = config.trim_fraction, config.round_size(config.devices)
    need = devices_to_trim(trim)
    if not need:
        raise fail("trim_fraction", trim, "a fraction > 0 with aggregation "
                   "\"trimmed-mean\" (0 trims nothing: that is an unweighted mean)")
    if size < need:
        least = math.ceil(1000 / size) / 1000  # shown as is: floor(least x size) >= 1
        fits = (f", or trim_fraction >= {least:g}" if size >= 3
                else " (a trimmed mean needs at least 3)")
        raise fail("trim_fraction", trim, f"at least {need} devices a round to trim "
                   f"any (floor({trim:g} x {size}) = 0: nothing would be trimmed){fits}")


#: Why the other systems' runs keep them at their defaults.
_ELSEWHERE = {
    "privacy": "it is for fl, sl, sfl and pipar",
    "devices_per_round": "devices are sampled per round in fl, sl, sfl and pipar",
    "server_lanes": "the server runs one replica per device only in sfl and pipar",
}

FL = SystemOptions(_KEYS, check, elsewhere=_ELSEWHERE)
SL = SystemOptions(_KEYS, check, elsewhere=_ELSEWHERE)
SFL = SystemOptions({**_KEYS, **_REPLICA_KEYS}, check, elsewhere=_ELSEWHERE)
PIPAR = SystemOptions({**_KEYS, **_REPLICA_KEYS}, check, elsewhere=_ELSEWHERE)
