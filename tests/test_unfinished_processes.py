"""A run that fails between real processes keeps what it finished (issue 41; [Note:
results on every ending] in aiopipe/metrics/results.py): a pipeline whose every device
process is SIGKILLed once epoch 1 has ended cannot go on, and both ``python -m
aiopipe.server`` and ``python -m aiopipe`` then exit 1 with ``metrics.jsonl`` of the
finished epoch, ``model.safetensors`` and ``unfinished.txt`` (why) in the results
directory. (In virtual time: tests/test_unfinished_results.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from real_processes import Process, ProcessFleet
from safetensors.torch import load_file

from aiopipe.metrics.results import UNFINISHED_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PIPELINE = {"mode": "pipeline", "devices": 2, "model": "vgg5", "samples_per_device": 200,
            "batch_size": 20, "parallel_batches": 2, "epochs": 20, "test_samples": 100,
            "heartbeat_interval": 0.5, "device_timeout": 3.0, "reconnect_grace": 1.0}


def _check_kept(fleet: ProcessFleet, finished: int) -> str:
    """The results directory holds ``finished`` or more epochs' metrics (not all), a model
    and the reason; returns the reason."""
    epochs = fleet.metrics()
    assert finished <= len(epochs) < PIPELINE["epochs"], fleet.all_output()
    assert [e["epoch"] for e in epochs] == list(range(1, len(epochs) + 1))
    assert load_file(fleet.out_dir / "model.safetensors"), fleet.all_output()
    assert (fleet.out_dir / "config.toml").exists()
    return (fleet.out_dir / UNFINISHED_NAME).read_text()


async def test_a_failed_server_keeps_its_finished_epochs(tmp_path: Path) -> None:
    async with ProcessFleet(tmp_path, PIPELINE) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(2)]
        await server.output.wait_for(r"^\s+1\s", within=120)  # epoch 1's row
        for device in devices:
            device.send_signal(signal.SIGKILL)
        assert await server.wait(60) == 1, fleet.all_output()
    reason = _check_kept(fleet, 1)
    assert reason.startswith("training failed: "), reason
    assert "Traceback" not in server.output.text()


async def test_a_failed_launcher_run_keeps_its_finished_epochs(tmp_path: Path) -> None:
    async with ProcessFleet(tmp_path, PIPELINE) as fleet:
        launcher = await fleet.start("launcher", [
            "aiopipe", "--config", str(fleet.config_file), "--out-dir", str(fleet.out_dir)])
        await launcher.output.wait_for(r"^\s+1\s", within=120)  # epoch 1's row
        for pid in _device_pids(launcher):
            os.kill(pid, signal.SIGKILL)
        assert await launcher.wait(60) == 1, fleet.all_output()
    reason = _check_kept(fleet, 1)
    assert reason.startswith("training failed: "), reason
    assert "every device process has exited" in reason, reason
    assert "python -m aiopipe: failed: " in launcher.output.text()


def _device_pids(launcher: Process) -> list[int]:
    """The launcher's device processes, as it logs them when it starts (it forks them:
    [Note: fork server])."""
    started = launcher.output.find(r"device \d+ started: pid \d+")
    assert started, launcher.output.text()
    return [int(line.text.rsplit(" ", 1)[1]) for line in started]
