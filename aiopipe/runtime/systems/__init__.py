"""Training systems on the one runtime, and the registry that names them.

A system is a pair: a coordinator half (`System`: placement, what each device is sent
per round, which stage the coordinator runs itself, how a round's results become the
global model, what it checkpoints) and a device half (`DeviceHalf`,
aiopipe.runtime.device_half: what a device does in a round beyond the shell every
system shares). The coordinator half's class declares the pair and what the runtime
must know of the system before it is set up (`System`'s class attributes:
``device_half``, ``links_devices``, ``recovers_lost_devices``).

Each built-in system lives in its own package, with the modules only it uses:
`star` (fl, sl, sfl and PiPar), `pipeline` (a synchronous multi-device pipeline),
`ftpipehd`, `asteroid` and `hadfl`. A run's ``mode`` names one of them, or a system
written outside the package as ``"module:attribute"`` (the convention ``model``,
``loss`` and ``optimizer`` use): `system_class` finds it. The coordinator
(aiopipe.runtime.coordinator) and the device shell (aiopipe.runtime.device_node) do the
rest the same way for every system.
"""

from __future__ import annotations

from typing import cast

from aiopipe.config import RunConfig
from aiopipe.runtime.systems.base import Rounds, Setup, System
from aiopipe.runtime.systems.registry import BUILT_IN, find_system

__all__ = ["BUILT_IN", "Rounds", "Setup", "System", "planning_batch_sizes", "system_class",
           "system_for"]


def system_class(mode: str) -> type[System]:
    """The coordinator half of the system that runs ``mode`` (`find_system`): what it
    declares, such as ``recovers_lost_devices``, can be asked before a run is set up.

    Raises:
        ConfigError: no such system.
    """
    return cast(type[System], find_system(mode))


def system_for(setup: Setup) -> System:
    """The system ``setup.config.mode`` names, set up (planned) for the run.

    Raises:
        ConfigError: the config cannot run (no plan fits, a bad partition...).
    """
    return system_class(setup.config.mode)(setup)


def planning_batch_sizes(config: RunConfig) -> list[int]:
    """Every batch size a cost table must hold for the run and its planner: the
    micro-batch sizes the run's system may use (its ``micro_batch_sizes``) and B for
    whole batches."""
    sizes = system_class(config.mode).micro_batch_sizes(config)
    return sorted({*sizes, config.batch_size})
