"""A stalled link between real processes (DESIGN §7, "link stalls or slows"): device 0
reaches the server through a TCP proxy that stops moving bytes in both directions while
keeping both sockets open, so neither end sees the connection break; only silence.

Both ends give up on the connection after device_timeout of silence (heartbeats stop
arriving). A stall that ends early enough lets the device reconnect within
reconnect_grace with its session: it finishes its round, and no sample is lost or counted
twice. A longer stall costs the device its round (the run goes on without it) and it
takes part again from a later round, in the same process.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from real_processes import ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHARE = 400  # samples per device and epoch
RUN = {"devices": 2, "samples_per_device": SHARE, "batch_size": 20, "parallel_batches": 2,
       "aggregation_every": 0, "test_samples": 100, "heartbeat_interval": 0.25,
       "device_timeout": 2.0}


async def _stall_device_0(tmp_path: Path, run: dict[str, float | int], stall_s: float
                          ) -> tuple[ProcessFleet, float, int]:
    """Run with device 0 behind the proxy, stall it for ``stall_s`` early in epoch 2, let
    the run finish; the fleet (its processes have exited), when the stall began, and how
    many connections device 0 opened through the proxy."""
    async with ProcessFleet(tmp_path, run) as fleet:
        server = await fleet.start_server()
        async with fleet.proxy() as proxy:
            devices = [await fleet.start_device(0, url=fleet.proxy_url(proxy)),
                       await fleet.start_device(1)]
            await server.output.wait_for(r"^\s+1\s")  # epoch 1 is done
            await asyncio.sleep(0.3)
            stalled_at = time.monotonic()
            proxy.stall()
            await asyncio.sleep(stall_s)
            proxy.resume()
            await fleet.finish(server, devices, within=180)
        return fleet, stalled_at, proxy.connections


def _gave_up(fleet: ProcessFleet, stalled_at: float, timeout: float, heartbeat: float) -> None:
    """Both ends gave up on the connection after device_timeout of silence."""
    server, device = fleet.processes[0].output, fleet.processes[1].output
    gave_up = [*server.find(r"device 0: .*waiting [\d.]+ s for it to reconnect",
                            since=stalled_at)[:1],
               *device.find(r"the server was silent for .*; reconnecting", since=stalled_at)[:1]]
    assert len(gave_up) == 2, fleet.all_output()
    for line in gave_up:
        # the last message before the stall came at most one heartbeat earlier
        assert timeout - heartbeat - 0.1 <= line.at - stalled_at <= timeout + 2.0, (
            line, stalled_at, fleet.all_output())


async def test_a_short_stall_costs_nothing(tmp_path: Path) -> None:
    run = {**RUN, "epochs": 4, "reconnect_grace": 10.0}
    fleet, stalled_at, connections = await _stall_device_0(tmp_path, run, stall_s=3.0)
    _gave_up(fleet, stalled_at, run["device_timeout"], run["heartbeat_interval"])
    assert connections == 2  # it came back through the proxy once it moved bytes again
    server = fleet.processes[0].output
    assert server.find(r"device 0 reconnected \(resuming its session\)", since=stalled_at)
    assert not server.find(r"device 0 was lost"), fleet.all_output()
    epochs = fleet.metrics()
    assert [e["device_samples"] for e in epochs] == [[SHARE, SHARE]] * 4
    assert [e["devices_lost"] for e in epochs] == [[]] * 4


async def test_a_long_stall_costs_the_round_and_the_device_comes_back(tmp_path: Path) -> None:
    # lost after 2 + 2 s; back 1.5 s later, with (unloaded) 0.4-second epochs still to go
    run = {**RUN, "epochs": 10, "reconnect_grace": 2.0}
    fleet, stalled_at, connections = await _stall_device_0(tmp_path, run, stall_s=5.5)
    _gave_up(fleet, stalled_at, run["device_timeout"], run["heartbeat_interval"])
    assert connections >= 2
    server = fleet.processes[0].output
    found = server.find(r"device 0 was lost", since=stalled_at)
    assert found, fleet.all_output()
    lost = found[0]
    patience = run["device_timeout"] + run["reconnect_grace"]
    assert lost.at - stalled_at <= patience + 2.0, fleet.all_output()
    assert server.find(r"round \d+ goes on without device 0", since=stalled_at)
    assert server.find(r"device 0 reconnected \(afresh", since=lost.at), fleet.all_output()
    assert server.find(r"device 0 takes part again from round", since=lost.at)
    epochs = fleet.metrics()
    assert len(epochs) == 10
    assert epochs[0]["device_samples"] == [SHARE, SHARE]
    assert epochs[1]["devices_lost"] == [0]  # the round of the stall went on without it
    assert epochs[1]["device_samples"] == [0, SHARE]
    assert epochs[-1]["device_samples"] == [SHARE, SHARE], epochs  # back in the same process
    # an epoch it missed whole while reconnecting lists it lost (issue 41, item 8)
    assert all(e["devices_lost"] == ([0] if e["device_samples"][0] == 0 else [])
               for e in epochs[2:]), epochs
