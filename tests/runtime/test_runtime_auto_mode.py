"""mode = "auto" ([Note: choosing the system] in aiopipe.scheduler.auto): in virtual time,
charged from the same table the estimate uses, auto runs the candidate whose run is
fastest, each candidate's prediction matches its own run, and the choice follows the
fleet (fl where the server would be the bottleneck, pipar where devices are slow)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.scheduler import CostTable
from aiopipe.testing import open_fleet

COSTS = dataclasses.replace(
    CostTable.uniform(5, forward=0.002, backward=0.004, step=0.001, batch=1),
    aggregate=(0.003, 0.002),
)
FORCED = {"fl": {}, "sfl": {"split_point": "auto"},
          "pipar": {"split_point": "auto", "parallel_batches": "auto"}}


async def _epoch(config: RunConfig) -> tuple[float, list[dict[str, int]]]:
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert result.final.plan is not None
    return result.final.time_s, list(result.final.plan)


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "slowdown", "network", "expected"), [
    (8, 1.0, "wifi", "fl"),    # eight server halves on one server: fl trains in parallel
    (2, 8.0, "wifi", "pipar"),  # slow devices: the server takes most units, pipelined
])
async def test_auto_runs_the_fastest_candidate(devices: int, slowdown: float, network: str,
                                               expected: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    base = RunConfig(devices=devices, samples_per_device=48, batch_size=12, epochs=1,
                     test_samples=100, device_slowdown=slowdown, network=network, seed=1)
    measured = {mode: await _epoch(base.replace(mode=mode, **extra))
                for mode, extra in FORCED.items()}
    with caplog.at_level(logging.INFO, logger="aiopipe.server"):
        auto_time, auto_plan = await _epoch(base.replace(mode="auto"))
    fastest = min(measured, key=lambda mode: measured[mode][0])
    assert fastest == expected
    # the same epoch, to the last bits but one: it starts once the devices have their
    # `Plan`, which carries the run's config (auto's is longer), and its span is a
    # difference of clock times that then round differently
    assert auto_plan == measured[fastest][1]
    assert auto_time == pytest.approx(measured[fastest][0], rel=1e-12, abs=0)
    message = next(r.getMessage() for r in caplog.records if "auto chose" in r.getMessage())
    assert message.startswith(f"auto chose {expected} ")
    # each candidate's predicted epoch, as the table shows it, is its run's (virtual time
    # charged from the estimate's own table: [Note: epoch approximation])
    predicted = {m[1]: float(m[2]) for m in re.finditer(r"^(?:->|  )(\w+) +([\d.]+)",
                                                         message, re.MULTILINE)}
    assert predicted.keys() == measured.keys()
    for mode, (seconds, _) in measured.items():
        assert predicted[mode] == pytest.approx(seconds, rel=0.02, abs=0.01), mode


async def test_candidates_limit_the_choice_and_status_names_it() -> None:
    config = RunConfig(mode="auto", devices=2, samples_per_device=48, batch_size=12, epochs=1,
                       test_samples=100, device_slowdown=8.0, network="wifi",
                       options={"candidates": ["fl"]})
    async with open_fleet(config, cost_table=COSTS) as fleet:
        result = await fleet.train()
        assert fleet.node.describe()["mode"] == "fl"  # what GET /status answers
    assert result.final.plan is not None
    assert {p["split_point"] for p in result.final.plan} == {5}  # the whole model


def test_candidates_are_checked() -> None:
    with pytest.raises(ConfigError, match="candidates"):
        RunConfig(mode="auto", options={"candidates": ["hadfl"]})
    with pytest.raises(ConfigError, match="candidates"):
        RunConfig(mode="auto", options={"candidates": []})


@pytest.mark.slow
def test_explain_prints_the_table_without_training(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--mode", "auto", "--explain", "--devices", "2",
         "--samples-per-device", "48", "--batch-size", "12", "--candidates", "fl,pipar",
         "--device-slowdown", "8", "--network", "wifi", "--out-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "AIOPIPE_COST_CACHE": str(tmp_path / "costs")})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("auto chose ")
    assert [line[2:].split()[0] for line in lines[2:]] == ["fl", "pipar"]
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
    refused = subprocess.run([sys.executable, "-m", "aiopipe", "--explain"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "mode auto" in refused.stderr
