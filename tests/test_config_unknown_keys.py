"""Unknown config keys: every one is named, each with the known key it likely meant,
whether it comes from a mapping, a TOML file or a command's ``--config``."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiopipe.cli import ArgumentParser, add_run_options, config_from_args
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError

WANT = ("unknown config keys 'epoch' (did you mean 'epochs'?), 'lr' (did you mean "
        "'learning_rate'?)")


def _error(values: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping(values)
    return str(caught.value)


def test_every_unknown_key_is_named_with_a_guess() -> None:
    assert _error({"mode": "pipar", "epoch": 2, "lr": 0.1}) == WANT


@pytest.mark.parametrize(("key", "guess"), [
    ("split_pont", "split_point"),  # a typo
    ("Batch-Size", "batch_size"),  # another case, dashes
    ("lr", "learning_rate"),  # initials
    ("device", "devices"),
])
def test_a_close_key_is_suggested(key: str, guess: str) -> None:
    assert _error({key: 1}) == f"unknown config key {key!r} (did you mean {guess!r}?)"


def test_initials_of_several_keys_suggest_each() -> None:
    assert _error({"bs": 1}) == ("unknown config key 'bs' (did you mean 'batch_size' or "
                                 "'buffer_size'?)")


def test_a_key_like_none_lists_the_known_keys() -> None:
    message = _error({"zzz": 1, "epoch": 2})
    assert message.startswith("unknown config keys 'zzz', 'epoch' (did you mean 'epochs'?); "
                              "known keys: aggregation, ")
    assert "learning_rate" in message


@pytest.mark.parametrize("table", ["", "[run]\n"])
def test_a_toml_file_and_the_commands_report_them_alike(tmp_path: Path, table: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'{table}mode = "pipar"\nepoch = 2\nlr = 0.1\n')
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_toml(path)
    assert str(caught.value) == WANT
    parser = ArgumentParser(prog="test")
    add_run_options(parser)
    with pytest.raises(ConfigError) as caught:
        config_from_args(parser.parse_args(["--config", str(path)]))
    assert str(caught.value) == WANT
