"""Planning: cost tables, the iteration/epoch estimator and plan selection (PiPar §3.3).

Everything here except `measure_costs` is pure: functions of profiles, no I/O, no clock.
"""

from __future__ import annotations

from aiopipe.scheduler.costs import CostTable, measure_costs
from aiopipe.scheduler.estimate import (
    DeviceProfile,
    FleetEstimate,
    ModelProfile,
    alone_iteration_end,
    estimate_epoch,
    estimate_iteration,
    estimate_steady_iteration,
)
from aiopipe.scheduler.select import exhaustive_plans, select_plans

__all__ = [
    "CostTable",
    "DeviceProfile",
    "FleetEstimate",
    "ModelProfile",
    "alone_iteration_end",
    "estimate_epoch",
    "estimate_iteration",
    "estimate_steady_iteration",
    "exhaustive_plans",
    "measure_costs",
    "select_plans",
]
