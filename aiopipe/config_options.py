"""A run's system options in a config's plain forms: the system's table (``[hadfl]``),
``options``, and the old flat keys.

`RunConfig` holds the keys every run has; the options only one system takes are an
instance of that system's options dataclass (`RunConfig.options`,
aiopipe.runtime.systems.registry). Plain forms (a TOML file, `RunConfig.to_mapping`,
a checkpoint's config) hold them in a table named after the system. Before, they were
keys of `RunConfig` itself (``RunConfig(mode="hadfl", ring_size=3)``, ``ring_size = 3``
at a file's top level): that old form is still read for one release, each time with a
`FutureWarning` saying where the key goes now (`warn_flat_keys`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.registry import BUILT_IN, option_owners, options_of

__all__ = ["FLAT_KEYS_UNTIL", "flat_config", "fold_system_tables", "option_values", "plain",
           "system_keys", "warn_flat_keys"]

#: The release that stops reading the old flat keys.
FLAT_KEYS_UNTIL = "0.3"


def system_keys(values: dict[str, Any]) -> dict[str, Any]:
    """Take out of ``values`` the keys that are a built-in system's options (the old flat
    form), and return them."""
    owners = option_owners()
    return {key: values.pop(key) for key in list(values) if key in owners}


def warn_flat_keys(flat: Mapping[str, Any], where: str, *, table: str = "") -> None:
    """Say once that ``flat`` keys, given in ``where``, are the old form (module
    docstring), and where they go now."""
    keys = ", ".join(flat)
    one = len(flat) == 1
    home = f"under [{table}]" if table else "under the mode's table, such as [hadfl],"
    warnings.warn(
        f"{where}: {keys} {'is a' if one else 'are'} system option{'' if one else 's'}, "
        f"given the old flat way (read until aiopipe {FLAT_KEYS_UNTIL}): pass "
        f"options={{{', '.join(repr(k) + ': ...' for k in flat)}}} to RunConfig, or put "
        f"{'it' if one else 'them'} {home} in a config file",
        FutureWarning, stacklevel=3)


def option_values(options: Any) -> dict[str, Any]:
    """A run's options (its options dataclass, or a mapping; None: none given) as a dict.

    Raises:
        ConfigError: neither.
    """
    if options is None:
        return {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    if isinstance(options, Mapping):
        return dict(options)
    raise ConfigError(f"config key 'options': expected a table of the system's options or "
                      f"its options dataclass, got {options!r}")


def plain(value: Any) -> Any:
    """``value`` in TOML's plain types: tuples as lists, mappings as dicts, all the way
    down."""
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def fold_system_tables(data: Mapping[str, Any], mode: str, *, where: str
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run keys of ``data`` for a run of ``mode``, with its options gathered under
    ``options``: from ``mode``'s table (``[hadfl]``), an ``options`` table, and the old
    flat keys at top level. The other systems' tables are checked and left out (a file
    may hold several systems' options). ``where`` names the source in messages.
    Returns the values and the flat keys found (for the caller to warn about).

    Raises:
        ConfigError: a table holds a key that is not its system's option, or a key is
            given twice; the run's mode names no system.
    """
    tables = {options_of(m).table: m for m in BUILT_IN}
    if mode in BUILT_IN or ":" in mode:
        tables[options_of(mode).table] = mode
    values = {k: v for k, v in data.items() if not (k in tables and isinstance(v, Mapping))}
    flat = system_keys(values)
    options = option_values(values.pop("options", None))
    for table, table_mode in tables.items():
        given = data.get(table)
        if not isinstance(given, Mapping):
            continue
        keys = options_of(table_mode).keys
        for key in given:
            if key not in keys:
                raise ConfigError(f"{where}: [{table}] holds {key!r}, which is not an option "
                                  f"of mode {table_mode} (its options: "
                                  f"{', '.join(keys) or 'none'})")
        if table_mode != mode:
            continue
        for key, value in given.items():
            if key in options:
                raise ConfigError(f"{where}: {key!r} is both in options and under "
                                  f"[{table}]: keep one")
            options[key] = value
    for key, value in flat.items():
        if key in options:
            raise ConfigError(f"{where}: {key!r} is both at top level and under "
                              f"[{options_of(mode).table if mode in tables.values() else mode}]"
                              f": keep the one under the table")
        options[key] = value
    values["options"] = options
    return values, flat


def flat_config(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A config's plain ``mapping`` (`RunConfig.to_mapping`'s form, or the old flat one
    an older checkpoint holds) as one level of keys: its system's options beside the
    common keys; other systems' keys (an old form's, all at their defaults) left out.
    What a checkpoint's config is compared and restored by."""
    mode = str(mapping.get("mode", ""))
    own = options_of(mode).keys if mode in BUILT_IN or ":" in mode else {}
    owners = option_owners()
    table = options_of(mode).table if own else mode
    out = {k: v for k, v in mapping.items()
           if not isinstance(v, Mapping) or k not in (table, "options", *BUILT_IN)}
    out = {k: v for k, v in out.items() if k not in owners or k in own}
    for nested in (mapping.get("options"), mapping.get(table)):
        if isinstance(nested, Mapping):
            out.update(nested)
    return out
