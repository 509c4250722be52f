"""The options of a synchronous pipeline (and what FTPipeHD's and Asteroid's share of
them): where the model is cut, and the schedule. Light: a config's checks load it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from aiopipe.config_values import DATA_PARTITIONS, SCHEDULES, fail, positive_int
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = [
    "OPTIONS",
    "PARTITION",
    "SCHEDULE",
    "CutOptions",
    "PipelineOptions",
    "ScheduledOptions",
    "check_cuts",
    "check_pipeline",
    "check_schedule",
    "cut_options",
    "scheduled_options",
]


@runtime_checkable
class CutOptions(Protocol):
    """The options of a system whose model is cut into stages (the pipeline, FTPipeHD,
    Asteroid): their ``partition``."""

    partition: str | tuple[int, ...]


@runtime_checkable
class ScheduledOptions(CutOptions, Protocol):
    """The options of a pipeline with a schedule (the pipeline, Asteroid)."""

    schedule: str


def cut_options(config: Any) -> CutOptions:
    """The run's options, as those of a pipeline cut into stages.

    Raises:
        TypeError: the run's system cuts no stages.
    """
    options: CutOptions = _protocol(config, CutOptions)
    return options


def scheduled_options(config: Any) -> ScheduledOptions:
    """The run's options, as those of a pipeline with a schedule.

    Raises:
        TypeError: the run's system has no schedule.
    """
    options: ScheduledOptions = _protocol(config, ScheduledOptions)
    return options


def _protocol(config: Any, kind: Any) -> Any:
    if not isinstance(config.options, kind):
        raise TypeError(f"mode {config.mode}'s options have no {kind.__name__} "
                        f"({type(config.options).__name__})")
    return config.options


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """The options of a synchronous pipeline.

    Attributes:
        partition: the S - 1 cut points (stage p holds units cut[p-1]+1..cut[p];
            increasing, in 1..Q-1), or "auto": stages of balanced compute.
        schedule: "1f1b" (K_p = 2(S - p) - 1 forwards on stage p before one forward,
            one backward) or "gpipe" (all forwards, then all backwards).
    """

    partition: str | tuple[int, ...] = "auto"
    schedule: str = "1f1b"

#: Where the model is cut.
PARTITION = {"partition": "the S-1 cut points (comma list) or auto (balanced; asteroid: "
                          "its planner's)"}
#: How a stage orders its micro-batches.
SCHEDULE = {"schedule": "1f1b (default) or gpipe"}


def check_cuts(config: Any, *, one_stage_per_device: bool) -> None:
    """``partition``: "auto", or increasing cut points (as a tuple); with
    ``one_stage_per_device``, one fewer than the devices."""
    options = config.options
    partition = options.partition
    if partition in DATA_PARTITIONS:
        raise fail("partition", partition, '"auto" or a list of cut points (the data '
                   "partition is now data_partition)")
    if isinstance(partition, int) and not isinstance(partition, bool):
        partition = (partition,)  # one cut point: two stages
    if isinstance(partition, Sequence) and not isinstance(partition, str):
        cuts = tuple(positive_int("partition", v) for v in partition)
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            raise fail("partition", list(cuts), "increasing cut points")
        if one_stage_per_device and len(cuts) != config.devices - 1:
            raise fail("partition", list(cuts),
                       f"{config.devices - 1} cut points (one fewer than the devices)")
        object.__setattr__(options, "partition", cuts)
    elif partition != "auto":
        raise fail("partition", partition, '"auto" or a list of cut points')


def check_pipeline(config: Any) -> None:
    """What every pipeline needs: two devices or more, one micro-batch count, rounds
    that are epochs (nothing to aggregate between)."""
    if config.devices < 2:
        raise fail("devices", config.devices, "at least 2 for a pipeline (one per stage)")
    if not isinstance(config.parallel_batches, int):
        raise fail("parallel_batches", config.parallel_batches,
                   "one integer for a pipeline (micro-batches per iteration)")
    if config.aggregation_every:
        raise fail("aggregation_every", config.aggregation_every,
                   "0 for a pipeline (its rounds are epochs: it aggregates nothing)")


def check(config: Any) -> None:
    """The synchronous pipeline's options."""
    check_cuts(config, one_stage_per_device=True)
    check_schedule(config.options_as(PipelineOptions).schedule)
    check_pipeline(config)


def check_schedule(schedule: str) -> None:
    """A schedule aiopipe has."""
    if schedule not in SCHEDULES:
        raise fail("schedule", schedule, f"one of {', '.join(SCHEDULES)}")


#: Why the other systems' runs keep the cut points at their default.
ELSEWHERE = {"partition": 'it is for mode "pipeline", "ftpipehd" and "asteroid" (the data '
                          "partition is now data_partition)"}

OPTIONS = SystemOptions(PipelineOptions, {**PARTITION, **SCHEDULE}, check, elsewhere=ELSEWHERE)
