"""A config as TOML: reading a file's run keys, and writing a mapping of plain values.

`RunConfig.from_toml` reads with `read_run_keys` (then
aiopipe.config_options gathers the system's table); `RunConfig.to_toml` writes what
``config.toml`` in a results directory holds with `toml_document`. tomllib reads but does
not write TOML; the values a config holds (booleans, numbers, strings, lists and tables
of them) are few enough to write here.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiopipe.errors import ConfigError

__all__ = ["check_toml_value", "read_run_keys", "toml_document"]


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


def toml_document(values: Mapping[str, Any]) -> str:
    """``values`` as a TOML document of top-level keys, one a line.

    Raises:
        ConfigError: a value TOML cannot hold.
    """
    lines = []
    for key, value in values.items():
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def check_toml_value(key: str, value: Any) -> None:
    """Refuse a config value that a TOML file cannot hold (None anywhere in it: TOML has
    no null), naming ``key``: checked when the config is made, so that writing
    ``config.toml`` or sending a device its plan cannot fail later.

    Raises:
        ConfigError: naming the key.
    """
    try:
        _toml_value(value)
    except ConfigError:
        raise ConfigError(f"config key {key!r}: got {value!r}, expected a value a config "
                          f"file can hold (TOML has no null: not None, nor one inside a "
                          f"list or table)") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
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
