"""``--help`` by topic for the commands that take a run's options.

``--help`` lists the common options first, then each system's options in a group of its
own, in the registry's order (aiopipe.runtime.systems.registry: the five modes of the
star system share one), then the network's and the operations' options, then the
command's own. ``--help MODE`` lists the common options and that mode's alone, each in
its system's words. What an option of a system means comes from that system's
declaration (`SystemOptions.keys`), never retyped here; an option several systems
take is listed once, in the group of the first, and the others' groups say where.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from typing import Any

from aiopipe.runtime.systems.registry import BUILT_IN, option_owners, options_of

__all__ = ["COMMON", "OPERATIONS", "TopicHelp", "group_title", "mode_names", "option_help",
           "shown", "system_groups", "topic_help", "with_default"]

#: The groups' titles.
COMMON = "common options (override the config file's keys)"
OPERATIONS = "network and operations"


def mode_names(modes: Sequence[str]) -> str:
    """``a, b and c``."""
    return ", ".join(modes[:-1]) + " and " + modes[-1] if len(modes) > 1 else modes[0]


def system_groups() -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """Per built-in system, in the registry's order: its modes, the option keys it is
    the first to declare (its group lists them) and those an earlier system declared
    (listed there)."""
    systems: dict[str, tuple[list[str], list[str], list[str]]] = {}
    seen: set[str] = set()
    for mode, system in BUILT_IN.items():
        modes, own, elsewhere = systems.setdefault(system, ([], [], []))
        modes.append(mode)
        for key in options_of(mode).keys:
            if key not in seen:
                seen.add(key)
                own.append(key)
            elif key not in own and key not in elsewhere:
                elsewhere.append(key)
    return [(tuple(m), tuple(o), tuple(e)) for m, o, e in systems.values()]


def group_title(modes: Sequence[str]) -> str:
    """The title of the group of the system that runs ``modes``."""
    return f"options of mode{'s' if len(modes) > 1 else ''} {mode_names(modes)}"


def option_help(key: str, modes: Sequence[str]) -> str:
    """What option ``key`` means, listed in the group of ``modes``: in its systems' own
    words (each mode's where they differ); which of ``modes`` take it, where not all;
    which other modes take it too."""
    owners = option_owners()[key]
    helps = {mode: options_of(mode).keys[key] for mode in owners}
    text = (helps[owners[0]] if len(set(helps.values())) == 1
            else "; ".join(f"{mode}: {meaning}" for mode, meaning in helps.items()))
    within = [mode for mode in owners if mode in modes]
    if len(within) < len(modes) and not text.startswith(("mode ", *within)):
        text = f"{mode_names(within)} only: {text}"
    others = [mode for mode in owners if mode not in modes]
    if others:
        text += f" (also mode{'s' if len(others) > 1 else ''} {mode_names(others)})"
    return text


class TopicHelp(argparse.Action):
    """``-h, --help [MODE]``: every option, or (with a mode) the common options and that
    mode's (`topic_help`); then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs="?", default=default, metavar="MODE",
                         help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        """Print the help asked for and exit 0 (2 for a topic that is no mode)."""
        if values is None:
            parser.print_help()
        else:
            print(topic_help(parser, str(values)), end="")
        parser.exit()


def topic_help(parser: argparse.ArgumentParser, mode: str) -> str:
    """The help of ``mode``: the usage, the common options, and every option of the
    mode in its system's words, defaults included (``parser``'s groups as
    `aiopipe.cli.add_run_options` makes them). Exits 2 through ``parser.error`` when
    ``mode`` is not a built-in mode."""
    if mode not in BUILT_IN:
        parser.error(f"--help {mode}: a help topic is a mode, one of {', '.join(BUILT_IN)}")
    actions = {action.dest: action for action in parser._actions}
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    for group in parser._action_groups:
        if group.title == COMMON:
            formatter.start_section(group.title)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
    options = options_of(mode)
    own = []
    for key, meaning in options.keys.items():
        action = copy.copy(actions[key])
        action.help = with_default(meaning, options.defaults()[key], action)
        own.append(action)
    formatter.start_section(f"options of mode {mode} (config file: the [{options.table}] "
                            "table)")
    formatter.add_arguments(own)
    formatter.end_section()
    formatter.add_text(f"Every option, the network's and operations' too: {parser.prog} "
                       "--help")
    return formatter.format_help()


def with_default(text: str, default: object, action: argparse.Action) -> str:
    """``text`` with ``(default X)`` after it, unless it says its default already or
    ``action`` is a switch off (``--no-...``)."""
    if "default" in text or isinstance(action, argparse._StoreFalseAction):
        return text
    return f"{text} (default {shown(default)})"


def shown(value: object) -> str:
    """A default as ``--help`` shows it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
