"""The checks of `RunConfig`'s keys that belong to one system or feature.

Each ``check_*`` function takes the config under construction, raises `ConfigError` for
an invalid value (the message names the key, the value and what is accepted) and
replaces a valid one by its normal form (a list by a tuple, an int by a float) through
``object.__setattr__``, since the config is frozen. `RunConfig.__post_init__` calls them
in a fixed order: a later check may rely on what an earlier one normalised. They see the
config through `CheckedConfig`, so this module needs nothing of aiopipe.config.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from aiopipe.config_values import (
    AGGREGATIONS,
    DATA_PARTITIONS,
    OUTLIERS,
    PIPELINE_MODES,
    PRIVACY_METHODS,
    REPLICA_MODES,
    RESCHEDULINGS,
    SCHEDULES,
    STAR_MODES,
    PerDevice,
    above,
    device_id,
    fail,
    positive_int,
)

__all__ = [
    "HADFL_KEYS",
    "CheckedConfig",
    "check_aggregation",
    "check_devices_per_round",
    "check_hadfl",
    "check_pipeline",
    "check_privacy",
    "check_server_lanes",
    "check_stage_groups",
    "check_trim",
    "devices_to_trim",
]

#: The keys only mode "hadfl" takes.
HADFL_KEYS = ("warmup_epochs", "warmup_learning_rate", "local_steps", "sync_periods",
              "ring_size", "version_smoothing", "ring_timeout", "group_size",
              "inter_group_every")


class CheckedConfig(Protocol):
    """What the checks read of a `RunConfig` (its other keys they read by name)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def mode(self) -> str: ...
    @property
    def devices(self) -> int: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def parallel_batches(self) -> PerDevice: ...
    @property
    def aggregation_every(self) -> int: ...
    @property
    def partition(self) -> str | tuple[int, ...]: ...
    @property
    def stage_groups(self) -> str | tuple[tuple[int, ...], ...]: ...
    @property
    def schedule(self) -> str: ...
    @property
    def rescheduling(self) -> str: ...
    @property
    def aggregation(self) -> str: ...
    @property
    def trim_fraction(self) -> float: ...
    @property
    def byzantine_devices(self) -> int: ...
    @property
    def outliers(self) -> str: ...
    @property
    def outlier_limit(self) -> float: ...
    @property
    def scale_limit(self) -> float: ...
    @property
    def warmup_epochs(self) -> int: ...
    @property
    def local_steps(self) -> int | str: ...
    @property
    def sync_periods(self) -> int: ...
    @property
    def inter_group_every(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def ring_size(self) -> int: ...
    @property
    def privacy(self) -> str: ...
    @property
    def privacy_noise(self) -> float: ...
    @property
    def server_lanes(self) -> int: ...
    @property
    def devices_per_round(self) -> int | float: ...

    def round_size(self, alive: int) -> int:
        """Devices that train in a round when ``alive`` can."""
        ...


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


def check_pipeline(config: CheckedConfig) -> None:
    """The pipeline's keys: valid, and given only where they mean something."""
    partition = config.partition
    if partition in DATA_PARTITIONS:
        raise fail("partition", partition, '"auto" or a list of cut points (the data '
                   "partition is now data_partition)")
    if isinstance(partition, int) and not isinstance(partition, bool):
        partition = (partition,)  # one cut point: two stages
    if isinstance(partition, Sequence) and not isinstance(partition, str):
        cuts = tuple(positive_int("partition", v) for v in partition)
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            raise fail("partition", list(cuts), "increasing cut points")
        if config.mode in ("pipeline", "ftpipehd") and len(cuts) != config.devices - 1:
            raise fail("partition", list(cuts),
                       f"{config.devices - 1} cut points (one fewer than the devices)")
        object.__setattr__(config, "partition", cuts)
    elif partition != "auto":
        raise fail("partition", partition, '"auto" or a list of cut points')
    if config.schedule not in SCHEDULES:
        raise fail("schedule", config.schedule, f"one of {', '.join(SCHEDULES)}")
    for name, initial in (("version_aggregation", 1), ("global_replication_every", 100),
                          ("chain_replication_every", 50), ("first_repartition_after", 10)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise fail(name, value, "an integer >= 0")
        modes = (("ftpipehd", "asteroid") if name == "chain_replication_every"
                 else ("ftpipehd",))
        if config.mode not in modes and value != initial:
            raise fail(name, value, f"its default: it is for mode "
                       f"{' and '.join(map(repr, modes))}".replace("'", '"'))
    if config.mode == "ftpipehd" and config.optimizer != "sgd":
        raise fail("optimizer", config.optimizer, 'its default, "sgd": ftpipehd applies SGD '
                   "(learning_rate, momentum) itself, to each stage's weight versions")
    if config.mode == "ftpipehd" and config.schedule != "1f1b":
        raise fail("schedule", config.schedule, 'its default: ftpipehd runs 1F1B')
    check_stage_groups(config)
    if config.rescheduling not in RESCHEDULINGS:
        raise fail("rescheduling", config.rescheduling, f"one of {', '.join(RESCHEDULINGS)}")
    if config.mode != "asteroid" and config.rescheduling != "lightweight":
        raise fail("rescheduling", config.rescheduling, 'its default: it is for mode '
                   '"asteroid"')
    if config.mode not in PIPELINE_MODES:
        for key, default in (("partition", "auto"), ("schedule", "1f1b")):
            if getattr(config, key) != default:
                raise fail(key, getattr(config, key), f'its default: {key} is for mode '
                           f'"pipeline" ({config.mode} splits at split_point)')
        return
    if config.devices < 2:
        raise fail("devices", config.devices, "at least 2 for a pipeline (one per stage)")
    if not isinstance(config.parallel_batches, int):
        raise fail("parallel_batches", config.parallel_batches,
                   "one integer for a pipeline (micro-batches per iteration)")
    if config.aggregation_every:
        raise fail("aggregation_every", config.aggregation_every,
                   "0 for a pipeline (its rounds are epochs: it aggregates nothing)")


def check_stage_groups(config: CheckedConfig) -> None:
    """Asteroid's stage groups: "auto" with an "auto" partition, or every device in
    exactly one of one more groups than cut points."""
    groups = config.stage_groups
    if groups == "auto":
        if config.mode == "asteroid" and config.partition != "auto":
            raise fail("partition", list(config.partition), '"auto" when stage_groups '
                       'is "auto" (the planner chooses both)')
        return
    if config.mode != "asteroid":
        raise fail("stage_groups", groups, 'its default, "auto": it is for mode '
                   '"asteroid"')
    if isinstance(groups, str) or not isinstance(groups, Sequence) or not groups or any(
            isinstance(g, str) or not isinstance(g, Sequence) or not g for g in groups):
        raise fail("stage_groups", groups, '"auto" or a list of non-empty lists of '
                   "device ids")
    fixed = tuple(tuple(device_id("stage_groups", d, config.devices) for d in g)
                  for g in groups)
    members = sorted(d for g in fixed for d in g)
    if members != list(range(config.devices)):
        raise fail("stage_groups", [list(g) for g in fixed],
                   f"every device of 0..{config.devices - 1} in exactly one group")
    if config.partition == "auto" or len(config.partition) != len(fixed) - 1:
        raise fail("partition", config.partition, f"{len(fixed) - 1} cut points (one "
                   "fewer than the stage groups)")
    object.__setattr__(config, "stage_groups", fixed)


def check_aggregation(config: CheckedConfig) -> None:
    """The aggregation's keys."""
    if config.aggregation not in AGGREGATIONS:
        raise fail("aggregation", config.aggregation, f"one of {', '.join(AGGREGATIONS)}")
    trim = config.trim_fraction
    if isinstance(trim, bool) or not isinstance(trim, int | float) or not 0 <= trim < 0.5:
        raise fail("trim_fraction", trim, "a number in [0, 0.5)")
    object.__setattr__(config, "trim_fraction", float(trim))
    f = config.byzantine_devices
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise fail("byzantine_devices", f, "an integer >= 0")
    if config.aggregation == "krum" and config.devices < f + 3:
        raise fail("byzantine_devices", f, f"at most devices - 3 ({config.devices - 3}) "
                   "for krum")
    if config.outliers not in OUTLIERS:
        raise fail("outliers", config.outliers, f"one of {', '.join(OUTLIERS)}")
    object.__setattr__(config, "outlier_limit", above("outlier_limit", config.outlier_limit, 1))
    object.__setattr__(config, "scale_limit", above("scale_limit", config.scale_limit, 1))


def check_hadfl(config: CheckedConfig) -> None:
    """HADFL's keys: valid, and given only in mode hadfl."""
    if config.mode != "hadfl":
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        for key in HADFL_KEYS:
            if getattr(config, key) != defaults[key]:
                raise fail(key, getattr(config, key), 'its default: it is for mode "hadfl"')
        return
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


def check_privacy(config: CheckedConfig) -> None:
    """The devices' differential privacy: a known method, in a star mode."""
    if config.privacy not in PRIVACY_METHODS:
        raise fail("privacy", config.privacy, f"one of {', '.join(PRIVACY_METHODS)}")
    if config.privacy != "none" and config.mode not in STAR_MODES:
        raise fail("privacy", config.privacy, f'"none" in mode {config.mode} (it is for '
                   "fl, sl, sfl and pipar)")
    object.__setattr__(config, "privacy_noise", above("privacy_noise", config.privacy_noise, 0))


def check_server_lanes(config: CheckedConfig) -> None:
    """Concurrent server passes: a count >= 1, above 1 only where the server holds a
    replica per device (sfl, pipar)."""
    lanes = config.server_lanes
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise fail("server_lanes", lanes, "an int >= 1")
    if lanes > 1 and config.mode not in REPLICA_MODES:
        raise fail("server_lanes", lanes, f"1 in mode {config.mode} (the server runs "
                   "one replica per device only in sfl and pipar)")


def check_devices_per_round(config: CheckedConfig) -> None:
    """Sampling per round: 0, a count up to ``devices``, or a fraction in (0, 1); only
    where a round is a set of devices training from the global model."""
    value = config.devices_per_round
    expected = f"0 (every device), an integer 1..{config.devices} or a fraction in (0, 1)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail("devices_per_round", value, expected)
    if isinstance(value, int) and not 0 <= value <= config.devices:
        raise fail("devices_per_round", value, expected)
    if isinstance(value, float) and not 0 < value < 1:
        raise fail("devices_per_round", value, expected)
    if value and config.mode not in STAR_MODES:
        raise fail("devices_per_round", value, f"0 in mode {config.mode} (devices are "
                   "sampled per round in fl, sl, sfl and pipar)")


def check_trim(config: CheckedConfig) -> None:
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
