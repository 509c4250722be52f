"""Fault tolerance from the one-command launcher: ``python -m aiopipe`` with one of its
device processes SIGKILLed (or SIGSTOPped) mid-run. In a mode that recovers from a lost
device, the launcher says so in one line and lets the server's liveness give the device
up; the run ends when training does, with exit status 0, and every epoch trains exactly
its batches. The synchronous pipeline recovers too: the round is played again from its
start on the devices left. (Asteroid losing a member of a data-parallel stage group,
rather than a stage's only device: in one process, tests/runtime/test_runtime_asteroid.py.)
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import signal
from pathlib import Path

import pytest
from real_processes import Process, ProcessFleet, check_pipeline_figures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: The liveness of the runs below: a dead device is given up about 1 s after its
#: connection broke (reconnect_grace); a silent one after device_timeout.
LIVENESS = {"heartbeat_interval": 0.5, "device_timeout": 3.0, "reconnect_grace": 1.0,
            "test_samples": 100, "model": "vgg5"}

FTPIPEHD = {"mode": "ftpipehd", "devices": 3, "samples_per_device": 400, "batch_size": 20,
            "epochs": 12, "momentum": 0.5, "learning_rate": 0.02,
            "global_replication_every": 10, "chain_replication_every": 5, **LIVENESS}


def device_pid(launcher: Process, k: int) -> int:
    """The pid of the launcher's device process k, as its latest start says (the
    launcher forks its devices: [Note: fork server])."""
    started = launcher.output.find(rf"device {k} started: pid \d+")
    assert started, f"no device process {k} in:\n{launcher.output.text()}"
    return int(started[-1].text.rsplit(" ", 1)[1])


async def start_launcher(fleet: ProcessFleet, *options: str) -> Process:
    """``python -m aiopipe`` for the fleet's config file and ``options``."""
    return await fleet.start("launcher", [
        "aiopipe", "--config", str(fleet.config_file), "--out-dir", str(fleet.out_dir),
        *options])


async def kill_in_epoch_2(launcher: Process, k: int) -> None:
    """SIGKILL the launcher's device process k once epoch 1's row is printed."""
    await launcher.output.wait_for(r"^\s+1\s", within=60)  # epoch 1's row
    await asyncio.sleep(0.3)
    os.kill(device_pid(launcher, k), signal.SIGKILL)


def went_on_without(launcher: Process, k: int) -> None:
    """The launcher said, in one line, that the run goes on without device process k."""
    text = launcher.output.text()
    assert (f"device process {k} exited with code {-signal.SIGKILL}; the run goes on "
            "without it") in text, text


async def test_ftpipehd_s_device_process_started_again_rejoins_then_goes_for_good(
        tmp_path: Path) -> None:
    """``--device-restarts 1``, device 2 (the last stage) SIGKILLed twice. The first
    time, in epoch 2, the launcher starts it again at once; the new process takes its
    stage again (in the replay, or from a later round). The second time, once it is
    back, no restart is left: the launcher says the run goes on without it, and the
    round is played again on devices 0 and 1 to the end. Exact: FTPipeHD's epoch is
    device 0's batches, each applied once (a replayed round's batches count once), so
    every epoch reports all 400 of its samples."""
    # (epochs enough for the new process to import torch and say hello, then a fault)
    async with ProcessFleet(tmp_path, FTPIPEHD) as fleet:
        launcher = await start_launcher(fleet, "--device-restarts", "1")
        out = launcher.output
        await kill_in_epoch_2(launcher, 2)
        again = await out.wait_for(r"device process 2 exited with code -9; starting it "
                                   r"again \(0 more restarts allowed\)", within=30)
        back = await out.wait_for(r"device 2 takes part again from round", since=again.at,
                                  within=90)
        await out.wait_for(r"^\s+\d+\s", since=back.at, within=60)  # an epoch with it
        os.kill(device_pid(launcher, 2), signal.SIGKILL)
        assert await launcher.wait(90) == 0, fleet.all_output()
    went_on_without(launcher, 2)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [400] * FTPIPEHD["epochs"]
    # the new process (forked warm: [Note: fork server]) may be back within
    # reconnect_grace, before the coordinator gives the old one up
    assert epochs[1]["devices_lost"] in ([], [2])
    changes = [c for e in epochs for c in e["changes"] if c.get("lost")]
    assert changes[-1]["workers"] == [0, 1], changes  # the second fault: for good
    assert [p["device"] for p in epochs[-1]["plan"]] == [0, 1]  # training went on without it
    back_in = [e for e in epochs if [p["device"] for p in e["plan"]] == [0, 1, 2]]
    assert len(back_in) >= 2, epochs  # epoch 1, and one at least after the restart
    assert all(math.isfinite(float(e["loss"])) for e in epochs)  # type: ignore[arg-type]


async def test_asteroid_s_hybrid_pipeline_from_the_command_line_goes_on_without_a_stage(
        tmp_path: Path) -> None:
    """``python -m aiopipe --mode asteroid --stage-groups 0,1/2 ...``: devices 0 and 1
    split every micro-batch of the first stage between them (rows by their slowdowns)
    and all-reduce its gradients over their own link; device 2 runs the second stage on
    the rows both send it. Each device profiled itself first, and the rows come from
    its own table. Then device 2, stage 1's only device, SIGKILLed in epoch 2: the plan
    is adjusted and the round played again on devices 0 and 1. Exact: an Asteroid epoch
    is the first stage's members' samples, each once through the whole pipeline; in the
    epoch with the fault as in the others (a replayed round's counts once)."""
    run = {"mode": "asteroid", "chain_replication_every": 2, **LIVENESS}
    async with ProcessFleet(tmp_path, run) as fleet:
        launcher = await start_launcher(
            fleet, "--devices", "3", "--stage-groups", "0,1/2", "--partition", "2",
            "--device-slowdown", "1,2,1", "--epochs", "3", "--samples-per-device", "480",
            "--batch-size", "32", "--parallel-batches", "2")
        await kill_in_epoch_2(launcher, 2)
        assert await launcher.wait(90) == 0, fleet.all_output()
    text = launcher.output.text()
    for d in range(3):
        assert f"device {d} profiled itself" in text
    went_on_without(launcher, 2)
    epochs = fleet.metrics()
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    first = epochs[0]
    plan = {p["device"]: p for p in first["plan"]}
    assert [plan[d]["stage"] for d in range(3)] == [0, 0, 1]
    rows = {d: plan[d]["rows"] for d in range(3)}
    assert (rows[0][0], rows[0][1], rows[1][1], rows[2]) == (0, rows[1][0], 16, [0, 16])
    assert rows[1][1] - rows[1][0] < rows[0][1] - rows[0][0]  # the slower computes fewer
    assert {"device0->device2", "device1->device2", "device2->device0",
            "device2->device1", "device0->device1", "device1->device0"} <= set(first["links"])
    assert all(s["busy_s"] > 0 for s in first["stages"])
    iterations = 480 // ((rows[0][1] - rows[0][0]) * 2)
    assert [e["samples"] for e in epochs] == [iterations * 32] * 3
    # the first stage's members' rows, each epoch's (after the fault: devices 0 and 1 as
    # one data-parallel stage when the adjustment kept the groups, or as two stages when
    # the planner was asked, as on a loaded machine; device 1 then runs the last stage)
    for e in epochs:
        members = [p["device"] for p in e["plan"] if p["stage"] == 0]
        assert sum(e["device_samples"][d] for d in members) == iterations * 32, e["plan"]
    # the new process (forked warm: [Note: fork server]) may be back within
    # reconnect_grace, before the coordinator gives the old one up
    assert epochs[1]["devices_lost"] in ([], [2])
    [recovery] = [c for e in epochs for c in e["changes"] if c.get("kind") == "recovery"]
    assert recovery["lost"] == [2]
    assert sorted(p["device"] for p in epochs[2]["plan"]) == [0, 1]
    assert all(math.isfinite(float(e["loss"])) for e in epochs)  # type: ignore[arg-type]


async def test_the_embedded_default_pipeline_gives_a_sigstopped_stage_up_and_completes(
        tmp_path: Path) -> None:
    """``python -m aiopipe --mode pipeline --devices 3``: three device processes, "auto"
    cuts of vgg5's 5 units into three stages, every stage and link busy. Then device 1
    (the middle stage) stopped in epoch 2: silent, its links up. The server gives it up
    after device_timeout of silence and reconnect_grace; the round is played again from
    its start on devices 0 and 2, linked to each other now. Continued once given up,
    device 1 finds its session gone, comes back afresh and takes its stage again from a
    later round. Exact: a pipeline's epoch is device 0's 300 samples, each once (the
    round given up on does not count)."""
    async with ProcessFleet(tmp_path, {"mode": "pipeline", **LIVENESS}) as fleet:
        launcher = await start_launcher(
            fleet, "--mode", "pipeline", "--devices", "3", "--model", "vgg5", "--epochs",
            "3", "--samples-per-device", "300", "--batch-size", "30", "--parallel-batches",
            "3")
        await launcher.output.wait_for(r"^\s+1\s", within=60)  # epoch 1's row
        await asyncio.sleep(0.3)
        pid = device_pid(launcher, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            await launcher.output.wait_for(r"the pipeline runs on devices \[0, 2\]",
                                           within=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert await launcher.wait(90) == 0, fleet.all_output()
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [300] * 3
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    units = [p["units"] for p in epochs[0]["plan"]]  # "auto": three stages of 5 units
    assert units[0][0] == 0
    assert units[-1][1] == 5
    assert all(a[1] == b[0] < b[1] for a, b in itertools.pairwise(units))
    # (epoch 2 as a rule; epoch 3 when the stop fell after epoch 2's last round began)
    [struck] = [e for e in epochs if any(c.get("lost") for c in e["changes"])]
    assert struck["devices_lost"] == [1], epochs
    recovery = next(c for c in struck["changes"] if c.get("lost"))
    assert recovery["workers"] == [0, 2]
    assert recovery["iterations"] == [0, 10]  # the round (an epoch) from its start
    whole = [e for e in epochs if e is not struck]
    if struck is not epochs[-1]:
        assert [p["device"] for p in epochs[-1]["plan"]] == [0, 1, 2]  # back, re-planned
    else:
        whole = whole[:1]
    check_pipeline_figures(fleet.out_dir, whole, 3)  # epochs on all three
    assert all(math.isfinite(float(e["loss"])) for e in epochs)  # type: ignore[arg-type]
