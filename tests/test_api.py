"""The public API: a sorted, complete ``__all__``, and no CLI module behind ``import aiopipe``."""

import __future__  # aiopipe's own `from __future__ import annotations` is no export

import inspect
import json
import logging
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import aiopipe
from aiopipe import CostTable, RunConfig, VirtualClock, simulate

REPO = Path(__file__).resolve().parents[1]
CLI_MODULES = ("aiopipe.__main__", "aiopipe.server", "aiopipe.device", "aiopipe.cli",
               "aiopipe.timeline", "aiopipe.auth.__main__")


def _public_names() -> set[str]:
    # dir(): the names imported on first use (PEP 562) count too
    return {
        name
        for name in dir(aiopipe)
        if not name.startswith("_")
        and not isinstance(getattr(aiopipe, name), ModuleType | __future__._Feature)
    }


def test_all_is_sorted_and_unique() -> None:
    assert aiopipe.__all__ == sorted(aiopipe.__all__)
    assert len(set(aiopipe.__all__)) == len(aiopipe.__all__)


def test_all_is_complete() -> None:
    assert set(aiopipe.__all__) == _public_names()


def test_everything_in_all_exists_and_is_documented() -> None:
    for name in aiopipe.__all__:
        value = getattr(aiopipe, name)
        assert inspect.getdoc(value), name
        assert value.__module__.startswith("aiopipe."), name


def test_the_contract_names_are_exported() -> None:
    # DESIGN §6: these stay.
    for name in (
        "RunConfig",
        "simulate",
        "Server",
        "Device",
        "RunResult",
        "EpochMetrics",
        "SystemClock",
        "VirtualClock",
        "AiopipeError",
        "ConfigError",
    ):
        assert name in aiopipe.__all__


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from aiopipe import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(aiopipe.__all__)


def test_errors_share_one_root() -> None:
    errors = [getattr(aiopipe, n) for n in aiopipe.__all__ if n.endswith("Error")]
    assert errors
    assert all(issubclass(e, aiopipe.AiopipeError) for e in errors)


def test_version_matches_the_project() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert aiopipe.__version__ == project["version"]


def test_import_aiopipe_does_not_import_the_commands() -> None:
    code = (
        "import json, sys\n"
        "import aiopipe\n"
        f"print(json.dumps([m for m in {list(CLI_MODULES)!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


async def test_simulate_without_progress_logs_each_epoch(
        caplog: pytest.LogCaptureFixture) -> None:
    config = RunConfig(devices=1, samples_per_device=40, batch_size=20, parallel_batches=2,
                       split_point=2, epochs=2, test_samples=20)
    with caplog.at_level(logging.INFO, logger="aiopipe.simulate"):
        costs = CostTable.uniform(5, forward=0.001, backward=0.002)
        await simulate(config, clock=VirtualClock(), cost_table=costs)
    lines = [r.getMessage() for r in caplog.records if r.name == "aiopipe.simulate"]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
