"""Strangers against a live server process ([Note: bounded before authentication] in
aiopipe/runtime/guard.py): 300 idle connections against a server whose open-file limit is
256 do not keep the honest devices out, nor ``/status``; twelve connections that each start
a model-sized frame before their hello (tokens valid, one for an id outside the fleet)
cost the server no more than a few megabytes. (One server for both. A replayed token:
the virtual-time test tests/runtime/test_runtime_token_replay.py and the websocket test
of tests/runtime/test_runtime_websocket.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from pathlib import Path

import aiohttp
import pytest
from real_processes import ProcessFleet

from aiopipe.auth import mint_token
from aiopipe.transport.websocket import CHUNK_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "hostile-test-secret-of-32-bytes!"
RUN = {"mode": "pipar", "devices": 2, "samples_per_device": 100, "batch_size": 20,
       "epochs": 2, "parallel_batches": 2, "test_samples": 100}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _status(url: str) -> int:
    base = url.removesuffix("/ws")
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
                http.get(f"{base}/status") as response):
        return response.status


async def _frame_before_hello(url: str, device_id: int, size: int, sent: asyncio.Event,
                              measured: asyncio.Event) -> None:
    """Connect with device ``device_id``'s token and send all but the last part of a
    ``size``-byte frame (chunked as the link sends one) before any hello; hold it until
    ``measured``. Sets ``sent`` once all is sent (or the server closed the connection)."""
    headers = {"Authorization": f"Bearer {mint_token(SECRET.encode(), device_id)}"}
    part = bytes(CHUNK_BYTES)
    try:
        with contextlib.suppress(aiohttp.ClientError, ConnectionError):
            async with aiohttp.ClientSession() as http:
                ws = await http.ws_connect(url, headers=headers, max_msg_size=0)
                await ws.send_bytes(b"APC\x01" + size.to_bytes(8, "little") + part)
                for _ in range(size // CHUNK_BYTES - 2):
                    await ws.send_bytes(b"APC\x02" + part)
                sent.set()
                await measured.wait()  # hold what was sent while the server's RSS is read
                await ws.close()
    finally:
        sent.set()


async def test_frames_before_hello_and_idle_connections_keep_nobody_out(
        tmp_path: Path) -> None:
    """One server, two attacks, one after the other:

    - twelve connections that each start a model-sized frame before their hello (tokens
      valid, one for an id outside the fleet) cost the server no more than a few
      megabytes;
    - then, under an open-file limit of 256, 300 idle connections do not keep the honest
      devices out, nor ``/status``: the devices join and train.
    """
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server("--token-secret", SECRET, "--join-timeout", "120")
        assert await _status(fleet.url) == 200  # (the server has served a request)
        before = _rss_mb(server.process.pid)
        measured = asyncio.Event()
        sent = [asyncio.Event() for _ in range(12)]
        attacks = [asyncio.create_task(_frame_before_hello(fleet.url, k, 30 * CHUNK_BYTES,
                                                           done, measured))
                   for k, done in zip([*range(11), 99], sent, strict=True)]
        # (99: a valid token for no device of the run)
        async with asyncio.timeout(60):
            await asyncio.gather(*(done.wait() for done in sent))
        await asyncio.sleep(0.5)  # what the kernel held for the server, read
        during = _rss_mb(server.process.pid)
        measured.set()
        await asyncio.gather(*attacks)
        assert await _status(fleet.url) == 200
        print(f"server RSS {before:.1f} MB before, {during:.1f} MB during the attack")
        assert during - before <= 50, (before, during)

        resource.prlimit(server.process.pid, resource.RLIMIT_NOFILE, (256, 256))
        idle = [await asyncio.open_connection("127.0.0.1", fleet.port()) for _ in range(300)]
        assert await _status(fleet.url) == 200
        devices = [await fleet.start_device(k, "--token", mint_token(SECRET.encode(), k))
                   for k in range(2)]
        await fleet.finish(server, devices, within=120)
        for _, writer in idle:
            writer.close()
    assert [m["samples"] for m in fleet.metrics()] == [200, 200]
    assert "that were not a device's yet" in server.output.text()
