"""The fleet as its devices announce it, and the plan made for it.

Before the first round each device announces what it holds (`Ready`: [Note: the
devices' data] in coordinator.py); `announcement_refusal` says why one does not fit the
run. Once every device has, the system plans, with the devices' own profiles when it
wants them (`fleet_profiles`); `log_fleet_plan` then puts the plan in the log, a line per
device, with a warning for each device whose micro-batches do not divide its batch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence

from aiopipe.clock import Clock
from aiopipe.data import DataKind
from aiopipe.protocol import Ready
from aiopipe.runtime.plan import declared_devices
from aiopipe.runtime.plan_text import log_plan
from aiopipe.runtime.profiling import profile_fleet
from aiopipe.runtime.session import DeviceSession
from aiopipe.runtime.systems.base import System, planning_batch_sizes
from aiopipe.scheduler.estimate import DeviceProfile

__all__ = ["announcement_refusal", "fleet_profiles", "log_fleet_plan", "shared_announcement"]


def announcement_refusal(k: int, ready: Ready, *, data: DataKind, model_digest: str,
                         dataset: str,
                         planned: Sequence[int] | None) -> str:
    """Why device k's announcement does not fit the run ("" when it does): the run's
    input shape, classes, model and dataset, and the samples each device was planned
    for (None: not planned yet)."""
    own = DataKind(ready.inputs, ready.target[0], ready.num_classes)
    if (own.inputs, own.target) != (data.inputs, data.target):
        return (f"device {k}'s data has {own.describe()}; the run's has {data.describe()} "
                f"(its dataset {dataset!r})")
    if own.classes > data.classes:
        return (f"device {k}'s labels range over {own.classes} classes, the run's "
                f"model has {data.classes}")
    if ready.model_digest != model_digest:
        return (f"device {k} built another model than the server (digest "
                f"{ready.model_digest[:12]} against {model_digest[:12]}): both "
                "must run the same model code with the same config")
    if planned is not None and ready.samples != planned[k]:
        return (f"device {k} now holds {ready.samples} samples; the run was planned "
                f"for its {planned[k]}")
    return ""


def shared_announcement(ready: Ready, data: DataKind, model_digest: str) -> Ready:
    """What the coordinator keeps of an announcement that fits the run (no
    `announcement_refusal`): the run's own input, target and digest objects in place of
    the device's equal copies, its host's name interned (the decoded copies are 1.5 KB a
    device: 150 MB for a simulated population of 100,000)."""
    return Ready(ready.samples, data.inputs, (data.target,), ready.num_classes, model_digest,
                 sys.intern(ready.host), ready.held_out)


async def fleet_profiles(system: System, samples: list[int],
                         announced: Mapping[int, Ready],
                         sessions: Mapping[int, DeviceSession], *, units: int, clock: Clock
                         ) -> tuple[list[DeviceProfile], dict[int, dict[str, float | None]]]:
    """Each device as it measures itself (aiopipe.runtime.profiling [Note: device
    profiles]), for ``system`` to plan with, and its figures for people; ``samples``:
    what each device announced it holds."""
    config = system.config
    return await profile_fleet(
        {k: sessions[k] for k in range(config.devices)},
        {k: announced[k].host for k in range(config.devices)},
        declared_devices(config, samples),
        sizes=tuple(planning_batch_sizes(config)), units=units, clock=clock)


def log_fleet_plan(log: logging.Logger, system: System, *, units: int,
                   samples: Sequence[int]) -> None:
    """The plan, a line per device (aiopipe.runtime.plan_text), then the uneven
    micro-batches' warnings; nothing when the system has no plan yet (HADFL plans each
    round, and logs its strategy itself). ``samples``: what each device announced."""
    entries = system.plan_entries()
    if not entries:
        return
    estimate = entries[0].get("estimate_s")
    log_plan(log, logging.INFO, f"planned {system.config.mode}", entries,
             units=units, batch_size=system.config.batch_size,
             iterations=system.iterations, notes=[f"est. {estimate:.3g} s an "
                                                  "iteration"] if estimate else [])
    _warn_of_uneven_micro_batches(log, system, samples)


def _warn_of_uneven_micro_batches(log: logging.Logger, system: System,
                                 samples: Sequence[int]) -> None:
    """Say so when N does not divide B: micro-batches of floor(B/N) samples then train
    fewer than B samples per iteration ([Note: iterations per epoch] in plan.py)."""
    batch = system.config.batch_size
    for entry in system.plan_entries():
        n = entry.get("parallel_batches")
        if not isinstance(n, int) or batch % n == 0:
            continue
        k = int(entry["device"])
        trained = system.iterations(k) * (batch // n) * n
        divisors = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        log.warning("device %d: parallel_batches %d does not divide batch_size %d: each "
                    "iteration trains %d micro-batches of %d = %d samples, %d of its %d "
                    "per epoch (N dividing B: %s)", k, n, batch, n, batch // n,
                    (batch // n) * n, trained, samples[k], divisors)
