"""bench/dp_accounting.py on a tiny fleet: one row per run, epsilon falling as the noise
grows, none without DP, and the table it prints."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

pytest.importorskip("opacus")
bench = load_bench("dp_accounting")


@pytest.mark.slow  # (ten small trainings)
async def test_the_bench_reports_epsilon_falling_with_the_noise() -> None:
    args = bench.parse(["--local-devices", "2", "--local-samples", "64", "--local-epochs",
                        "1", "--central-devices", "20", "--central-epochs", "2"])
    rows = await bench.main(args)
    assert [r["kind"] for r in rows] == ["local"] * 4 + ["central"] * 5
    for kind in ("local", "central"):
        mine = [r for r in rows if r["kind"] == kind]
        assert mine[0]["epsilon"] is None
        epsilons = [r["epsilon"] for r in mine[1:4]]
        assert epsilons == sorted(epsilons, reverse=True)
        assert all(e > 0 for e in epsilons)
    assert rows[-1]["epsilon"] == rows[-3]["epsilon"]  # adaptive at z 1: z 1's epsilon
    text = bench.table(rows)
    assert text.count("\n") == len(rows) + 1
    assert "| local | DP-SGD sigma 1 |" in text
