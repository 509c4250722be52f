"""Asteroid's options: its stages' groups (§3.2) and who plans them (Asteroid's planner
or a baseline's rules), how it re-plans after a fault (§3.4), its backups (chain
replication). Light: a config's checks load it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiopipe.config_values import HPP_PLANNERS, RESCHEDULINGS, device_id, fail
from aiopipe.runtime.systems.ftpipehd.options import CHAIN, check_counts
from aiopipe.runtime.systems.pipeline.options import (
    PARTITION,
    SCHEDULE,
    check_cuts,
    check_pipeline,
    check_schedule,
)
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["OPTIONS", "AsteroidOptions"]


@dataclass(frozen=True, slots=True)
class AsteroidOptions:
    """Asteroid's options.

    Attributes:
        partition: the S - 1 cut points, or "auto": Asteroid's planner chooses them
            with ``stage_groups``.
        stage_groups: the devices of each stage, a list of S lists of device ids (every
            device in one; each micro-batch is split between a stage's devices by
            Asteroid's Algorithm 1), or "auto" (the planner, with ``partition`` "auto").
        planner: who plans "auto" stages and groups, and a "heavy" re-plan: "asteroid"
            (its Algorithm 2) or a hybrid baseline of the paper's comparison
            (`aiopipe.scheduler.hpp_baseline`): "equal-groups" (equal groups in the
            declared order, equal rows, cuts by compute, memory not planned for: the
            best of its plans that fits the budgets runs) or
            "equal-groups-by-speed" (the same with rows and cuts by each device's speed).
        rescheduling: how the plan changes when a device is lost mid-round (the round
            is then played again from its start): "lightweight" (§3.4: a group keeps its
            units on the members left; a stage left without a device gives its units to
            its neighbours) or "heavy" (the planner from scratch over the devices left:
            the paper's straw-man).
        schedule: "1f1b" or "gpipe", as a pipeline's.
        chain_replication_every: batches of an epoch between stage backups (every
            device keeps its stage's state; a stage's only device also sends it to the
            first device of the next stage, the last stage's to the first stage's: a
            round lost to a fault is played again from the latest point every stage
            survived); 0: none.
    """

    partition: str | tuple[int, ...] = "auto"
    stage_groups: str | tuple[tuple[int, ...], ...] = "auto"
    planner: str = "asteroid"
    rescheduling: str = "lightweight"
    schedule: str = "1f1b"
    chain_replication_every: int = 50

_KEYS = {
    **PARTITION,
    "stage_groups": "the devices of each stage, e.g. 0,1/2 (stage 0 on devices 0 and 1, "
                    "which split every micro-batch, stage 1 on device 2), or auto (the "
                    "planner's, with partition auto)",
    "planner": "who plans auto stages and groups: asteroid (default: Asteroid's planner) "
               "or a hybrid baseline of the paper's comparison: equal-groups (equal "
               "groups, equal rows, cuts by compute, memory budgets not planned for: its "
               "best plan that fits them runs) or equal-groups-by-speed (rows and cuts "
               "by each device's speed)",
    "rescheduling": "how to re-plan when a device is lost: lightweight (default: adjust "
                    "the plan) or heavy (plan again from scratch)",
    **SCHEDULE,
    **CHAIN,
}


def check(config: Any) -> None:
    """Asteroid's options: cut points, groups that hold every device once, one more
    group than cut points (or both "auto")."""
    check_cuts(config, one_stage_per_device=False)
    options = config.options_as(AsteroidOptions)
    check_schedule(options.schedule)
    check_counts(config, CHAIN)
    _check_stage_groups(config)
    if options.planner not in HPP_PLANNERS:
        raise fail("planner", options.planner, f"one of {', '.join(HPP_PLANNERS)}")
    if options.rescheduling not in RESCHEDULINGS:
        raise fail("rescheduling", options.rescheduling, f"one of {', '.join(RESCHEDULINGS)}")
    check_pipeline(config)


def _check_stage_groups(config: Any) -> None:
    """"auto" with an "auto" partition, or every device in exactly one of one more
    groups than cut points."""
    options = config.options_as(AsteroidOptions)
    groups = options.stage_groups
    if groups == "auto":
        if options.partition != "auto":
            raise fail("partition", list(options.partition), '"auto" when stage_groups '
                       'is "auto" (the planner chooses both)')
        return
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
    if options.partition == "auto" or len(options.partition) != len(fixed) - 1:
        raise fail("partition", options.partition, f"{len(fixed) - 1} cut points (one "
                   "fewer than the stage groups)")
    object.__setattr__(options, "stage_groups", fixed)


OPTIONS = SystemOptions(AsteroidOptions, _KEYS, check)
