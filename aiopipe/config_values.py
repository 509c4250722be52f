"""What `RunConfig`'s keys accept: the named choices, and checks of single values.

Every check raises `ConfigError` with one line naming the key, the value and what is
accepted (`fail`); a per-device key takes one value for the fleet or a list of one per
device (`per_device`, read back with `pick`). aiopipe.config and the systems' options
modules build on this module, which imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from aiopipe.errors import ConfigError

__all__ = [
    "AGGREGATIONS",
    "DATA_PARTITIONS",
    "HPP_PLANNERS",
    "INITIAL_WEIGHTS",
    "LOCAL_OPTIMIZERS",
    "LOSSES",
    "METRICS",
    "OPTIMIZERS",
    "OUTLIERS",
    "PRIVACY_METHODS",
    "RESCHEDULINGS",
    "SCHEDULES",
    "PerDevice",
    "above",
    "device_id",
    "fail",
    "one_network",
    "per_device",
    "pick",
    "positive_int",
]

LOSSES = ("cross-entropy", "mse")
#: What the runs report beside the loss (aiopipe.runtime.factories.make_metric).
METRICS = ("accuracy", "none")
#: The built-in strategies (aiopipe.strategies); a run may name its own, module:Class.
AGGREGATIONS = ("fedavg", "fedmedian", "trimmed-mean", "krum", "multi-krum", "fedavgm",
                "fedadam", "fedyogi", "fedadagrad", "fedprox", "dp-fedavg")
OUTLIERS = ("keep", "clip", "drop")
#: What a device's optimizer starts each round from ([Note: a round's local optimizer]
#: in aiopipe.runtime.systems.star.keeping): nothing (textbook FedAvg), or the state its
#: last round left.
LOCAL_OPTIMIZERS = ("fresh", "kept")
OPTIMIZERS = ("sgd",)
DATA_PARTITIONS = ("iid", "dirichlet")
SCHEDULES = ("1f1b", "gpipe")
#: Differential privacy on the devices (aiopipe.runtime.privacy).
PRIVACY_METHODS = ("none", "classic", "pixeldp", "dp-sgd")
#: What a user's own module starts from: re-initialised from ``seed``, or its weights.
INITIAL_WEIGHTS = ("seed", "given")
#: How Asteroid re-plans after a device is lost (docs/design.md §Asteroid).
RESCHEDULINGS = ("lightweight", "heavy")
#: Who plans Asteroid's stages and groups: its own planner or a baseline's rules
#: (`aiopipe.scheduler.hpp_baseline`).
HPP_PLANNERS = ("asteroid", "equal-groups", "equal-groups-by-speed")

#: A per-device key's value: one for every device, "auto" (where a planner may choose)
#: or one per device.
PerDevice = int | str | tuple[int, ...]


def fail(key: str, value: object, expected: str) -> ConfigError:
    """The error for ``key`` holding ``value`` where ``expected`` was (to raise)."""
    return ConfigError(f"config key {key!r}: got {value!r}, expected {expected}")


def positive_int(key: str, value: object) -> int:
    """``value``, once it is an integer >= 1.

    Raises:
        ConfigError: it is not (the message names the key).
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise fail(key, value, "an integer >= 1")
    return value


def above(key: str, value: object, low: float) -> float:
    """``value`` as a float, once it is a finite number above ``low``.

    Raises:
        ConfigError: it is not (the message names the key).
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > low):
        raise fail(key, value, f"a finite number > {low:g}")
    return float(value)


def per_device(key: str, value: object, devices: int, *, allow_auto: bool) -> PerDevice:
    """``value`` as a per-device key: an integer >= 1, a tuple of ``devices`` of them, or
    (with ``allow_auto``) "auto".

    Raises:
        ConfigError: none of those (the message names the key).
    """
    if isinstance(value, str):
        if allow_auto and value == "auto":
            return value
        raise fail(key, value, '"auto", an integer or a list of integers' if allow_auto
                   else "an integer or a list of integers")
    if isinstance(value, int) and not isinstance(value, bool):
        return positive_int(key, value)
    if isinstance(value, Sequence):
        items = tuple(positive_int(key, v) for v in value)
        if len(items) != devices:
            raise fail(key, list(value), f"a list of {devices} integers (one per device)")
        return items
    raise fail(key, value, "an integer or a list of integers")


def pick(value: PerDevice, device: int) -> int | str:
    """Device ``device``'s value of a per-device key."""
    if isinstance(value, tuple):
        return value[device]
    return value


def device_id(key: str, value: object, devices: int) -> int:
    """``value``, once it is a device id of a fleet of ``devices``.

    Raises:
        ConfigError: it is not (the message names the key).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < devices:
        raise fail(key, value, f"device ids in 0..{devices - 1}")
    return value


def one_network(value: object) -> str | dict[str, Any]:
    """One network: a preset name or a table of rates.

    Raises:
        ConfigError: neither, or a table with no rates (unshaped is "lan").
    """
    from aiopipe.transport.network import network_spec  # pure; local keeps layers apart

    if isinstance(value, Mapping):
        value = dict(value)
        if any(v is None for v in value.values()):
            raise fail("network", value,
                       'numbers for up_mbps and down_mbps (for no shaping use "lan")')
    elif not isinstance(value, str):
        raise fail("network", value, 'a preset name or {up_mbps=.., down_mbps=..}')
    try:
        network_spec(value)
    except ConfigError as exc:
        raise ConfigError(f"config key 'network': {exc}") from None
    return value
