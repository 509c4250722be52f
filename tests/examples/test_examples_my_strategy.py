"""examples/my_strategy.py, a strategy of the user's own (aiopipe.strategies; issue 45):
named with ``--aggregation module:Class`` from the launcher, it is the one the run's
server uses between real device processes; a bad one is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _aiopipe(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    path = [str(ROOT), str(ROOT / "tests" / "no_pictures"), os.environ.get("PYTHONPATH")]
    return subprocess.run(
        [sys.executable, "-m", "aiopipe", *args, "--out-dir", str(out)],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))})


@pytest.mark.slow
def test_my_strategy_runs_from_the_launcher_between_real_processes(tmp_path: Path) -> None:
    process = _aiopipe("--mode", "fl", "--aggregation", "my_strategy:DampedFedAvg",
                       "--aggregation-options", "server_learning_rate=0.25",
                       "--devices", "2", "--epochs", "1", "--samples-per-device", "40",
                       "--batch-size", "20", "--aggregation-every", "1",
                       "--test-samples", "40", out=tmp_path / "results")
    output = process.stdout + process.stderr
    assert process.returncode == 0, output[-3000:]
    # two rounds of one iteration each: the user's strategy installed both
    assert "DampedFedAvg: round 1 installed, moved 0.25 of the way" in output, output[-3000:]
    assert "DampedFedAvg: round 2 installed" in output, output[-3000:]
    config = (tmp_path / "results" / "config.toml").read_text()
    assert 'aggregation = "my_strategy:DampedFedAvg"' in config
    assert "server_learning_rate = 0.25" in config


@pytest.mark.slow
@pytest.mark.parametrize(("args", "says"), [
    (("--aggregation", "my_strategy:NoSuchStrategy"),
     "config key 'aggregation': aggregation 'my_strategy:NoSuchStrategy': my_strategy has "
     "no NoSuchStrategy"),
    (("--aggregation", "my_strategy:DampedFedAvg", "--aggregation-options",
      "server_learning_rate=3"),
     "server_learning_rate must be in (0, 1], got 3"),
])
def test_a_bad_strategy_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...],
                                              says: str) -> None:
    process = _aiopipe("--mode", "fl", *args, out=tmp_path / "results")
    assert process.returncode == 2, process.stderr[-2000:]
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert says in lines[0], process.stderr
