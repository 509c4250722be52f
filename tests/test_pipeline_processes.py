"""A synchronous pipeline between real processes over device-to-device websockets:
``python -m aiopipe --mode pipeline`` (the embedded default) and ``python -m
aiopipe.server`` with ``python -m aiopipe.device --listen`` processes started by hand."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from real_processes import REPO, ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _check_run(out_dir: Path, stages: int) -> list[dict[str, Any]]:
    """The results directory of a pipeline run: loss falls, figures per stage and per
    directed link, one trace track per stage and per directed link."""
    epochs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    links = {f"device{p}->device{q}" for p in range(stages) for q in (p - 1, p + 1)
             if 0 <= q < stages}
    for epoch in epochs:
        assert [s["stage"] for s in epoch["stages"]] == list(range(stages))
        for stage in epoch["stages"]:
            assert stage["busy_s"] > 0
            assert stage["busy_s"] + stage["idle_s"] == pytest.approx(epoch["time_s"])
        assert set(epoch["links"]) == links
        assert all(v["busy_s"] > 0 for v in epoch["links"].values())
    trace = json.loads((out_dir / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {f"device{p}/compute" for p in range(stages)} | links <= tracks
    return epochs


def test_the_embedded_default_trains_a_pipeline_of_three_processes(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--mode", "pipeline", "--devices", "3",
         "--model", "vgg5", "--epochs", "3", "--samples-per-device", "600",
         "--batch-size", "30", "--parallel-batches", "3", "--out-dir", str(out_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    epochs = _check_run(out_dir, 3)
    assert [e["samples"] for e in epochs] == [600] * 3
    units = [p["units"] for p in epochs[0]["plan"]]  # "auto": three stages of vgg5's 5 units
    assert units[0][0] == 0
    assert units[-1][1] == 5
    assert all(a[1] == b[0] < b[1] for a, b in itertools.pairwise(units))


async def test_devices_started_by_hand_link_to_each_other(tmp_path: Path) -> None:
    run = {"mode": "pipeline", "devices": 2, "model": "vgg5", "samples_per_device": 200,
           "batch_size": 20, "parallel_batches": 2, "partition": [3], "schedule": "gpipe",
           "epochs": 2, "test_samples": 100}
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(2)]
        await fleet.finish(server, devices, within=180)
    epochs = _check_run(fleet.out_dir, 2)
    assert [s["peak_live"] for s in epochs[0]["stages"]] == [2, 2]  # GPipe holds all N


def test_ftpipehd_trains_an_asynchronous_pipeline_of_four_processes(tmp_path: Path) -> None:
    """``python -m aiopipe --mode ftpipehd --devices 4``: four device processes stream the
    epoch's batches over their own links; the loss falls."""
    out_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--mode", "ftpipehd", "--devices", "4",
         "--model", "vgg5", "--epochs", "2", "--samples-per-device", "400",
         "--batch-size", "20", "--momentum", "0.5", "--out-dir", str(out_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    epochs = _check_run(out_dir, 4)
    assert [e["samples"] for e in epochs] == [400] * 2
    assert [p["in_flight"] for p in epochs[0]["plan"]] == [4, 3, 2, 1]
    assert epochs[1]["loss"] < epochs[0]["loss"]


def test_asteroid_trains_a_hybrid_pipeline_of_three_processes(tmp_path: Path) -> None:
    """``python -m aiopipe --mode asteroid``: devices 0 and 1 split every micro-batch of
    the first stage between them (rows by their slowdowns) and all-reduce its gradients
    over their own link; device 2 runs the second stage on the rows both send it. Each
    device profiled itself first, and the rows come from its own table."""
    out_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe", "--mode", "asteroid", "--devices", "3",
         "--stage-groups", "0,1/2", "--partition", "2", "--device-slowdown", "1,2,1",
         "--model", "vgg5", "--epochs", "2", "--samples-per-device", "480",
         "--batch-size", "32", "--parallel-batches", "2", "--out-dir", str(out_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for d in range(3):
        assert f"device {d} profiled itself" in done.stdout + done.stderr
    epochs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    plan = {p["device"]: p for p in epochs[0]["plan"]}
    assert [plan[d]["stage"] for d in range(3)] == [0, 0, 1]
    rows = {d: plan[d]["rows"] for d in range(3)}
    assert (rows[0][0], rows[0][1], rows[1][1], rows[2]) == (0, rows[1][0], 16, [0, 16])
    assert rows[1][1] - rows[1][0] < rows[0][1] - rows[0][0]  # the slower computes fewer
    iterations = 480 // ((rows[0][1] - rows[0][0]) * 2)
    assert [e["samples"] for e in epochs] == [iterations * 32] * 2
    for epoch in epochs:
        assert {"device0->device2", "device1->device2", "device2->device0",
                "device2->device1", "device0->device1", "device1->device0"} <= set(
            epoch["links"])
        assert all(s["busy_s"] > 0 for s in epoch["stages"])


@pytest.mark.parametrize("killed", [1])
async def test_asteroid_goes_on_when_a_device_is_sigkilled(tmp_path: Path, killed: int) -> None:
    """Device 1 (of stage 0's group) SIGKILLed in epoch 2: its neighbours' links fail,
    the devices left wait, the server gives it up after ``reconnect_grace``, adjusts the
    plan and plays the round again from the latest stage backup point; the run ends,
    every epoch with its batches. (Device 2, stage 1's only device, killed through the
    launcher: tests/test_launcher_faults_processes.py.)"""
    run = {"mode": "asteroid", "devices": 3, "model": "vgg5", "stage_groups": [[0, 1], [2]],
           "partition": [2], "samples_per_device": 320, "batch_size": 32,
           "parallel_batches": 2, "epochs": 3, "test_samples": 100,
           "heartbeat_interval": 0.5, "device_timeout": 5.0, "reconnect_grace": 1.0,
           "chain_replication_every": 2}
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(3)]
        await server.output.wait_for(r"^\s+1\s", within=120)  # epoch 1's row: epoch 2 runs
        await asyncio.sleep(0.3)
        devices[killed].send_signal(signal.SIGKILL)
        assert await devices[killed].wait(30) == -signal.SIGKILL
        await fleet.finish(server, [d for k, d in enumerate(devices) if k != killed],
                           within=180)
    epochs = fleet.metrics()
    assert len({e["samples"] for e in epochs}) == 1  # an epoch keeps its batches
    [recovery] = [c for e in epochs for c in e["changes"] if c.get("kind") == "recovery"]
    assert recovery["lost"] == [killed]
    assert recovery["from_iteration"] > 0
    assert recovery["from_iteration"] % 2 == 0
    if recovery["rescheduling"] == "lightweight":  # (else the adjustment was much worse)
        after = [[0, 0], [2, 1]] if killed == 1 else [[0, 0], [1, 0]]
        assert [entry[:2] for entry in recovery["after"]] == after
    else:
        assert recovery["rescheduling"] == "lightweight+planner"
    assert all(math.isfinite(e["loss"]) for e in epochs)
    assert sorted(p["device"] for p in epochs[-1]["plan"]) == sorted({0, 1, 2} - {killed})
