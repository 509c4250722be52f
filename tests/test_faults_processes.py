"""Faults between real processes over real websockets (DESIGN §7): a device process is
SIGKILLed mid-epoch; the run completes without it (its round is dropped once it has not
come back within reconnect_grace), and once restarted it rejoins. The server process is
SIGKILLed and resumed from its checkpoint. (A stalled link: test_stall_processes.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOKEN = "fault-test-token"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["AIOPIPE_TOKEN"] = TOKEN
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _device(url: str, k: int, log: Path) -> subprocess.Popen[str]:
    with open(log, "a") as stderr:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "aiopipe.device", "--server", url, "--device-id", str(k)],
            env=_env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_device_process_is_excluded_then_rejoins(tmp_path: Path) -> None:
    out = tmp_path / "run"
    logs = tmp_path / "stderr.log"
    config = tmp_path / "run.toml"  # (reconnect_grace has no command-line option)
    config.write_text("reconnect_grace = 3.0\n")
    with open(logs, "a") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "aiopipe.server", "--port", "0", "--devices", "3",
             "--samples-per-device", "400", "--batch-size", "20", "--parallel-batches", "2",
             "--epochs", "10", "--out-dir", str(out), "--join-timeout", "120",
             "--device-timeout", "8", "--heartbeat-interval", "0.5", "--config", str(config)],
            env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    devices: list[subprocess.Popen[str]] = []
    lines: list[str] = []
    try:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if match := re.search(r"at (ws://\S+)", line):
                url = match.group(1)
                break
        devices = [_device(url, k, logs) for k in range(3)]
        # the first epoch row: epoch 2 has just started; kill device 2 in it
        for line in server.stdout:
            lines.append(line)
            if re.match(r"\s+1\s", line):
                break
        devices[2].send_signal(signal.SIGKILL)
        devices[2].wait(timeout=30)
        killed = time.monotonic()
        deadline = killed + 60
        while "device 2 was lost" not in logs.read_text():  # the server gave up on it
            assert time.monotonic() < deadline, logs.read_text()
            time.sleep(0.1)
        # a dead process's socket closes at once: what it costs is reconnect_grace, not
        # device_timeout
        assert 3.0 <= time.monotonic() - killed < 8.0, logs.read_text()
        devices.append(_device(url, 2, logs))  # restarted with the same id
        reader = threading.Thread(target=lambda: lines.extend(server.stdout or ()))
        reader.start()
        assert server.wait(timeout=240) == 0, logs.read_text()
        reader.join(timeout=10)
        for device in (devices[0], devices[1], devices[3]):
            assert device.wait(timeout=60) == 0, logs.read_text()
    finally:
        for process in (server, *devices):
            if process.poll() is None:
                process.kill()
                process.wait()
        if server.stdout is not None:
            server.stdout.close()
    assert devices[2].returncode == -signal.SIGKILL
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(epochs) == 10
    per_device = 400 // 20 * 20
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

    for value in load_file(str(out / "model.safetensors")).values():
        assert torch.isfinite(value).all()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_server_resumes_and_the_devices_carry_on(tmp_path: Path) -> None:
    """SIGKILL the server process mid-epoch and start it again with --resume: the device
    processes reconnect by themselves, and every epoch processes exactly its samples."""
    out, logs, port = tmp_path / "run", tmp_path / "stderr.log", _free_port()
    url = f"ws://127.0.0.1:{port}/ws"
    start = [sys.executable, "-m", "aiopipe.server", "--port", str(port)]
    options = ["--devices", "2", "--samples-per-device", "400", "--batch-size", "20",
               "--parallel-batches", "2", "--epochs", "3", "--aggregation-every", "5",
               "--out-dir", str(out), "--device-timeout", "10", "--heartbeat-interval", "0.5"]

    def server(*args: str) -> subprocess.Popen[str]:
        with open(logs, "a") as stderr:
            return subprocess.Popen([*start, *args], env=_env(), stdout=subprocess.PIPE,
                                    stderr=stderr, text=True)

    first = server(*options)
    devices: list[subprocess.Popen[str]] = []
    second: subprocess.Popen[str] | None = None
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if "waiting for" in line:
                break
        devices = [_device(url, k, logs) for k in range(2)]
        for line in first.stdout:  # epoch 1 is done; kill the server early in epoch 2
            if re.match(r"\s+1\s", line):
                break
        time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        second = server("--resume", str(out))
        _output, _ = second.communicate(timeout=240)
        assert second.returncode == 0, logs.read_text()
        for device in devices:
            assert device.wait(timeout=60) == 0, logs.read_text()
    finally:
        for process in (first, second, *devices):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        if first.stdout is not None:
            first.stdout.close()
    assert "resuming at epoch 2" in logs.read_text()
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert [e["device_samples"] for e in epochs] == [[400, 400]] * 3
    assert all(e["devices_lost"] == [] for e in epochs)
    # recovery is exact: the losses are an undisturbed run's, to 6 digits (the devices
    # start the redone round from their optimizers' state at its start)
    import asyncio

    from aiopipe import RunConfig, VirtualClock, simulate

    config = RunConfig(devices=2, samples_per_device=400, batch_size=20, parallel_batches=2,
                       epochs=3, aggregation_every=5)
    undisturbed = asyncio.run(simulate(config, clock=VirtualClock(),
                                       cost_table=_uniform_costs()))
    assert [f"{e['loss']:.6g}" for e in epochs] == [f"{e.loss:.6g}"
                                                    for e in undisturbed.epochs]


def _uniform_costs() -> object:
    """Any cost table: virtual time charges it, the numerics do not depend on it."""
    from aiopipe import CostTable

    return CostTable.uniform(5, forward=0.001, backward=0.002)
