"""Asteroid's options: its stages' groups (§3.2), how it re-plans after a fault (§3.4),
its backups (chain replication). Light: a config's checks load it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiopipe.config_values import RESCHEDULINGS, SCHEDULES, device_id, fail
from aiopipe.runtime.systems.ftpipehd.options import CHAIN, check_counts
from aiopipe.runtime.systems.pipeline.options import (
    PARTITION,
    SCHEDULE,
    check_cuts,
    check_pipeline,
)
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["OPTIONS"]

_KEYS = {
    **PARTITION,
    "stage_groups": "the devices of each stage, e.g. 0,1/2 (stage 0 on devices 0 and 1, "
                    "which split every micro-batch, stage 1 on device 2), or auto (the "
                    "planner's, with partition auto)",
    "rescheduling": "how to re-plan when a device is lost: lightweight (default: adjust "
                    "the plan) or heavy (plan again from scratch)",
    **SCHEDULE,
    **CHAIN,
}


def check(config: Any) -> None:
    """Asteroid's options: cut points, groups that hold every device once, one more
    group than cut points (or both "auto")."""
    check_cuts(config, one_stage_per_device=False)
    if config.schedule not in SCHEDULES:
        raise fail("schedule", config.schedule, f"one of {', '.join(SCHEDULES)}")
    check_counts(config, CHAIN)
    _check_stage_groups(config)
    if config.rescheduling not in RESCHEDULINGS:
        raise fail("rescheduling", config.rescheduling, f"one of {', '.join(RESCHEDULINGS)}")
    check_pipeline(config)


def _check_stage_groups(config: Any) -> None:
    """"auto" with an "auto" partition, or every device in exactly one of one more
    groups than cut points."""
    groups = config.stage_groups
    if groups == "auto":
        if config.partition != "auto":
            raise fail("partition", list(config.partition), '"auto" when stage_groups '
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
    if config.partition == "auto" or len(config.partition) != len(fixed) - 1:
        raise fail("partition", config.partition, f"{len(fixed) - 1} cut points (one "
                   "fewer than the stage groups)")
    object.__setattr__(config, "stage_groups", fixed)


OPTIONS = SystemOptions(_KEYS, check)
