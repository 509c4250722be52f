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
from real_processes import Line, Output, ProcessFleet, TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHARE = 400  # samples per device and epoch
RUN = {"devices": 2, "samples_per_device": SHARE, "batch_size": 20, "parallel_batches": 2,
       "aggregation_every": 0, "test_samples": 100, "heartbeat_interval": 0.25,
       "device_timeout": 2.0, "reconnect_grace": 3.0, "epochs": 7}

#: what each end says when it gives up on the silent connection
SERVER_GAVE_UP = r"device 0: .*waiting [\d.]+ s for it to reconnect"
DEVICE_GAVE_UP = r"the server was silent for .*; reconnecting"


async def _stall_after(row: Line, proxy: TcpProxy) -> tuple[int, float]:
    """Stall the proxy early in the epoch after the one ``row`` ends; that epoch's index
    in ``metrics.jsonl``, and when the stall began."""
    epoch = int(row.text.split()[0])  # the row's epoch, counted from 1: the next's index
    await asyncio.sleep(0.3)
    stalled_at = time.monotonic()
    proxy.stall()
    return epoch, stalled_at


async def _both_gave_up(server: Output, device: Output, stalled_at: float) -> None:
    """Both ends gave up on the connection after device_timeout of silence."""
    timeout, heartbeat = RUN["device_timeout"], RUN["heartbeat_interval"]
    for output, pattern in ((server, SERVER_GAVE_UP), (device, DEVICE_GAVE_UP)):
        line = await output.wait_for(pattern, since=stalled_at, within=30)
        # the last message before the stall came at most one heartbeat earlier
        assert timeout - heartbeat - 0.1 <= line.at - stalled_at <= timeout + 2.0, (
            line, stalled_at)


async def test_a_short_stall_costs_nothing_and_a_long_one_the_round(tmp_path: Path) -> None:
    """One run, device 0 stalled twice. Short: the proxy moves bytes again as soon as
    both ends gave up, well within reconnect_grace: the device comes back through it
    with its session, and its epoch counts all its samples. Long: the proxy holds on
    until the server has given the device up (device_timeout + reconnect_grace): the
    epoch goes on without it, and it comes back afresh, in the same process, and takes
    part again from a later round."""
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        async with fleet.proxy() as proxy:
            devices = [await fleet.start_device(0, url=fleet.proxy_url(proxy)),
                       await fleet.start_device(1)]
            out, device = server.output, devices[0].output

            row = await out.wait_for(r"^\s+1\s")  # epoch 1 is done
            short, short_at = await _stall_after(row, proxy)
            await _both_gave_up(out, device, short_at)
            proxy.resume()
            back = await out.wait_for(r"device 0 reconnected \(resuming its session\)",
                                      since=short_at, within=30)
            short_connections = proxy.connections

            row = await out.wait_for(r"^\s+\d+\s", since=back.at, within=60)
            long, long_at = await _stall_after(row, proxy)
            await _both_gave_up(out, device, long_at)
            lost = await out.wait_for(r"device 0 was lost", since=long_at, within=60)
            proxy.resume()
            await fleet.finish(server, devices, within=180)
        connections = proxy.connections
    everything = fleet.all_output()
    epochs = fleet.metrics()
    assert len(epochs) == RUN["epochs"]
    # short: it came back through the proxy once it moved bytes again, with its session
    assert short_connections == 2
    assert not [line for line in out.find(r"device 0 was lost", since=short_at)
                if line.at < long_at], everything
    assert [e["device_samples"] for e in epochs[:long]] == [[SHARE, SHARE]] * long
    assert [e["devices_lost"] for e in epochs[:long]] == [[]] * long
    assert short < long
    # long: lost after device_timeout and reconnect_grace of silence
    assert connections >= 3
    patience = RUN["device_timeout"] + RUN["reconnect_grace"]
    assert lost.at - long_at <= patience + 2.0, everything
    assert out.find(r"round \d+ goes on without device 0", since=long_at)
    assert out.find(r"device 0 reconnected \(afresh", since=lost.at), everything
    assert out.find(r"device 0 takes part again from round", since=lost.at)
    struck = epochs[long]
    assert struck["devices_lost"] == [0]  # the round of the stall went on without it
    assert struck["device_samples"] == [0, SHARE]
    assert epochs[-1]["device_samples"] == [SHARE, SHARE], epochs  # back in the same process
    # an epoch it missed whole while reconnecting lists it lost (issue 41, item 8)
    assert all(e["devices_lost"] == ([0] if e["device_samples"][0] == 0 else [])
               for e in epochs[long + 1:]), epochs
