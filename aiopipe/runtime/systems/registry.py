"""The registry of training systems: which class is the coordinator half of each
``mode`` (the package docstring, aiopipe.runtime.systems, says what a system is).

Kept apart from the systems and imported by name, so that what needs to know which
system a run has (a cost table's batch sizes, the launcher) loads no system it does
not run, and a user's own system is found the same way as a built-in one.
"""

from __future__ import annotations

import importlib
from typing import Any

from aiopipe.errors import ConfigError

__all__ = ["BUILT_IN", "find_system"]

#: The built-in systems by mode: where each one's coordinator half is (loaded when a
#: run names it, so that a device loads only its own system).
BUILT_IN: dict[str, str] = {
    **dict.fromkeys(("fl", "sl", "sfl", "pipar"),
                    "aiopipe.runtime.systems.star.coordinator:Star"),
    "pipeline": "aiopipe.runtime.systems.pipeline.coordinator:Pipeline",
    "ftpipehd": "aiopipe.runtime.systems.ftpipehd.coordinator:FTPipeHD",
    "asteroid": "aiopipe.runtime.systems.asteroid.coordinator:Asteroid",
    "hadfl": "aiopipe.runtime.systems.hadfl.coordinator:HADFL",
}


def find_system(mode: str) -> type[Any]:
    """The coordinator half of the system that runs ``mode``: a built-in mode, or
    ``"module:attribute"`` naming a system class (`aiopipe.runtime.systems.System`).

    Raises:
        ConfigError: no such system.
    """
    where = BUILT_IN.get(mode, mode)
    module_name, _, attribute = where.partition(":")
    if not attribute:
        raise ConfigError(f"no system is named {mode!r}: a mode is one of "
                          f"{', '.join(BUILT_IN)} or 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"mode {mode!r}: cannot import {module_name}: {exc}") from None
    found = getattr(module, attribute, None)
    if not isinstance(found, type) or not hasattr(found, "device_half"):
        raise ConfigError(f"mode {mode!r}: {where} is not a system class (a coordinator "
                          "half that declares its device_half)")
    return found
