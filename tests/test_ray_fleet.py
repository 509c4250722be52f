"""The Ray backend (aiopipe.ray_fleet): devices as Ray actors on a two-node Ray cluster
started on this machine the way docs/howto/ray.md says, against the in-process simulation of
the same seed. Skipped where Ray is not installed (``pip install -e ".[ray]"``).

Each node is started with ``ray start ... --block`` as a child process in a session of
its own, so that the test stops exactly the Ray processes it started (SIGTERM to the two
``ray start`` processes, which take their nodes down; the process groups are killed if
anything is left), never every Ray process of the machine as ``ray stop`` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiopipe import ConfigError, RunConfig, TrainingError, simulate
from aiopipe.ray_fleet import actor_groups, run_on_ray

#: Each node's share of this machine: one CPU (one device actor) and a small object
#: store (the run puts nothing in it).
NODE_OPTIONS = ("--num-cpus=1", f"--object-store-memory={100 * 2**20}",
                "--disable-usage-stats")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ray_command() -> str:
    found = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if found is None:
        pytest.skip("the ray command is not installed next to this Python")
    return found


def _start_node(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # SIGTERM: down at once
    with log.open("wb") as out:
        return subprocess.Popen([_ray_command(), "start", *args, *NODE_OPTIONS, "--block"],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop_node(node: subprocess.Popen[bytes]) -> None:
    if node.poll() is None:
        node.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(30)
    with contextlib.suppress(ProcessLookupError):  # whatever of its session is left
        os.killpg(node.pid, signal.SIGKILL)
    node.wait()


def _alive_nodes(address: str) -> int:
    status = subprocess.run([_ray_command(), "status", f"--address={address}"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if status.returncode != 0:
        return 0
    active = status.stdout.partition("Active:")[2].partition("Pending:")[0]
    return sum(line.strip().startswith("1 node_") for line in active.splitlines())


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head node and a second node on this machine (docs/howto/ray.md);
    its address."""
    pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="aiopipe-ray-"))  # short: Ray's socket paths
    port = _free_port()
    address = f"127.0.0.1:{port}"
    nodes = [_start_node(["--head", f"--port={port}", "--include-dashboard=false",
                          f"--temp-dir={temp}"], temp / "head.log")]
    try:
        deadline = time.monotonic() + 120
        while _alive_nodes(address) < 1:
            if time.monotonic() > deadline or nodes[0].poll() is not None:
                pytest.fail(f"the Ray head did not start: {(temp / 'head.log').read_text()}")
            time.sleep(1)
        nodes.append(_start_node([f"--address={address}"], temp / "node.log"))
        while _alive_nodes(address) < 2:
            if time.monotonic() > deadline or nodes[1].poll() is not None:
                pytest.fail(f"the second Ray node did not join: "
                            f"{(temp / 'node.log').read_text()}")
            time.sleep(1)
        yield address
    finally:
        for node in reversed(nodes):
            _stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)


def _fleet() -> RunConfig:
    """10 devices of 240 synthetic-mnist samples, 2 epochs of PiPar: accuracy well above
    chance (0.43 against 0.10) in about 5 s in process."""
    return RunConfig(mode="pipar", model="vgg5", dataset="synthetic-mnist", devices=10,
                     samples_per_device=240, batch_size=48, epochs=2, test_samples=500,
                     seed=3, learning_rate=0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_ray_fleet_trains_as_the_in_process_simulation_and_names_a_failed_device(
        ray_cluster: str, caplog: pytest.LogCaptureFixture) -> None:
    """On one two-node cluster (starting one costs more than a run on it), two runs:

    - PiPar's devices as actors on both nodes train what the in-process simulation of
      the same seed trains. (One mode: the backend does the same for every mode whose
      devices do not link to each other, fl as pipar: the devices dial the driver's
      server over websockets, and what a mode does with them is the server's and the
      device's, as in every other run; fl on Ray: the second run.)
    - A device that fails (its data cannot be opened) is named, with its node and why.
    """
    config = _fleet()
    caplog.set_level(logging.INFO, logger="aiopipe.ray")
    started = time.perf_counter()
    on_ray = await run_on_ray(config, address=ray_cluster)
    ray_s = time.perf_counter() - started
    started = time.perf_counter()
    in_process = await simulate(config)
    simulate_s = time.perf_counter() - started
    print(f"Ray {ray_s:.1f} s, accuracy {on_ray.final.accuracy:.4f}; in process "
          f"{simulate_s:.1f} s, accuracy {in_process.final.accuracy:.4f}")

    # the devices ran on both nodes, 5 on each
    placed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("devices ")]
    assert [m.split()[1] for m in placed] == ["0-4", "5-9"]
    assert len({m.split()[5] for m in placed}) == 2, placed  # node ids
    assert abs(on_ray.final.accuracy - in_process.final.accuracy) <= 0.02
    assert on_ray.final.accuracy > 0.2  # it learned: chance is 0.1
    for ray_epoch, epoch in zip(on_ray.epochs, in_process.epochs, strict=True):
        assert ray_epoch.samples == epoch.samples == 10 * 240
        assert ray_epoch.device_samples == epoch.device_samples

    # the server holds no data; each device opens the run's files, which are not there
    # (reconnect_grace: the server gives the failed device up, and so closes, at once)
    failing = RunConfig(mode="fl", devices=2, dataset="mnist:/nonexistent/aiopipe-ray",
                        test_samples=0, samples_per_device=48, epochs=1, reconnect_grace=0.5)
    with pytest.raises(TrainingError, match=r"device \d on Ray node \S+ failed: ConfigError"):
        await run_on_ray(failing, address=ray_cluster, join_timeout=60)


async def test_an_unreachable_cluster_is_one_clear_error() -> None:
    pytest.importorskip("ray")
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(ConfigError, match=f"cannot reach the Ray cluster at {address}"):
        await asyncio.wait_for(run_on_ray(RunConfig(devices=2), address=address), 30)


async def test_without_ray_the_backend_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'aiopipe\[ray\]'"):
        await run_on_ray(RunConfig(devices=2))


def test_devices_are_divided_among_one_actor_per_free_cpu() -> None:
    assert actor_groups(20, 2.0) == ([list(range(10)), list(range(10, 20))], 1)
    assert actor_groups(5, 2.0, devices_per_actor=2) == ([[0, 1], [2, 3], [4]], 0.66)
    assert actor_groups(3, 16.0) == ([[0], [1], [2]], 1)  # no more actors than devices
    assert actor_groups(4, 16.0, devices_per_actor=2) == ([[0, 1], [2, 3]], 2)
    assert actor_groups(2, 0.5) == ([[0, 1]], 0.5)
    with pytest.raises(ConfigError, match="no free CPU"):
        actor_groups(2, 0.0)
    with pytest.raises(ConfigError, match="devices_per_actor"):
        actor_groups(2, 2.0, devices_per_actor=0)
