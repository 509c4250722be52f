"""bench/startup.py: what it reads from the processes' logs matches what the runtime
logs (aiopipe.runtime.cost_cache, aiopipe.runtime.profiling), and its table."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_bench

from aiopipe.runtime.cost_cache import cached_costs
from aiopipe.scheduler.costs import CostTable


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("startup")


def test_it_finds_where_each_table_came_from_in_the_log(
        bench: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = CostTable.uniform(2, forward=0.001, backward=0.001, batch=1)
    with caplog.at_level(logging.INFO, logger="aiopipe.runtime"):
        cached_costs("k", lambda _: table, [1], tmp_path, what="device 3's profile")
        cached_costs("k", lambda _: table, [1], tmp_path, what="the server's cost table")
    found = bench.TABLE_LINE.findall(caplog.text)
    assert [what for what, _ in found] == ["device 3's profile", "the server's cost table"]
    assert found[0][1].startswith("measured in ")
    assert found[1][1] == f"read from {tmp_path / 'k.json'}"


def test_its_table_has_a_row_per_arm(bench: ModuleType) -> None:
    figures = dict.fromkeys(bench.FIGURES, 1.5)
    text = bench.table([("cold", figures), ("warm", {"error": "boom"})])
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| cold | 1.50 |")
    assert "error: boom" in lines[3]
