"""The registry of training systems: which class is the coordinator half of each
``mode`` (the package docstring, aiopipe.runtime.systems, says what a system is), and
the options each takes.

A system declares its own options (`SystemOptions`): the config keys only it takes,
what each means (``--help`` groups them by system; a config file holds them in a table
named after the mode, ``[hadfl]``), and the checks of their values. A key that no
system declares is every run's; a key some systems declare keeps its default in the
others' runs.

Kept apart from the systems and imported by name, so that what needs to know which
system a run has (a cost table's batch sizes, the launcher) loads no system it does
not run, and a user's own system is found the same way as a built-in one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiopipe.config_toml import check_toml_value
from aiopipe.config_values import fail
from aiopipe.entrypoints import is_entry_point
from aiopipe.errors import ConfigError

__all__ = ["BUILT_IN", "NoOptions", "SystemOptions", "check_system", "find_system",
           "option_owners", "options_of", "why_default"]

#: The built-in systems by mode: where each one's coordinator half is (loaded when a
#: run names it, so that a device loads only its own system).
BUILT_IN: dict[str, str] = {
    **dict.fromkeys(("fl", "sl", "sfl", "pipar", "auto"),
                    "aiopipe.runtime.systems.star.coordinator:Star"),
    "pipeline": "aiopipe.runtime.systems.pipeline.coordinator:Pipeline",
    "ftpipehd": "aiopipe.runtime.systems.ftpipehd.coordinator:FTPipeHD",
    "asteroid": "aiopipe.runtime.systems.asteroid.coordinator:Asteroid",
    "hadfl": "aiopipe.runtime.systems.hadfl.coordinator:HADFL",
    "fedbuff": "aiopipe.runtime.systems.fedbuff.coordinator:FedBuff",
}


#: Where each built-in mode's options are (light modules: a config's checks load them).
BUILT_IN_OPTIONS: dict[str, str] = {
    **{mode: f"aiopipe.runtime.systems.star.options:{mode.upper()}"
       for mode in ("fl", "sl", "sfl", "pipar", "auto")},
    **{mode: f"aiopipe.runtime.systems.{mode}.options:OPTIONS"
       for mode in ("pipeline", "ftpipehd", "asteroid", "hadfl", "fedbuff")},
}


def _no_check(config: Any) -> None:
    """No check beyond the common keys'."""


@dataclass(frozen=True, slots=True)
class NoOptions:
    """The options of a system that declares none."""


@dataclass(frozen=True, slots=True)
class SystemOptions:
    """The options a system takes (module docstring). ``values``: a frozen dataclass whose
    fields are the options, with their defaults (a run's values are an instance of it:
    `RunConfig.options`); ``keys`` maps each field to what it means (``--help``);
    ``check(config)`` raises `ConfigError` for an invalid value (naming the key) and may
    put a valid one in its normal form (a list as a tuple: ``object.__setattr__`` on
    ``config.options``), as `RunConfig`'s own checks do; ``table``: the config file's
    table of them (default: the mode); ``elsewhere``: for a key, why a run of another
    system keeps its default (default: which modes take it); ``samples_devices``: the
    system trains the devices sampled per round (``devices_per_round``) rather than
    every device every round; ``runs_train_hook``: its stages run the run's
    ``train_hook`` (aiopipe.runtime.stage [Note: train hooks])."""

    values: type[Any] = NoOptions
    keys: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[Any], None] = _no_check
    table: str = ""
    elsewhere: Mapping[str, str] = field(default_factory=dict)
    samples_devices: bool = False
    runs_train_hook: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.values, type) and dataclasses.is_dataclass(self.values)):
            raise ConfigError(f"SystemOptions.values must be a dataclass, got {self.values!r}")
        fields = [f.name for f in dataclasses.fields(self.values)]
        try:
            self.values()
        except TypeError:
            raise ConfigError(f"SystemOptions.values: every field of "
                              f"{self.values.__name__} needs a default") from None
        if sorted(fields) != sorted(self.keys):
            raise ConfigError(f"SystemOptions of {self.values.__name__}: keys "
                              f"({', '.join(self.keys) or 'none'}) must say what each field "
                              f"means ({', '.join(fields) or 'none'})")

    def defaults(self) -> dict[str, Any]:
        """Each option's default."""
        return {f.name: getattr(self.values(), f.name) for f in dataclasses.fields(self.values)}


def options_of(mode: str) -> SystemOptions:
    """The options of the system that runs ``mode``: a built-in mode's, or those a
    ``"module:attribute"`` system class declares as its ``options`` (none when it
    declares none). Its ``table`` is filled in (the mode, or the class's name).

    Raises:
        ConfigError: no such system.
    """
    built_in = BUILT_IN_OPTIONS.get(mode)  # (the lookup that chooses the system)
    if built_in is not None:
        return _built_in_options(mode, built_in)
    system = find_system(mode)
    found = getattr(system, "options", None) or SystemOptions()
    if not isinstance(found, SystemOptions):
        raise ConfigError(f"mode {mode!r}: its options are not a SystemOptions")
    return found if found.table else dataclasses.replace(found, table=system.__name__.lower())


@functools.cache
def _built_in_options(mode: str, where: str) -> SystemOptions:
    """Built-in ``mode``'s options, from ``where`` (they never change: loaded once)."""
    module_name, _, attribute = where.partition(":")
    found: SystemOptions = getattr(importlib.import_module(module_name), attribute)
    return found if found.table else dataclasses.replace(found, table=mode)


@functools.cache
def option_owners() -> Mapping[str, tuple[str, ...]]:
    """Every key a built-in system declares, with the modes that take it (once: the
    built-in declarations never change)."""
    owners: dict[str, tuple[str, ...]] = {}
    for mode in BUILT_IN_OPTIONS:
        for key in options_of(mode).keys:
            owners[key] = (*owners.get(key, ()), mode)
    return owners


def check_system(config: Any) -> None:
    """The run's system and its options (`RunConfig`'s last check): ``config.options``
    becomes an instance of the system's options dataclass (from a mapping of the keys
    given, the defaults filling the rest); a key of another system's options keeps its
    default there (the refusal says why: `why_default`); devices sampled per round and
    a train hook only where the system takes them; then the system checks its own; last,
    every option must be one a config file can hold (`check_toml_value`: no None).

    Raises:
        ConfigError: naming the key.
    """
    try:
        options = options_of(config.mode)
    except ConfigError as exc:  # (it says what a mode may be)
        raise ConfigError(f"config key 'mode': {exc}") from None
    given = config.options
    if not isinstance(given, options.values):
        if given is None:
            given = {}
        if not isinstance(given, Mapping):
            raise fail("options", given, f"a table of mode {config.mode}'s options or a "
                       f"{options.values.__name__}")
        given = options.values(**_own_keys(given, options, config.mode))
    object.__setattr__(config, "options", given)
    if config.devices_per_round and not options.samples_devices:
        raise fail("devices_per_round", config.devices_per_round, "its default in mode "
                   f"{config.mode} (devices are sampled per round in fl, sl, sfl and pipar)")
    hook = config.train_hook
    if hook != "" and not is_entry_point(hook):
        raise fail("train_hook", hook, '"" (none) or module:function')
    if hook and not options.runs_train_hook:
        raise fail("train_hook", hook, f'"" in mode {config.mode} (its system runs no train '
                   "hook: fl, sl, sfl and pipar do)")
    options.check(config)
    for key in options.keys:
        check_toml_value(key, getattr(config.options, key))


def _own_keys(given: Mapping[str, Any], options: SystemOptions, mode: str) -> dict[str, Any]:
    """The keys of ``given`` that are ``options``'; another system's key is left out
    where it has that system's default, and refused otherwise.

    Raises:
        ConfigError: a key of another system's, not at its default; a key of none.
    """
    own: dict[str, Any] = {}
    owners = option_owners()
    for key, value in given.items():
        value = tuple(value) if isinstance(value, list) else value  # (a file's list)
        if key in options.keys:
            own[key] = value
        elif key in owners:
            if value != options_of(owners[key][0]).defaults()[key]:
                raise fail(key, value, f"its default in mode {mode} "
                           f"({why_default(key, owners[key])})")
        else:
            raise ConfigError(f"config key 'options': {key!r} is not an option of mode "
                              f"{mode} (its options: {', '.join(options.keys) or 'none'})")
    return own


def why_default(key: str, modes: Sequence[str]) -> str:
    """Why a run of another system keeps ``key``, an option of ``modes``, at its
    default: what the first of them says (`SystemOptions.elsewhere`), or which modes
    take it."""
    why = options_of(modes[0]).elsewhere.get(key)
    if why is not None:
        return why
    names = [f'"{mode}"' for mode in modes]
    return "it is for mode " + (", ".join(names[:-1]) + " and " + names[-1]
                                if len(names) > 1 else names[0])


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
