"""bench/secagg.py's pieces that need no training: one timed library round, with and
without devices lost (the whole bench runs trainings and processes: not here)."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

pytest.importorskip("cryptography")


def test_one_timed_protocol_round_with_losses() -> None:
    bench = load_bench("secagg")
    found = bench.protocol(6, 50, 2)
    assert found["degree"] == 5
    assert found["threshold"] == 4  # more than half of 6 holders
    assert found["client_mean_s"] >= 0
    assert found["server_s"] > 0


def test_the_runs_differ_only_in_secure_aggregation() -> None:
    bench = load_bench("secagg")
    plain, secure = bench.config(10, False), bench.config(10, True)
    assert secure.replace(options={"secure_aggregation": False}) == plain
    assert secure.options.secure_aggregation
