"""A stranger against a device's peer port in a real pipeline run (aiopipe/transport/fabric.py,
`PEER_LIMITS`; docs/design.md, Peer ports): a separate attacker process
(tests/peer_port_attacker.py) sends two 200 MiB frames before any handshake, holds 200 idle
connections and keeps 100 silent websocket upgrades open, while the honest neighbour dials
the same port, and goes on flooding until the run has ended. The attacked device's
memory and open files stay within the bounds (its unattacked neighbour is the
yardstick), the neighbour joins, and the run ends with exit 0 and a pipeline's figures:
the two devices, started by hand, linked to each other. (In one event loop:
tests/transport/test_transport_peer_ports.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest
from real_processes import REPO, Process, ProcessFleet, check_pipeline_figures, listening_port

from aiopipe.transport import PEER_LIMITS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = {"mode": "pipeline", "devices": 2, "model": "vgg5", "samples_per_device": 200,
       "batch_size": 20, "parallel_batches": 2, "partition": [3], "schedule": "gpipe",
       "epochs": 2, "test_samples": 100}


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _watch(devices: dict[str, Process], peaks: dict[str, dict[str, float]]) -> None:
    """Keep each device's peak memory and most open files until it exits."""
    while True:
        for name, device in devices.items():
            with contextlib.suppress(OSError, AssertionError):
                pid = device.process.pid
                peak = peaks.setdefault(name, {"rss_mb": 0.0, "files": 0})
                peak["rss_mb"] = max(peak["rss_mb"], _peak_rss_mb(pid))
                peak["files"] = max(peak["files"], _open_files(pid))
        await asyncio.sleep(0.1)


async def test_a_flooded_peer_port_stays_bounded_and_the_neighbour_joins(
        tmp_path: Path) -> None:
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        # device 1 runs stage 1: device 0 dials it (the lower stage dials)
        victim = await fleet.start_device(1, "--listen", "127.0.0.1:0")
        attacked = await listening_port(victim.process.pid)
        # (floods until told to stop, 120 s at most)
        attacker = await fleet.start("attacker", ["peer_port_attacker", "127.0.0.1",
                                                  str(attacked), "120"],
                                     env={"PYTHONPATH": str(REPO / "tests")})
        await attacker.output.wait_for("^flooding$", within=60)
        neighbour = await fleet.start_device(0, "--listen", "127.0.0.1:0")
        peaks: dict[str, dict[str, float]] = {}
        watching = asyncio.ensure_future(_watch({"victim": victim, "neighbour": neighbour},
                                                peaks))
        try:
            await fleet.finish(server, [neighbour, victim], within=180)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            print(f"peak memory and open files: {peaks}")  # also when the run failed
        attacker.send_signal(signal.SIGTERM)  # the run is over: so is the flood
        assert await attacker.wait(60) == 0, attacker.output.text()
    retries = len(neighbour.output.find("trying again"))
    figures = (f"{peaks}\n{attacker.output.text()}\nthe neighbour's dial turned away "
               f"{retries} time(s); the victim logged {len(victim.output.lines)} lines")
    print(figures)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [200, 200]
    assert {p["device"]: p["stage"] for p in epochs[0]["plan"]} == {0: 0, 1: 1}
    # the devices, started by hand, linked to each other: a pipeline's figures
    check_pipeline_figures(fleet.out_dir, epochs, 2)
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert [s["peak_live"] for s in epochs[0]["stages"]] == [2, 2]  # GPipe holds all N
    victim_out = victim.output.text()
    assert "that were not a peer's yet" in victim_out, victim_out
    # two 200 MiB frames cost no more than a few MiB: the victim's peak is its twin's
    assert peaks["victim"]["rss_mb"] < peaks["neighbour"]["rss_mb"] + 100, figures
    # 200 idle connections and 100 upgrades hold at most max_pending descriptors
    assert peaks["victim"]["files"] < (peaks["neighbour"]["files"] + PEER_LIMITS.max_pending
                                       + 24), figures
    # the big frames were refused at their first part, by the handshake's frame limit
    assert "sent a frame of 209715200 bytes, above the limit of 1024 bytes" in victim_out
