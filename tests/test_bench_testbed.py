"""bench/testbed.py (issue 27's paper testbed) and the options of bench/shaped.py it
drives: the best plan of a cell, the tables' ratios, the pinned commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import load_bench


def _row(mode: str, epoch: float, split: int | str | None = None,
         parallel: int | str | None = None, server_idle: float = 0.0) -> dict[str, Any]:
    row: dict[str, Any] = {"model": "vgg5", "network": "4g", "mode": mode, "epoch_s": epoch,
                           "idle_s": {"server": server_idle, "device": 0.0},
                           "plans": [[split, parallel]] if parallel else []}
    if split is not None:
        row["split_point"] = split
    if parallel is not None:
        row["parallel_batches"] = parallel
    return row


ROWS = [_row("fl", 20.0, server_idle=20.0), _row("sfl", 12.0, 1), _row("sfl", 9.0, 2),
        _row("pipar", 6.0, "auto", "auto"), _row("pipar", 5.0, 2, 4),
        _row("pipar", 7.0, 1, 2), {**_row("pipar", 1.0, 3, 8), "error": "MemoryError"}]


def test_the_best_of_a_cell_is_the_quickest_run_that_finished() -> None:
    testbed = load_bench("testbed")
    assert testbed.best(ROWS, "vgg5", "4g", "sfl")["split_point"] == 2
    fixed = testbed.best(ROWS, "vgg5", "4g", "pipar")
    assert (fixed["split_point"], fixed["parallel_batches"]) == (2, 4)  # not the failed one
    assert testbed.best(ROWS, "vgg5", "4g", "pipar", fixed=False)["epoch_s"] == 6.0
    assert testbed.best(ROWS, "vgg5", "wifi", "sfl") is None


def test_the_virtual_table_divides_by_the_planner_s_choice() -> None:
    testbed = load_bench("testbed")
    lines, cells = testbed.virtual_table(ROWS, ["vgg5"], ["4g"])
    row = lines[-1]
    assert "| 3.33× | 1.50× |" in row  # FL 20 / auto 6, SFL best 9 / auto 6
    assert "| 1.20 |" in row  # auto 6 / best fixed 5
    assert cells["vgg5", "4g"]["sfl"]["split_point"] == 2


def test_the_slowdown_is_the_paper_s_least_resnet18_speedup_times_the_fleet() -> None:
    testbed = load_bench("testbed")
    assert testbed.default_slowdown(8) == pytest.approx(124.0)
    assert testbed.parse(["report", "--out", "x", "--devices", "10"]).slowdown == 155.0


def test_every_virtual_run_of_the_sweep_is_listed_once() -> None:
    testbed = load_bench("testbed")
    args = argparse.Namespace(models=["vgg5"], networks=["4g", "wifi"], parallel_batches=[1, 2])
    specs = list(testbed.specs(args))
    # per network: FL, auto, and for each of the 4 split points SFL and 2 fixed plans
    assert len(specs) == 2 * (2 + 4 * 3)
    assert len({json.dumps(s, sort_keys=True) for s in specs}) == len(specs)


def test_shaped_pins_the_server_and_devices_apart_and_takes_several_fixed_plans() -> None:
    shaped = load_bench("shaped")
    server = shaped.pinned(["python", "-m", "aiopipe.server"])
    device = shaped.pinned(["python", "-m", "aiopipe.device"], server=False)
    assert server[:3] == ["taskset", "-c", "0"]
    assert device[:2] == ["taskset", "-c"]
    assert device[2].startswith("1")
    assert shaped._pairs("2,4;3,1") == [(2, 4), (3, 1)]
    assert shaped._pairs("none") == []
    with pytest.raises(argparse.ArgumentTypeError):
        shaped._pairs("2;4")


def test_the_report_shows_the_best_of_several_fixed_plans(tmp_path: Path) -> None:
    report = load_bench("report")

    def run(t: float) -> dict[str, Any]:
        return {"epochs": [{"time_s": t}, {"time_s": t}]}

    config = {"runs": {"fl": run(9.0), "pipar P=2 N=4": run(5.0), "pipar P=3 N=2": run(4.0)}}
    assert report.mode_runs(config)["fixed"][0] == "pipar P=3 N=2"
    assert report.fixed_plans([2, 4]) == "P=2 N=4"  # a raw.json of before
    assert report.fixed_plans([[2, 4], [3, 2]]) == "P=2 N=4; P=3 N=2"
    assert report.fixed_plans([]) == "none"
