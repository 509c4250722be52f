"""FTPipeHD's options: its weight aggregation (§III-C), global and chain replication
(§III-E), when re-partitioning starts (§III-D). Light: a config's checks load it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from aiopipe.config_values import fail
from aiopipe.runtime.systems.pipeline.options import PARTITION, check_cuts, check_pipeline
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["CHAIN", "OPTIONS", "ChainOptions", "FTPipeHDOptions", "chain_options",
           "check_counts"]


@runtime_checkable
class ChainOptions(Protocol):
    """The options of a system whose stages replicate along the chain (FTPipeHD,
    Asteroid's backups)."""

    chain_replication_every: int


def chain_options(config: Any) -> ChainOptions:
    """The run's options, as those of a system whose stages replicate along the chain.

    Raises:
        TypeError: the run's system replicates nothing along a chain.
    """
    options = config.options
    if not isinstance(options, ChainOptions):
        raise TypeError(f"mode {config.mode}'s options have no chain_replication_every")
    return options


@dataclass(frozen=True, slots=True)
class FTPipeHDOptions:
    """FTPipeHD's options.

    Attributes:
        partition: the S - 1 cut points, or "auto" (balanced by the devices' measured
            capacities, and re-partitioned as the run measures them).
        version_aggregation: stage p averages its S - p in-flight weight versions every
            this many times S - p updates (the paper's multiple; 0: never).
        global_replication_every: batches between global replications (the pipeline
            flushes and the coordinator takes every stage's weights and momentum: a
            round ends; re-partitioning happens there, and a round lost to a fault is
            played again from there); 0: once per epoch.
        first_repartition_after: with "auto" cuts: the run's first re-partition comes
            after this many batches (the paper's 10: the pipeline flushes there, and the
            planner takes the capacities they measured), the next ones at each global
            replication; 0: at the first global replication.
        chain_replication_every: batches between chain replications (each stage sends
            its weights and momentum to the next stage's device, the last stage to the
            coordinator; a round lost to a fault is played again from the latest point
            every stage's state survived); 0: none.
    """

    partition: str | tuple[int, ...] = "auto"
    version_aggregation: int = 1
    global_replication_every: int = 100
    first_repartition_after: int = 10
    chain_replication_every: int = 50

#: Chain replication (FTPipeHD's; Asteroid's backups too).
CHAIN = {"chain_replication_every":
         "batches between chain replications (ftpipehd: each stage's weights to the next "
         "stage's device; asteroid: a stage's only device backs its stage up to the next "
         "stage's first device, the last stage to the first); a fault's replay starts "
         "from the latest one that survived; 0: none"}

_KEYS = {
    **PARTITION,
    "version_aggregation": "stage p averages its S - p in-flight weight versions every "
                           "this many times S - p updates (0: never)",
    "global_replication_every": "batches between global replications (a flush; where "
                                "re-partitioning happens and a fault's replay starts; 0: "
                                "once per epoch)",
    "first_repartition_after": "with auto cuts: batches before the first re-partition "
                               "(then at each global replication; 0: none before the first "
                               "global replication)",
    **CHAIN,
}


def check_counts(config: Any, keys: Any) -> None:
    """Each of ``keys`` an integer >= 0."""
    for name in keys:
        value = getattr(config.options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise fail(name, value, "an integer >= 0")


def check(config: Any) -> None:
    """FTPipeHD's options, and SGD: it applies SGD itself to each stage's versions."""
    check_cuts(config, one_stage_per_device=True)
    check_counts(config, [key for key in _KEYS if key != "partition"])
    if config.optimizer != "sgd":
        raise fail("optimizer", config.optimizer, 'its default, "sgd": ftpipehd applies SGD '
                   "(learning_rate, momentum) itself, to each stage's weight versions")
    check_pipeline(config)


OPTIONS = SystemOptions(FTPipeHDOptions, _KEYS, check)
