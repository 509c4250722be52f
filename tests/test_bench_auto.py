"""bench/auto.py: it reads mode auto's choice and table as the coordinator logs them
(aiopipe.scheduler.auto.summary and explain), and its verdict per configuration."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from bench_scripts import load_bench

from aiopipe.scheduler.auto import SystemEstimate, explain, summary


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("auto")


def _estimates() -> list[SystemEstimate]:
    return [SystemEstimate("fl", ((5, 1),) * 4, 4.63, (("device0 uplink", 1.95),)),
            SystemEstimate("sfl", refusal="device 0's memory budget (1.0 MiB) is below"),
            SystemEstimate("pipar", ((2, 10), (2, 10), (4, 2), (4, 2)), 4.68,
                           (("device0 compute", 1.0), ("device0 uplink", 2.17)))]


def test_it_reads_the_choice_and_every_row_of_the_logged_table(bench: ModuleType) -> None:
    estimates = _estimates()
    log = (f"2026-11-29 03:10:41 python -m aiopipe.server: "
           f"{summary(estimates, estimates[0])}\n{explain(estimates, estimates[0])}\n"
           "2026-11-29 03:10:41 python -m aiopipe.server: planned fl: ...\n")
    found = bench.predictions(log)
    assert found["chosen"] == "fl"
    assert found["candidates"] == {
        "fl": {"epoch_s": 4.63, "bound": "device0 uplink (1.95)", "plan": "P5N1 x4",
               "chosen": True},
        "sfl": {"epoch_s": None, "refusal": "device 0's memory budget (1.0 MiB) is below",
                "chosen": False},
        "pipar": {"epoch_s": 4.68, "bound": "device0 uplink (2.17)",
                  "plan": "P2N10 x2, P4N2 x2", "chosen": False}}
    assert bench.predictions("no choice here") == {}


def test_it_reads_the_second_look(bench: ModuleType) -> None:
    estimates = _estimates()
    first = f"{summary(estimates, estimates[0])}\n{explain(estimates, estimates[0])}\n"
    tried = ("auto tries pipar (P2N10 x2, P4N2 x2) for round 2: predicted 4.68 s per epoch "
             "from the round's speeds, fl measured 5.10 s:\n")
    for log, expected in [
            ("auto keeps fl after the first round: it measured 4.70 s per epoch; ...",
             (None, "fl")),
            (f"{tried}auto keeps pipar after trying it: it measured 4.50 s per epoch, fl "
             "5.10 s", ("pipar", "pipar")),
            (f"{tried}auto goes back to fl after trying pipar: fl measured 5.10 s per "
             "epoch, pipar 5.60 s:", ("pipar", "fl")),
            (f"{tried}auto tries sfl (P4N1, P4N1) for round 3: ...\nauto goes back to "
             "pipar after trying fl, sfl: measured per epoch ...", ("pipar, sfl", "pipar"))]:
        found = bench.predictions(first + log)
        assert (found["first"], found["tried"], found["chosen"]) == ("fl", *expected)
        assert found["candidates"]["fl"]["epoch_s"] == 4.63  # the first choice's table
    close = (f"{tried}auto runs pipar one more round (round 3): measured per epoch fl "
             "5.10 s, pipar 5.00 s, within 10% of the fastest: closer than one round each "
             "tells apart\nauto runs fl one more round (round 4): ...\nauto goes back to "
             "pipar after trying pipar: measured per epoch fl 5.20 s, pipar 4.90 s:")
    found = bench.predictions(first + close)
    assert (found["tried"], found["again"], found["chosen"]) == ("pipar", "pipar, fl", "pipar")


def _run(*times: float, plan: tuple[tuple[int, int], ...] = ((4, 2),) * 2) -> dict[str, Any]:
    layout = [{"device": k, "split_point": p, "parallel_batches": n}
              for k, (p, n) in enumerate(plan)]
    return {"epochs": [{"time_s": t, "plan": layout} for t in times]}


def test_its_verdict_measures_after_the_first_epoch_and_compares_auto_with_the_fastest(
        bench: ModuleType) -> None:
    estimates = _estimates()
    config = {
        "workload": "vgg5", "network": "4g", "fleet": "half-slow",
        "predicted": bench.predictions(f"{summary(estimates, estimates[0])}\n"
                                       f"{explain(estimates, estimates[0])}"),
        "runs": {"auto": _run(9.0, 5.5, plan=((5, 1),) * 2), "fl": _run(9.0, 5.0),
                 "sfl": {"error": "boom"}, "pipar": _run(9.0, 4.0, 6.0)},
    }
    v = bench.verdict(config)
    assert v["rows"]["pipar"]["measured_s"] == 5.0  # epochs 2 and 3
    tried = {"epochs": [{"time_s": 9.0}, {"time_s": 7.0, "changes": [{"mode": "sfl"}]},
                        {"time_s": 5.0, "changes": [{"mode": "fl"}]}, {"time_s": 4.0},
                        {"time_s": 4.5}]}
    assert bench.measured_epoch(tried) == 4.5  # after the settled system's first epoch
    assert bench.measured_epoch({"epochs": tried["epochs"][:4]}) == 4.0  # or its only one
    assert bench.measured_epoch({"epochs": tried["epochs"][:3]}) is None
    assert v["rows"]["pipar"]["plan"] == "P4N2 x2"
    assert v["rows"]["sfl"]["measured_s"] is None
    assert (v["chosen"], v["fastest"], v["picked_fastest"]) == ("fl", "fl", True)
    assert v["ratio"] == pytest.approx(1.1)
    text = bench.table(config)
    assert "| sfl | - | " in text
    assert "failed: boom" in text
    assert ("auto measured / fastest measured = 1.100 (**over 5%**); "
            "the pick's forced run / fastest = 1.000") in text
    assert bench.summary([config]).splitlines()[2].startswith(
        "| vgg5 | 4g | half-slow | 4.63 / 5.00 | - / - | 4.68 / 5.00 | fl | fl | 5.50 | 1.100 "
        "| 1.000 |")


def test_it_pools_a_configuration_run_twice(bench: ModuleType) -> None:
    estimates = _estimates()
    predicted = bench.predictions(f"{summary(estimates, estimates[2])}\n"
                                  f"{explain(estimates, estimates[2])}")
    rounds = [{"workload": "vgg5", "network": "wifi", "fleet": "homogeneous",
               "predicted": predicted,
               "runs": {"auto": _run(9.0, a), "fl": _run(9.0, f), "sfl": _run(9.0, 7.0),
                        "pipar": _run(9.0, p)}} for a, f, p in ((4.0, 3.0, 4.0),
                                                                 (4.0, 5.0, 4.0))]
    lines = bench.pooled(rounds).splitlines()
    assert lines[2] == ("| vgg5 | wifi | homogeneous | 2 | 4.00 | 7.00 | 4.00 | pipar, pipar "
                        "| fl | 4.00 | 1.000 | 1.000, 1.000 |")
    # each round's pick is judged by the pooled forced runs: a round that picked sfl
    rounds[1]["predicted"] = {**predicted, "chosen": "sfl"}
    assert bench.pooled(rounds).splitlines()[2].endswith("| 4.00 | 1.000 | 1.000, 1.750 |")
    assert bench.pooled(rounds[:1]) == ""
