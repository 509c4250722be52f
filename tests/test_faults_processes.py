"""Faults between real processes over real websockets (DESIGN §7): a device process is
SIGKILLed mid-epoch; the run completes without it (its round is dropped once it has not
come back within reconnect_grace), and once restarted it rejoins. The server process is
SIGKILLed and resumed from its checkpoint. (A stalled link: test_stall_processes.py.)"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path

import pytest
from real_processes import ProcessFleet

TOKEN = "fault-test-token"
ENV = {"AIOPIPE_TOKEN": TOKEN}


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_killed_device_process_is_excluded_then_rejoins(tmp_path: Path) -> None:
    """Three devices; device 2 SIGKILLed early in epoch 2 and, once the server gave it up,
    started again (a new process, warm: `ProcessFleet.start_spare`) with the same id."""
    epochs_run, grace, timeout = 5, 2.0, 8.0
    async with ProcessFleet(tmp_path, {"reconnect_grace": grace}) as fleet:
        server = await fleet.start_server(
            "--devices", "3", "--samples-per-device", "200", "--batch-size", "20",
            "--parallel-batches", "2", "--epochs", str(epochs_run), "--join-timeout", "120",
            "--device-timeout", str(timeout), "--heartbeat-interval", "0.5", env=ENV)
        devices = [await fleet.start_device(k, env=ENV) for k in range(3)]
        spare = await fleet.start_spare(2, env=ENV)
        await server.output.wait_for(r"^\s+1\s", within=120)  # epoch 1's row: epoch 2 runs
        killed = time.monotonic()
        devices[2].send_signal(signal.SIGKILL)
        assert await devices[2].wait(30) == -signal.SIGKILL
        lost = await server.output.wait_for(r"device 2 was lost", within=60)  # given up
        # a dead process's socket closes at once: what it costs is reconnect_grace, not
        # device_timeout
        assert grace <= lost.at - killed < timeout, fleet.all_output()
        restarted = await fleet.go(spare)  # the same id
        await fleet.finish(server, [devices[0], devices[1], restarted], within=240)
    epochs = fleet.metrics()
    assert len(epochs) == epochs_run
    per_device = 200 // 20 * 20
    assert epochs[0]["device_samples"] == [per_device] * 3
    assert epochs[0]["devices_lost"] == []
    assert epochs[1]["devices_lost"] == [2]  # killed mid-epoch: its round was excluded
    assert epochs[1]["device_samples"][:2] == [per_device] * 2
    assert epochs[1]["device_samples"][2] < per_device
    # restarted, it rejoined at a round boundary and contributed again; once back for a
    # whole epoch it has its full share
    assert any(e["device_samples"][2] > 0 for e in epochs[2:]), epochs
    assert epochs[-1]["device_samples"] == [per_device] * 3, epochs
    assert all(math.isfinite(e["loss"]) for e in epochs)
    import torch
    from safetensors.torch import load_file

    for value in load_file(str(fleet.out_dir / "model.safetensors")).values():
        assert torch.isfinite(value).all()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_killed_server_resumes_and_the_devices_carry_on(tmp_path: Path) -> None:
    """SIGKILL the server process mid-epoch and start it again with --resume (a new
    process on the same port, warm: `ProcessFleet.start_warm`): the device processes
    reconnect by themselves, and every epoch processes exactly its samples."""
    # (two rounds of 5 iterations an epoch)
    options = ["--devices", "2", "--samples-per-device", "200", "--batch-size", "20",
               "--parallel-batches", "2", "--epochs", "3", "--aggregation-every", "5",
               "--device-timeout", "10", "--heartbeat-interval", "0.5"]
    async with ProcessFleet(tmp_path, {}) as fleet:
        first = await fleet.start_server(*options, env=ENV)
        again = await fleet.start_warm("server (again)", [
            "aiopipe.server", "--port", str(fleet.port()), "--resume", str(fleet.out_dir)],
            env=ENV)
        devices = [await fleet.start_device(k, env=ENV) for k in range(2)]
        await first.output.wait_for(r"^\s+1\s", within=120)  # epoch 1 is done
        await asyncio.sleep(0.2)  # early in epoch 2
        first.send_signal(signal.SIGKILL)
        assert await first.wait(30) == -signal.SIGKILL
        second = await fleet.go(again)
        await fleet.finish(second, devices, within=240)
    assert "resuming at epoch 2" in second.output.text()
    epochs = fleet.metrics()
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert [e["device_samples"] for e in epochs] == [[200, 200]] * 3
    assert all(e["devices_lost"] == [] for e in epochs)
    # recovery is exact: the losses are an undisturbed run's, to 6 digits (the devices
    # start the redone round from their optimizers' state at its start)
    from aiopipe import RunConfig, VirtualClock, simulate

    config = RunConfig(devices=2, samples_per_device=200, batch_size=20, parallel_batches=2,
                       epochs=3, aggregation_every=5)
    undisturbed = await simulate(config, clock=VirtualClock(), cost_table=_uniform_costs())
    assert [f"{e['loss']:.6g}" for e in epochs] == [f"{e.loss:.6g}"
                                                    for e in undisturbed.epochs]


def _uniform_costs() -> object:
    """Any cost table: virtual time charges it, the numerics do not depend on it."""
    from aiopipe import CostTable

    return CostTable.uniform(5, forward=0.001, backward=0.002)
