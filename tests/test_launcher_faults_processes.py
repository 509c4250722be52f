"""Fault tolerance from the one-command launcher: ``python -m aiopipe`` with one of its
device processes SIGKILLed (or SIGSTOPped) mid-run. In a mode that recovers from a lost
device, the launcher says so in one line and lets the server's liveness give the device
up; the run ends when training does, with exit status 0, and every epoch trains exactly
its batches. The synchronous pipeline recovers too: the round is played again from its
start on the devices left.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from real_processes import Process, ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: The liveness of the runs below: a dead device is given up about 1 s after its
#: connection broke (reconnect_grace); a silent one after device_timeout.
LIVENESS = {"heartbeat_interval": 0.5, "device_timeout": 3.0, "reconnect_grace": 1.0,
            "test_samples": 100, "model": "vgg5"}

FTPIPEHD = {"mode": "ftpipehd", "devices": 3, "samples_per_device": 400, "batch_size": 20,
            "epochs": 3, "momentum": 0.5, "learning_rate": 0.02,
            "global_replication_every": 10, "chain_replication_every": 5, **LIVENESS}

PIPELINE = {"mode": "pipeline", "devices": 3, "samples_per_device": 200, "batch_size": 20,
            "parallel_batches": 2, "epochs": 3, **LIVENESS}

ASTEROID = {"mode": "asteroid", "devices": 3, "stage_groups": [[0, 1], [2]],
            "partition": [2], "samples_per_device": 320, "batch_size": 32,
            "parallel_batches": 2, "epochs": 3, "chain_replication_every": 2,
            "profile_devices": False, **LIVENESS}


def device_pid(launcher: Process, k: int) -> int:
    """The pid of the launcher's device process k (from /proc: its child whose command
    line says ``--device-id k``)."""
    pid = launcher.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"aiopipe.device" in argv and argv[argv.index(b"--device-id") + 1] == str(k).encode():
            return int(child)
    raise AssertionError(f"no device process {k} among {children}")


async def run_killing(tmp_path: Path, run: dict[str, Any], killed: int, *options: str
                      ) -> tuple[ProcessFleet, Process]:
    """``python -m aiopipe`` for ``run`` (with ``options``), its device process ``killed``
    SIGKILLed once epoch 1's row is printed (epoch 2 runs); the fleet and the launcher,
    exited with status 0."""
    async with ProcessFleet(tmp_path, run) as fleet:
        launcher = await fleet.start("launcher", [
            "aiopipe", "--config", str(fleet.config_file), "--out-dir", str(fleet.out_dir),
            *options])
        await launcher.output.wait_for(r"^\s+1\s", within=60)  # epoch 1's row
        await asyncio.sleep(0.3)
        os.kill(device_pid(launcher, killed), signal.SIGKILL)
        code = await launcher.wait(90)
        assert code == 0, fleet.all_output()
    return fleet, launcher


def went_on_without(launcher: Process, k: int) -> None:
    """The launcher said, in one line, that the run goes on without device process k."""
    text = launcher.output.text()
    assert (f"device process {k} exited with code {-signal.SIGKILL}; the run goes on "
            "without it") in text, text


async def test_ftpipehd_goes_on_when_the_launcher_s_device_is_sigkilled(tmp_path: Path
                                                                       ) -> None:
    """Device 2 (the last stage) killed in epoch 2: the round is played again on devices
    0 and 1. Exact: FTPipeHD's epoch is device 0's batches, each applied once (a replayed
    round's batches count once), so every epoch reports all 400 of its samples."""
    fleet, launcher = await run_killing(tmp_path, FTPIPEHD, killed=2)
    went_on_without(launcher, 2)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [400] * 3
    assert epochs[1]["devices_lost"] == [2]
    [recovery] = [c for e in epochs for c in e["changes"] if c.get("lost")]
    assert recovery["workers"] == [0, 1]
    assert [p["device"] for p in epochs[2]["plan"]] == [0, 1]  # training resumed without it
    assert all(math.isfinite(float(e["loss"])) for e in epochs)  # type: ignore[arg-type]


async def test_asteroid_goes_on_when_the_launcher_s_device_is_sigkilled(tmp_path: Path
                                                                       ) -> None:
    """Device 2 (stage 1's only device) killed in epoch 2: the plan is adjusted and the
    round played again on devices 0 and 1. Exact: an Asteroid epoch is the first stage's
    members' samples, each once through the whole pipeline: 16 rows of each 32-sample
    batch from device 0's 320 and 16 from device 1's, 20 iterations, 640 samples; in the
    epoch with the fault as in the others (a replayed round's counts once)."""
    fleet, launcher = await run_killing(tmp_path, ASTEROID, killed=2)
    went_on_without(launcher, 2)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [640] * 3
    assert [e["device_samples"][:2] for e in epochs] == [[320, 320]] * 3
    assert epochs[1]["devices_lost"] == [2]
    [recovery] = [c for e in epochs for c in e["changes"] if c.get("kind") == "recovery"]
    assert recovery["lost"] == [2]
    assert sorted(p["device"] for p in epochs[2]["plan"]) == [0, 1]
    assert all(math.isfinite(float(e["loss"])) for e in epochs)  # type: ignore[arg-type]


async def test_a_pipeline_stage_sigstopped_is_given_up_and_the_run_completes(tmp_path: Path
                                                                           ) -> None:
    """Device 1 (the middle stage) stopped in epoch 2: silent, its links up. The server
    gives it up after device_timeout of silence and reconnect_grace; the round is played
    again from its start on devices 0 and 2, linked to each other now. Continued once
    given up, device 1 finds its session gone, comes back afresh and takes its stage
    again from a later round. Exact: a pipeline's epoch is device 0's 200 samples, each
    once (the round given up on does not count)."""
    async with ProcessFleet(tmp_path, PIPELINE) as fleet:
        launcher = await fleet.start("launcher", [
            "aiopipe", "--config", str(fleet.config_file), "--out-dir", str(fleet.out_dir)])
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
    assert [e["samples"] for e in epochs] == [200] * 3
    # (epoch 2 as a rule; epoch 3 when the stop fell after epoch 2's last round began)
    [struck] = [e for e in epochs if any(c.get("lost") for c in e["changes"])]
    assert struck["devices_lost"] == [1], epochs
    recovery = next(c for c in struck["changes"] if c.get("lost"))
    assert recovery["workers"] == [0, 2]
    assert recovery["iterations"] == [0, 10]  # the round (an epoch) from its start
    if struck is not epochs[-1]:
        assert [p["device"] for p in epochs[-1]["plan"]] == [0, 1, 2]  # back, re-planned
    assert all(math.isfinite(float(e["loss"])) for e in epochs)  # type: ignore[arg-type]


async def test_a_device_process_started_again_rejoins(tmp_path: Path) -> None:
    """``--device-restarts 1``: the launcher starts the killed device process again at
    once; the new process takes its stage again (in the replay, or from a later round),
    and every epoch still trains each of device 0's batches once."""
    # (more epochs: the new process needs a few seconds to import torch and say hello)
    run = {**FTPIPEHD, "epochs": 8}
    fleet, launcher = await run_killing(tmp_path, run, 2, "--device-restarts", "1")
    text = launcher.output.text()
    assert (f"device process 2 exited with code {-signal.SIGKILL}; starting it again (0 "
            "more restarts allowed)") in text
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [400] * 8
    assert [p["device"] for p in epochs[-1]["plan"]] == [0, 1, 2], text
