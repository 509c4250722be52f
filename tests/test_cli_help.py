"""``--help`` by topic (aiopipe.cli_help): the common options first, then each system's
options in a group of its own (every option of every built-in system in exactly one
group, in its system's words), then the network's and operations', then the command's
own; ``--help MODE``: the common options and that mode's alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiopipe.cli import RUN_OPTION_KEYS, ArgumentParser, add_run_options, config_from_args
from aiopipe.cli_help import COMMON, OPERATIONS, group_title, system_groups, topic_help
from aiopipe.runtime.systems.registry import BUILT_IN, option_owners, options_of

REPO = Path(__file__).resolve().parents[1]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="aiopipe-test", add_help=False)
    add_run_options(parser)
    return parser


def _sections(text: str) -> dict[str, str]:
    """The help's sections by title (a line ending in ``:`` at the margin)."""
    parts = re.split(r"^(\S[^\n]*):\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _flags(section: str) -> list[str]:
    """The flags a section lists (after its description, if any)."""
    if not section.lstrip().startswith("-"):
        section = section.partition("\n\n")[2]
    return re.findall(r"^  (--[a-z0-9-]+)", section, flags=re.MULTILINE)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def test_the_groups_come_in_order() -> None:
    titles = list(_sections(_parser().format_help()))
    systems = [group_title(modes) for modes, _, _ in system_groups()]
    assert titles == ["options", COMMON, *systems, OPERATIONS]
    assert systems[0] == "options of modes fl, sl, sfl, pipar and auto"
    assert systems[1:] == [f"options of mode {mode}" for mode in
                           ("pipeline", "ftpipehd", "asteroid", "hadfl", "fedbuff")]


def test_every_system_option_is_in_exactly_one_group_its_system_s() -> None:
    sections = _sections(_parser().format_help())
    where: dict[str, list[str]] = {}
    for title, section in sections.items():
        for flag in _flags(section):
            where.setdefault(flag, []).append(title)
    for modes, own, elsewhere in system_groups():
        section = sections[group_title(modes)]
        assert _flags(section) == [_flag(key) for key in own]
        for key in elsewhere:  # listed in an earlier system's group, named here
            assert _flag(key) in section.split("\n\n")[0]
    for key, modes in option_owners().items():
        assert where[_flag(key)] == [group_title(
            next(m for m, own, _ in system_groups() if key in own))], key
        assert key in RUN_OPTION_KEYS
        for mode in modes:
            meaning = " ".join(options_of(mode).keys[key].split())[:40]
            assert meaning in " ".join(sections[where[_flag(key)][0]].split()), (key, mode)
    common = sections[COMMON] + sections[OPERATIONS]
    assert "--devices " in sections[COMMON]
    assert not set(_flags(common)) & {_flag(key) for key in option_owners()}


def test_a_system_option_the_flags_lacked_is_read() -> None:
    args = _parser().parse_args(["--mode", "fl", "--aggregation", "trimmed-mean",
                                 "--trim-fraction", "0.3", "--outlier-limit", "5",
                                 "--devices", "4"])
    options = config_from_args(args).options
    assert (options.trim_fraction, options.outlier_limit) == (0.3, 5.0)


@pytest.mark.parametrize("mode", list(BUILT_IN))
def test_help_mode_lists_the_common_options_and_the_mode_s(mode: str) -> None:
    parser = _parser()
    sections = _sections(topic_help(parser, mode))
    common, own = (section for title, section in sections.items() if title != "options")
    assert _flags(common) == _flags(_sections(parser.format_help())[COMMON])
    assert _flags(own) == [_flag(key) for key in options_of(mode).keys]
    for key, meaning in options_of(mode).keys.items():
        assert " ".join(meaning.split())[:40] in " ".join(own.split()), key


@pytest.mark.slow
def test_help_takes_a_mode_and_refuses_what_is_not_one() -> None:
    run = [sys.executable, "-m", "aiopipe"]
    hadfl = subprocess.run([*run, "--help", "hadfl"], capture_output=True, text=True,
                           timeout=60, cwd=REPO, check=True).stdout
    assert "options of mode hadfl (config file: the [hadfl] table):" in hadfl
    assert "--ring-size" in hadfl
    assert "--buffer-size" not in hadfl
    assert "--network" not in hadfl
    assert "  --local-steps LOCAL_STEPS\n                        capacity" in hadfl
    bogus = subprocess.run([*run, "--help", "gossip"], capture_output=True, text=True,
                           timeout=60, cwd=REPO)
    assert bogus.returncode == 2
    assert bogus.stderr.count("\n") == 1
    assert "a help topic is a mode, one of fl, sl" in bogus.stderr


@pytest.mark.slow  # (a python -m subprocess each)
@pytest.mark.parametrize(("module", "own"), [
    ("aiopipe", ["processes on this machine"]),
    ("aiopipe.server", ["where to listen, what to compute on", "security (see "
                        "docs/howto/security.md)", "checkpoints"])])
def test_the_command_s_own_options_come_last(module: str, own: list[str]) -> None:
    text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO, check=True).stdout
    titles = list(_sections(text))
    assert titles[:2] == ["options", COMMON]
    assert titles[-len(own) - 1:] == [OPERATIONS, *own]
    assert _sections(text)["options"].lstrip().startswith("-h [MODE], --help [MODE]\n")
    assert text.startswith(f"usage: python -m {module} [-h [MODE]] [--config FILE]")
