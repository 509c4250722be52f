"""A pipeline between real processes over device-to-device websockets, with ``python -m
aiopipe.server`` and ``python -m aiopipe.device --listen`` processes started by hand:
Asteroid's hybrid pipeline goes on when a member of a data-parallel stage group is
SIGKILLed.

Elsewhere, the same fleets do more at once: the embedded default (``python -m aiopipe
--mode pipeline``) and Asteroid's hybrid pipeline from the command line, each with a
fault, in tests/test_launcher_faults_processes.py; FTPipeHD's pipeline of four processes
in tests/test_ftpipehd_processes.py; two devices started by hand that link to each
other (GPipe) in tests/test_peer_port_processes.py."""

from __future__ import annotations

import asyncio
import math
import signal
from pathlib import Path

import pytest
from real_processes import ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_asteroid_goes_on_when_a_device_is_sigkilled(tmp_path: Path) -> None:
    """Device 1 (of stage 0's group) SIGKILLed in epoch 2: its neighbours' links fail,
    the devices left wait, the server gives it up after ``reconnect_grace``, adjusts the
    plan and plays the round again from the latest stage backup point; the run ends,
    every epoch with its batches. (Device 2, stage 1's only device, killed through the
    launcher: tests/test_launcher_faults_processes.py.)"""
    killed = 1
    run = {"mode": "asteroid", "devices": 3, "model": "vgg5", "stage_groups": [[0, 1], [2]],
           "partition": [2], "samples_per_device": 320, "batch_size": 32,
           "parallel_batches": 2, "epochs": 3, "test_samples": 100, "profile_devices": False,
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
        assert [entry[:2] for entry in recovery["after"]] == [[0, 0], [2, 1]]
    else:
        assert recovery["rescheduling"] == "lightweight+planner"
    assert all(math.isfinite(e["loss"]) for e in epochs)
    assert sorted(p["device"] for p in epochs[-1]["plan"]) == [0, 2]
