"""Each system declares and checks its own options (aiopipe.runtime.systems.registry
`SystemOptions`): a config file holds them in the mode's table, ``--help`` groups them by
system, a run of another system keeps them at their defaults, and neither the runtime
(outside the systems' own packages) nor config.py compares modes."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from aiopipe.cli import add_run_options, config_from_args
from aiopipe.config import MODES, RunConfig
from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.registry import option_owners, options_of

PACKAGE = Path(__file__).resolve().parent.parent / "aiopipe"


@pytest.mark.parametrize("mode", MODES)
def test_every_declared_option_is_a_config_key_with_a_meaning(mode: str) -> None:
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    options = options_of(mode)
    assert options.table == mode
    assert set(options.keys) <= fields
    assert all(text.strip() for text in options.keys.values())


def test_another_systems_option_keeps_its_default_and_the_refusal_names_its_modes() -> None:
    with pytest.raises(ConfigError, match=r"'local_steps'.*mode pipar.*\"hadfl\""):
        RunConfig(mode="pipar", local_steps=3)
    with pytest.raises(ConfigError, match=r"'partition'.*\"pipeline\", \"ftpipehd\" and "
                                          r"\"asteroid\""):
        RunConfig(mode="sfl", partition=(2,))
    assert RunConfig(mode="hadfl", local_steps=3).local_steps == 3


def test_the_modes_table_holds_its_options(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('mode = "hadfl"\ndevices = 4\n[hadfl]\nlocal_steps = 3\nring_size = 2\n'
                    '[ftpipehd]\nglobal_replication_every = 7\n')
    config = RunConfig.from_toml(path)
    assert (config.local_steps, config.ring_size) == (3, 2)
    assert config.global_replication_every == 100  # another system's table: not this run's
    # the same file run as ftpipehd takes that table instead
    ftpipehd = RunConfig.from_toml(path, mode="ftpipehd")
    assert (ftpipehd.global_replication_every, ftpipehd.local_steps) == (7, "capacity")


@pytest.mark.parametrize(("text", "reason"), [
    ('mode = "hadfl"\n[hadfl]\nsplit_point = 2\n', r"\[hadfl\] holds 'split_point', which "
                                                  r"is not an option of mode hadfl"),
    ('mode = "pipar"\n[hadfl]\nbogus = 1\n', r"\[hadfl\] holds 'bogus'"),
    ('mode = "hadfl"\nlocal_steps = 2\n[hadfl]\nlocal_steps = 3\n',
     r"'local_steps' is both at top level and under \[hadfl\]"),
])
def test_a_table_that_does_not_fit_is_refused(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=reason):
        RunConfig.from_toml(path)


def test_the_command_line_takes_the_table_of_the_mode_it_names(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "run.toml"
    path.write_text('mode = "pipar"\n[asteroid]\nrescheduling = "heavy"\n')
    parser = argparse.ArgumentParser()
    add_run_options(parser)
    args = parser.parse_args(["--config", str(path), "--mode", "asteroid", "--devices", "3"])
    config = config_from_args(args)
    assert (config.mode, config.rescheduling) == ("asteroid", "heavy")


def test_help_groups_each_systems_options() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_run_options(parser)
    text = parser.format_help()
    text = text[text.index("run options"):]  # (after the usage line)
    hadfl = text[text.index("options of mode hadfl:"):]
    assert "--local-steps" in hadfl.split("\n\n")[0]
    general = text[:text.index("options of mode")]
    assert "--local-steps" not in general
    assert "--devices" in general
    for key in option_owners():
        flag = "--" + key.replace("_", "-") + " "
        if flag in text:
            assert text.index(flag) > text.index("options of mode"), flag


def _mode_comparisons(path: Path) -> list[str]:
    """Where ``path`` compares a mode: ``mode == ...``, ``mode in (...)``, ``*_MODES``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            names = [n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                     for n in (node.left, *node.comparators)]
            if "mode" in names or any(name.endswith("_MODES") for name in names):
                found.append(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Name) and node.id.endswith("_MODES"):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_mode_is_compared_outside_the_systems_packages() -> None:
    runtime = PACKAGE / "runtime"
    own = {p for p in (runtime / "systems").iterdir() if p.is_dir()}
    modules = [p for p in runtime.rglob("*.py") if not any(d in p.parents for d in own)]
    found = [where for path in [*modules, PACKAGE / "config.py"]
             for where in _mode_comparisons(path)]
    assert found == []
