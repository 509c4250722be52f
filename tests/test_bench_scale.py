"""bench/scale.py: one tiny run end to end, the memory estimate, the extrapolation.

The benchmark's figures are never asserted (speed and memory depend on the machine); these
tests check that it runs, that its rows describe the run it made, and that its arithmetic
is right.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "scale.py"


def _load() -> ModuleType:
    return load_bench("scale")


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "samples_per_device": 40,
        "batch_size": 20,
        "parallel_batches": 2,
        "split_point": 2,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.slow
def test_two_devices_run_in_a_child_and_report_what_they_trained() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    process = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--devices",
            "2",
            "--test-samples",
            "10",
            "--keep-free-gib",
            "0",
            "--floor-samples",  # its figure is not asserted: a short loop
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    rows = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("    {")]
    assert len(rows) == 1
    row = rows[0]
    assert row["devices"] == 2
    assert row["samples"] == 2 * 40
    assert row["virtual_s"] > 0
    assert row["slices"] > 2 * 2 * 2  # f, u, s, d, b per micro-batch, 2 iterations, 2 devices
    assert row["peak_mib"] >= row["base_mib"] > 0
    table = [line for line in process.stdout.splitlines() if line.split()[:1] == ["2"]]
    assert len(table) == 1, process.stdout


def test_memory_estimate_counts_replica_optimizer_and_the_kept_inputs() -> None:
    scale = _load()
    one = scale.per_device_bytes(_args(parallel_batches=1))
    two = scale.per_device_bytes(_args(parallel_batches=2))
    # vgg5 split at 2: the server half holds units 3-5 (conv 64-64, FC 4096-128, FC 128-10)
    server_params = 4 * (64 * 64 * 9 + 64 + 4096 * 128 + 128 + 128 * 10 + 10)
    assert two["server replica"] == 3 * server_params
    # a recomputing stage keeps the inputs: N = 2 micro-batches of 10 images of 3x32x32
    assert two["device inputs"] == one["device inputs"] == 2 * 10 * 3 * 32 * 32 * 4
    # the graphs it would keep otherwise: one of B' = 20, or two of 10, the same bytes
    assert scale.saved_graph_bytes(_args(parallel_batches=1)) == scale.saved_graph_bytes(
        _args(parallel_batches=2)) > 10 * two["device inputs"]
    four = scale.per_device_bytes(_args(batch_size=40, parallel_batches=4))
    assert four["device inputs"] == 2 * two["device inputs"]
    assert scale.estimate_mib(100.0, 10, {"a": 1 << 20}) == 110.0


def test_rows_that_did_not_run_are_extrapolated_from_the_largest_that_did() -> None:
    scale = _load()
    rows = [
        {"devices": 10, "wall_s": 1.0, "base_mib": 240.0, "peak_mib": 340.0},
        {"devices": 100, "wall_s": 4.0, "base_mib": 240.0, "peak_mib": 1240.0},
        {"devices": 1000, "error": "skipped: no memory"},
    ]
    lines = scale.extrapolate(rows, {"a": 10 << 20})
    # marginal between K = 10 and 100: 1/30 s and 10 MiB per device
    assert lines[0] == (
        "extrapolated linearly from K = 100 (0.033 s and 10.00 MiB per further device):"
    )
    assert lines[1] == "  K = 1000: wall ~34 s, peak RSS ~10.0 GiB (estimate 10.0 GiB)"
    one_run = scale.extrapolate([rows[1], rows[2]], {"a": 10 << 20})
    assert one_run[1] == "  K = 1000: wall ~40 s, peak RSS ~10.0 GiB (estimate 10.0 GiB)"
    assert scale.extrapolate(rows[:2], {"a": 1}) == []


@pytest.mark.slow
def test_the_population_mode_notes_memory_after_each_mark() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    process = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "fl", "--devices", "6",
         "--devices-per-round", "2", "--marks", "1,3", "--parallel-batches", "1",
         "--local-optimizer", "kept", "--test-samples", "10", "--keep-free-gib", "0",
         "--floor-samples", "100"],
        capture_output=True, text=True, timeout=240, check=False, env=env)
    assert process.returncode == 0, process.stdout + process.stderr
    (row,) = [json.loads(line) for line in process.stdout.splitlines()
              if line.startswith("    {")]
    assert row["samples"] == 3 * 2 * 40  # three rounds (the largest mark) of two devices
    assert [mark["round"] for mark in row["marks"]] == [1, 3]
    assert all(m["hwm_mib"] >= m["rss_mib"] > 0 for m in row["marks"])
    assert "local_optimizer kept" in process.stdout
    lines = [line for line in process.stdout.splitlines() if line.startswith("K = 6, after")]
    assert [line.split(":")[0] for line in lines] == ["K = 6, after round 1",
                                                     "K = 6, after round 3"]


def test_marks_are_one_line_per_run_and_round() -> None:
    rows = [{"devices": 10, "version": "abc", "marks": [
        {"round": 10, "hwm_mib": 2048.4, "rss_mib": 1900.0, "pss_mib": 1800.2, "wall_s": 12.34}]},
        {"devices": 20, "error": "skipped"}]
    assert _load().marks(rows) == ["K = 10 (abc), after round 10: peak RSS 2048 MiB, RSS 1900 "
                                   "MiB, PSS 1800 MiB, wall 12.3 s"]
