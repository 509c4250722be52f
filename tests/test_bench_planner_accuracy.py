"""bench/planner_accuracy.py: its core functions on a tiny case, and its arithmetic.

Speed and accuracy depend on the machine and its load, so no figure is asserted: the
tests check that a case plans, runs and reports, that the records describe what ran,
and that the definitions (iteration time from a trace, errors, scores) compute what the
bench's docs say.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
from bench_scripts import load_bench

from aiopipe.metrics.trace import Slice


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("planner_accuracy")


def _tiny(bench: ModuleType) -> object:
    # prune=0: no sweep run is stopped for being slow, which on a busy machine one may be
    return bench.Settings(batch_size=2, samples_per_device=6, repeats=1, finalists=1,
                          profile_repeats=1, profile_warmup=0, prune=0.0)


@pytest.mark.slow
def test_a_tiny_case_plans_sweeps_and_reports(bench: ModuleType) -> None:
    settings = _tiny(bench)
    lines: list[str] = []
    record = bench.evaluate_case("vgg5", "wifi", settings, say=lines.append)
    # vgg5 has 5 units: P in 1..4, N in the divisors of B = 2, both devices alike
    plans = [tuple(map(tuple, c["plan"])) for c in record["candidates"]]
    assert {p[0] for p in plans} >= {(p, n) for p in range(1, 5) for n in (1, 2)}
    swept = [c for c in record["candidates"] if c["sweep"]]
    assert len(swept) == 8
    for c in swept:
        for key in ("epoch_s", "iteration_s", "wall_s"):
            assert math.isfinite(c["sweep"][key])
            assert c["sweep"][key] > 0
        assert c["estimate_iteration_s"] > 0
        assert math.isfinite(c["estimate_epoch_s"])
        assert c["estimate_epoch_s"] > c["estimate_iteration_s"]  # 3 iterations + transfers
    selected, optimum = record["selected"], record["optimum"]
    assert len(selected["plan"]) == 2
    assert len(selected["reruns"]) == 1  # repeats
    assert selected["epoch_s"] == selected["reruns"][0]["epoch_s"]
    # the re-runs run two epochs: the first one's trace gives the live estimate
    live = selected["live_estimate_iteration_s"]
    assert live == selected["reruns"][0]["live_estimate_iteration_s"]
    assert 0 < live < math.inf
    assert all(c["sweep"]["live_estimate_iteration_s"] is None for c in swept)  # one epoch
    assert optimum["reruns"]  # the optimum is a finalist, measured again
    # the re-planner's choice after the planner's plan's first round: measured too
    replanned = record["replanned"]
    assert replanned is not None
    assert replanned["reruns"]
    assert record["score_replanned"] == pytest.approx(optimum["epoch_s"]
                                                      / replanned["epoch_s"])
    sweep_of_selected = next(c for c in swept if c["plan"] == selected["plan"])
    assert [list(p) for p in sweep_of_selected["sweep"]["replanned"]] == replanned["plan"]
    lo, hi = selected["epoch_range_s"]
    assert lo <= selected["epoch_s"] <= hi
    assert record["score"] == pytest.approx(optimum["epoch_s"] / selected["epoch_s"])
    assert 0 < record["search_s"] == pytest.approx(record["profile_s"] + record["select_s"])
    assert record["search_fraction"] == pytest.approx(record["search_s"] / selected["epoch_s"])
    # the reference epoch: 50,000 samples over 2 devices at B = 2 is 12,500 iterations
    assert settings.reference_iterations() == 12_500
    assert record["search_fraction_reference"] == pytest.approx(
        record["search_s"] / (12_500 * selected["iteration_s"]))
    assert record["exhaustive_s"] == pytest.approx(sum(c["sweep"]["wall_s"] for c in swept))
    assert any("selected" in line for line in lines)

    report = bench.markdown([record], {
        "date": "today", "command": "bench", "cases": 1, "wall_s": 1.0, "load_before": 0.5,
        "load_after": 0.5, "cpus": 2, "settings": bench.asdict(settings), "machine": "m"})
    assert "| vgg5 | wifi |" in report
    assert "Median |error|" in report
    assert "From live measurements (after one round): median |error| iteration **" in report
    figures = bench.summary([record])
    assert figures["score_min"] == record["score"]
    assert figures["score_replanned_min"] == record["score_replanned"]
    assert "After re-planning from the first round: mean **" in report
    assert figures["search_fraction_reference_max"] == record["search_fraction_reference"]
    assert "over a reference epoch mean **" in report
    assert figures["sweep_runs"] == 8


@pytest.mark.slow
def test_the_planner_is_reproduced_and_untrainable_sizes_are_left_out(
    bench: ModuleType,
) -> None:
    # resnet18's last blocks have a 1x1 map: batch norm cannot train on one sample
    planned = bench.plan_case(bench.Settings(batch_size=2, samples_per_device=4,
                                             profile_repeats=1, profile_warmup=0)
                              .config("resnet18", "4g"), _tiny(bench))
    assert math.isinf(planned.costs.forward_time(0, planned.costs.units, 1))
    assert all(n == 1 for _, n in planned.plan)  # N = 2 means B' = 1
    assert all(plan[0][1] == 1 for plan in bench.candidates(planned))
    iteration, epoch = planned.estimate(planned.plan)
    assert 0 < iteration < epoch < math.inf
    assert planned.search_s > 0


def test_iteration_time_skips_the_first_iteration_and_takes_the_slowest_device(
    bench: ModuleType,
) -> None:
    trace = [
        Slice("device0/compute", "f", 0.0, 1.0, 0, 0, 0),
        Slice("device0/compute", "step", 1.0, 5.0, 0, 0, -1),  # a slow first iteration
        Slice("device0/compute", "f", 5.0, 6.0, 0, 1, 0),
        Slice("device0/compute", "step", 6.0, 7.0, 0, 1, -1),
        Slice("device0/compute", "f", 7.0, 8.0, 0, 2, 0),
        Slice("device0/compute", "step", 8.0, 9.0, 0, 2, -1),
        Slice("device1/compute", "f", 0.5, 1.0, 0, 0, 0),
        Slice("device1/compute", "f", 1.0, 2.0, 0, 1, 0),
        Slice("device1/compute", "step", 2.0, 4.0, 0, 1, -1),
        Slice("device1/compute", "f", 4.0, 9.0, 0, 2, 0),
        Slice("device1/compute", "step", 9.0, 10.0, 0, 2, -1),
        Slice("server/compute", "s", 0.0, 100.0, 0, 1, 0),  # not a device's
        Slice("device0/compute", "f", 50.0, 60.0, 1, 1, 0),  # another epoch
    ]
    assert bench.steady_iteration_s(trace, 2, 0) == pytest.approx((10.0 - 1.0) / 2)
    with pytest.raises(ValueError, match="device 0 ran 1 iterations in epoch 2"):  # from 1
        bench.steady_iteration_s(trace, 2, 1)


def test_arithmetic(bench: ModuleType) -> None:
    assert bench.divisors(12) == [1, 2, 3, 4, 6, 12]
    assert bench.error(0.9, 1.0) == pytest.approx(-0.1)
    assert bench.format_plan([[2, 4], [2, 4]]) == "P=2 N=4"
    assert bench.format_plan([[2, 4], [1, 8]]) == "d0:P2N4 d1:P1N8"
    assert bench.finite({"a": [1.0, math.inf], "b": (math.nan,)}) == {"a": [1.0, None],
                                                                      "b": [None]}
