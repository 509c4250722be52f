"""A config as TOML: reading a file's run keys, and writing a mapping of plain values.

`RunConfig.from_toml` reads with `read_run_keys`, then `fold_system_tables`;
`RunConfig.to_toml` writes what ``config.toml`` in a results directory holds with
`toml_document`. A system's own options (aiopipe.runtime.systems.registry) go in a table
named after the mode, ``[hadfl]``, or at top level (which is what a results directory's
``config.toml`` holds: every key's value). tomllib reads but does
not write TOML; the values a config holds (booleans, numbers, strings, lists and tables
of them) are few enough to write here.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.registry import BUILT_IN, options_of

__all__ = ["fold_system_tables", "read_run_keys", "toml_document"]


def read_run_keys(path: str | Path) -> dict[str, Any]:
    """The run keys of a TOML file: its top-level keys, or its ``[run]`` table.

    Raises:
        ConfigError: the file is missing, is not valid TOML, or has run keys both at top
            level and under ``[run]``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    if "run" in data and isinstance(data["run"], dict):
        if len(data) > 1:
            raise ConfigError(f"config file {str(path)!r}: put the run keys either at top "
                              f"level or under [run], not both")
        data = data["run"]
    return data


def fold_system_tables(data: Mapping[str, Any], mode: str, *, where: str
                       ) -> dict[str, Any]:
    """The run keys of a file's ``data`` for a run of ``mode``: its top-level keys with
    the options of ``mode``'s table (``[hadfl]``) among them. The other systems' tables
    are checked and left out (a file may hold several systems' options). ``where``
    names the file in messages.

    Raises:
        ConfigError: a table holds a key that is not its system's option, or a key is
            both at top level and in the run's table; the run's mode names no system.
    """
    tables = {options_of(m).table: m for m in BUILT_IN}
    own = options_of(mode) if mode in BUILT_IN or ":" in mode else None
    if own is not None:
        tables[own.table] = mode
    flat = {k: v for k, v in data.items() if not (k in tables and isinstance(v, dict))}
    for table, table_mode in tables.items():
        values = data.get(table)
        if not isinstance(values, dict):
            continue
        options = options_of(table_mode)
        keys = [*options.keys, *options.defaults]
        for key in values:
            if key not in keys:
                raise ConfigError(f"{where}: [{table}] holds {key!r}, which is not an option "
                                  f"of mode {table_mode} (its options: "
                                  f"{', '.join(keys) or 'none'})")
        if table_mode != mode:
            continue
        if not isinstance(flat.get("options", {}), dict):
            raise ConfigError(f"{where}: options must be a table")
        for key, value in values.items():
            into = flat.setdefault("options", {}) if key in options.defaults else flat
            if key in into or key in flat:
                raise ConfigError(f"{where}: {key!r} is both at top level and under "
                                  f"[{table}]: keep the one under [{table}]")
            into[key] = value
    return flat


def toml_document(values: Mapping[str, Any]) -> str:
    """``values`` as a TOML document of top-level keys, one a line.

    Raises:
        ConfigError: a value TOML cannot hold.
    """
    lines = []
    for key, value in values.items():
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise ConfigError(f"cannot write {value!r} to TOML")


def _toml_string(text: str) -> str:
    # TOML basic strings allow no raw control characters (tab aside): escape them all.
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(key: object) -> str:
    text = str(key)
    if text and all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in text):
        return text
    return _toml_string(text)
