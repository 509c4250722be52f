"""Each system declares and checks its own options (aiopipe.runtime.systems.registry
`SystemOptions`): a config file holds them in the mode's table (``--help`` groups them
by system: tests/test_cli_help.py), a run of another system keeps them at their
defaults, and neither the runtime (outside the systems' own packages) nor config.py
compares modes."""

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
def test_every_declared_option_is_a_field_of_the_systems_own_with_a_meaning(mode: str) -> None:
    """RunConfig keeps what every run has: a system's options are its own dataclass's."""
    common = {f.name for f in dataclasses.fields(RunConfig)}
    options = options_of(mode)
    assert options.table == mode
    assert set(options.keys) == {f.name for f in dataclasses.fields(options.values)}
    assert not set(options.keys) & common
    assert all(text.strip() for text in options.keys.values())
    assert isinstance(RunConfig(mode=mode, devices=3).options, options.values)


def test_another_systems_option_keeps_its_default_and_the_refusal_names_its_modes() -> None:
    with pytest.raises(ConfigError, match=r"'local_steps'.*mode pipar.*\"hadfl\""):
        RunConfig(mode="pipar", options={"local_steps": 3})
    with pytest.raises(ConfigError, match=r"'partition'.*\"pipeline\", \"ftpipehd\" and "
                                          r"\"asteroid\""):
        RunConfig(mode="sfl", options={"partition": (2,)})
    assert RunConfig(mode="hadfl", options={"local_steps": 3}).options.local_steps == 3


def test_the_modes_table_holds_its_options(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('mode = "hadfl"\ndevices = 4\n[hadfl]\nlocal_steps = 3\nring_size = 2\n'
                    '[ftpipehd]\nglobal_replication_every = 7\n')
    config = RunConfig.from_toml(path)
    assert (config.options.local_steps, config.options.ring_size) == (3, 2)
    assert not hasattr(config.options, "global_replication_every")  # not this run's table
    # the same file run as ftpipehd takes that table instead
    ftpipehd = RunConfig.from_toml(path, mode="ftpipehd")
    assert ftpipehd.options.global_replication_every == 7
    assert not hasattr(ftpipehd.options, "local_steps")


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
    assert (config.mode, config.options.rescheduling) == ("asteroid", "heavy")


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


# -- the old flat form: read for one release, with a FutureWarning ----------------------


def test_flat_keys_in_python_are_read_with_a_warning_saying_where_they_go() -> None:
    new = RunConfig(mode="hadfl", devices=3, options={"ring_size": 2, "local_steps": 4})
    with pytest.warns(FutureWarning, match=r"RunConfig\(\): ring_size, local_steps are system "
                                           r"options.*options=\{'ring_size': \.\.\."):
        old = RunConfig(mode="hadfl", devices=3, ring_size=2, local_steps=4)  # type: ignore[call-arg]
    assert old == new
    with pytest.warns(FutureWarning, match=r"config\.ring_size .*config\.options\.ring_size"):
        assert old.ring_size == 2  # type: ignore[attr-defined]
    with pytest.warns(FutureWarning, match=r"replace\(\): group_size"):
        assert old.replace(group_size=3) == new.replace(options={"group_size": 3})
    with pytest.raises(ConfigError, match="'ring_size' is given twice"), \
            pytest.warns(FutureWarning):
        RunConfig(mode="hadfl", ring_size=2, options={"ring_size": 3})  # type: ignore[call-arg]


def test_flat_keys_at_a_files_top_level_are_read_with_a_warning(tmp_path: Path) -> None:
    import argparse

    flat = tmp_path / "flat.toml"
    flat.write_text('mode = "ftpipehd"\ndevices = 3\nglobal_replication_every = 7\n')
    table = tmp_path / "table.toml"
    table.write_text('mode = "ftpipehd"\ndevices = 3\n[ftpipehd]\nglobal_replication_every = 7\n')
    with pytest.warns(FutureWarning, match=r"top level: global_replication_every is a system "
                                           r"option.*under \[ftpipehd\]"):
        old = RunConfig.from_toml(flat)
    assert old == RunConfig.from_toml(table)
    assert old.options.global_replication_every == 7
    parser = argparse.ArgumentParser()
    add_run_options(parser)
    with pytest.warns(FutureWarning, match=r"under \[ftpipehd\]"):
        assert config_from_args(parser.parse_args(["--config", str(flat)])) == old
    # flags are not the old form: no warning
    assert config_from_args(parser.parse_args(
        ["--config", str(table), "--chain-replication-every", "5"])).options == \
        old.options.__class__(global_replication_every=7, chain_replication_every=5)


def test_a_config_file_holds_the_systems_options_in_its_table() -> None:
    config = RunConfig(mode="asteroid", devices=3, options={"rescheduling": "heavy"})
    text = config.to_toml()
    top, _, table = text.partition("\n[asteroid]\n")
    assert 'rescheduling = "heavy"' in table
    assert not any(line.split(" = ")[0] in option_owners() for line in top.splitlines())
    mapping = config.to_mapping()
    assert mapping["asteroid"]["rescheduling"] == "heavy"
    assert "rescheduling" not in mapping


def test_an_old_flat_config_mapping_is_read_quietly_where_the_user_did_not_write_it() -> None:
    """An older checkpoint's config (every system's key at top level, the others' at
    their defaults) resumes: `from_mapping(..., warn=False)`."""
    import warnings

    config = RunConfig(mode="hadfl", devices=3, options={"ring_size": 2})
    old = {k: v for k, v in config.to_mapping().items() if k != "hadfl"}
    for mode in MODES:
        old.update(options_of(mode).defaults())
    old.update(config.to_mapping()["hadfl"])
    old = {k: list(v) if isinstance(v, tuple) else v for k, v in old.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RunConfig.from_mapping(old, warn=False) == config
    with pytest.warns(FutureWarning):
        assert RunConfig.from_mapping(old) == config


def test_a_server_started_on_an_old_flat_file_logs_one_line_per_warning(tmp_path: Path) -> None:
    """Between processes: the deprecation is one log line (not a Python warning's two),
    and the run's own error still says what is wrong."""
    import subprocess
    import sys

    path = tmp_path / "old.toml"
    path.write_text('mode = "hadfl"\ndevices = 3\nring_size = 2\nepochs = 0\n')
    done = subprocess.run([sys.executable, "-m", "aiopipe.server", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    [warned] = [line for line in lines if "FutureWarning" in line]
    assert "ring_size is a system option" in warned
    assert "under [hadfl]" in warned
    assert "warnings.warn" not in done.stderr
    assert "config key 'epochs'" in done.stderr
