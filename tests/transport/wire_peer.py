"""Both ends of one aiopipe websocket, each run as its own process (the tc-shaped wire-time
test, tests/transport/test_transport_wire_time.py).

    python wire_peer.py receive HOST PORT FRAMES      # prints "ready", then receives
    python wire_peer.py send URL SMALL LARGE          # prints one JSON line of figures

The sender sends SMALL frames of 12.8 kB (a vgg5 activation at B' = 25) 20 ms apart,
then LARGE frames of 1 MB back to back, and reports the bytes, the link's busy seconds
and every frame's wire span once all are acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

from aiopipe.clock import SystemClock
from aiopipe.transport import accept_websocket, open_websocket_link

SMALL_BYTES = 12_800
LARGE_BYTES = 1_000_000
LIMIT = 4 << 20


async def receive(host: str, port: int, frames: int) -> None:
    """Accept one link and read ``frames`` frames from it."""
    done = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        link = await accept_websocket(request, clock=SystemClock(), max_frame_bytes=LIMIT)
        for _ in range(frames):
            await link.receive()
        done.set()
        await link.aclose()
        return link.response

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    await runner.cleanup()


async def send(url: str, small: int, large: int) -> None:
    """Send the frames and print the figures."""
    async with open_websocket_link(url, clock=SystemClock(), max_frame_bytes=LIMIT) as link:
        spans = []
        for _ in range(small):
            spans.append(await link.send(bytes(SMALL_BYTES)))
            await asyncio.sleep(0.02)
        for _ in range(large):
            spans.append(await link.send(bytes(LARGE_BYTES)))
        times = [await span if span is not None else None for span in spans]
        stats = link.statistics().sent
        print(json.dumps({"bytes": stats.bytes, "busy_s": stats.busy_s, "spans": times}))


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        asyncio.run(receive(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        asyncio.run(send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
