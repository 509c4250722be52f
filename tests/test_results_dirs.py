"""Results are never overwritten: a run without ``out_dir`` gets a directory of its own,
even when several start in the same second, and one given a directory that holds an
earlier run's results is refused before it starts. (The commands: tests/test_cli.py,
case ``out-dir-holds-results``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiopipe import ConfigError, RunConfig, Server, VirtualClock, simulate
from aiopipe.metrics.results import RESULT_NAMES, check_fresh_out_dir, new_out_dir


def test_runs_started_in_one_second_get_directories_of_their_own(tmp_path: Path) -> None:
    made = [new_out_dir(tmp_path / "runs") for _ in range(3)]
    assert len(set(made)) == 3
    assert all(path.is_dir() for path in made)
    assert made[1].name == f"{made[0].name}-2"
    server = new_out_dir(tmp_path / "runs", stem="server")
    assert server.name.startswith("server-")


@pytest.mark.parametrize("name", RESULT_NAMES)
def test_a_directory_with_results_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("")
    with pytest.raises(ConfigError, match="already holds a run's results"):
        check_fresh_out_dir(tmp_path)


def test_an_empty_or_missing_directory_is_fine(tmp_path: Path) -> None:
    check_fresh_out_dir(tmp_path)
    check_fresh_out_dir(tmp_path / "new")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_fresh_out_dir(tmp_path / "file")


@pytest.mark.slow
async def test_simulate_and_server_refuse_to_overwrite(tmp_path: Path) -> None:
    config = RunConfig(devices=1, samples_per_device=20, batch_size=10, epochs=1,
                       test_samples=10, out_dir=str(tmp_path / "run"))
    await simulate(config, clock=VirtualClock())
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="already holds"):
        await simulate(config, clock=VirtualClock())
    with pytest.raises(ConfigError, match="already holds"):
        Server(config)
