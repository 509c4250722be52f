"""Training systems on the one runtime: what differs between fl / sl / sfl / pipar and a
multi-device pipeline (synchronous, FTPipeHD's or Asteroid's) and HADFL's decentralized
rounds, chosen once per run (`system_for`).

A system decides the placement (which node runs which units), what each device is sent
per round (`RoundStart`: its stage, units, actions, peers and weights), which stage the
coordinator runs itself, how a round's results become the global model (FedAvg, one
device after another, or stages put side by side), and what it checkpoints. The
coordinator (`aiopipe.runtime.coordinator`) does the rest the same way for every system:
admission, sessions, rounds and epochs, metrics, evaluation, checkpoints' writing.
"""

from __future__ import annotations

from aiopipe.runtime.systems.asteroid import Asteroid
from aiopipe.runtime.systems.base import Rounds, Setup, System
from aiopipe.runtime.systems.ftpipehd import FTPipeHD
from aiopipe.runtime.systems.hadfl import HADFL
from aiopipe.runtime.systems.pipeline import Pipeline
from aiopipe.runtime.systems.star import Star

__all__ = ["HADFL", "Asteroid", "FTPipeHD", "Pipeline", "Rounds", "Setup", "Star", "System",
           "system_class", "system_for"]

#: The system of each mode that is not the star's (fl, sl, sfl, pipar).
_SYSTEMS: dict[str, type[Pipeline | HADFL]] = {
    "pipeline": Pipeline, "ftpipehd": FTPipeHD, "asteroid": Asteroid, "hadfl": HADFL}


def system_class(mode: str) -> type[Pipeline | HADFL | Star]:
    """The class of the system that runs ``mode`` (what it declares, such as
    ``recovers_lost_devices``, can be asked before a run is set up)."""
    return _SYSTEMS.get(mode, Star)


def system_for(setup: Setup) -> System:
    """The system ``setup.config.mode`` names, set up (planned) for the run.

    Raises:
        ConfigError: the config cannot run (no plan fits, a bad partition...).
    """
    return system_class(setup.config.mode)(setup)
