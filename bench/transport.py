"""Activation-sized frames through aiopipe's WebSocketLink vs a bare aiohttp websocket.

Both run side by side in one process and one event loop, over loopback: an aiohttp
server on 127.0.0.1 with two routes (``/bare``: a plain ``WebSocketResponse``; ``/link``:
`accept_websocket`), and a client for each (``ws_connect`` / `open_websocket_link`).
Each repetition times, for both variants in alternating order:

- up:   the client sends one FRAME-byte frame; the server answers a 1-byte ack on
        arrival; time from the start of the send until the ack is received;
- down: the client sends a 1-byte request; the server answers one FRAME-byte frame;
        time until that frame is received.

Prints medians, MB/s (1 MB = 1e6 bytes) and the link/bare throughput ratio.

    .venv/bin/python bench/transport.py [--mb 13] [--reps 20] [--loop auto|asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from aiopipe.clock import SystemClock
from aiopipe.transport import accept_websocket, open_websocket_link

DOWN_REQUEST = b"D"
ACK = b"k"

Send = Callable[[bytes], Awaitable[None]]
Receive = Callable[[], Awaitable[bytes]]


def build_app(payload: bytes, limit: int) -> web.Application:
    async def bare(request: web.Request) -> web.StreamResponse:
        ws: web.WebSocketResponse[Any] = web.WebSocketResponse(max_msg_size=0, compress=False)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.BINARY:
                break
            await ws.send_bytes(payload if msg.data == DOWN_REQUEST else ACK)
        return ws

    async def link(request: web.Request) -> web.StreamResponse:
        ws_link = await accept_websocket(request, clock=SystemClock(), max_frame_bytes=limit)
        try:
            while True:
                frame = await ws_link.receive()
                await ws_link.send(payload if frame == DOWN_REQUEST else ACK)
        except Exception:  # the client left: LinkBrokenError
            pass
        finally:
            await ws_link.aclose()
        return ws_link.response

    app = web.Application()
    app.router.add_get("/bare", bare)
    app.router.add_get("/link", link)
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"ws://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def time_up(send: Send, receive: Receive, payload: bytes) -> float:
    start = time.perf_counter()
    await send(payload)
    if await receive() != ACK:
        raise RuntimeError("expected an ack")
    return time.perf_counter() - start


async def time_down(send: Send, receive: Receive, size: int) -> float:
    start = time.perf_counter()
    await send(DOWN_REQUEST)
    if len(await receive()) != size:
        raise RuntimeError("short frame")
    return time.perf_counter() - start


async def main(size: int, reps: int, warmup: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    limit = size + 1024
    loop = asyncio.get_running_loop()
    print(f"loop: {type(loop).__module__}.{type(loop).__name__}; python {sys.version.split()[0]}")
    print(f"frame: {size:,} bytes; {reps} timed repetitions per variant (+{warmup} warm-up)")
    times: dict[tuple[str, str], list[float]] = {}
    async with (
        serving(build_app(payload, limit)) as base,
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{base}/bare", max_msg_size=0) as bare_ws,
        open_websocket_link(f"{base}/link", clock=SystemClock(), max_frame_bytes=limit) as link,
    ):

        async def bare_receive() -> bytes:
            msg = await bare_ws.receive()
            if msg.type is not aiohttp.WSMsgType.BINARY:
                raise RuntimeError(f"bare websocket got {msg.type!r}")
            data: bytes = msg.data
            return data

        variants: dict[str, tuple[Send, Receive]] = {
            "bare aiohttp": (bare_ws.send_bytes, bare_receive),
            "aiopipe link": (link.send, link.receive),
        }
        for rep in range(warmup + reps):
            order = list(variants) if rep % 2 == 0 else list(reversed(variants))
            for name in order:
                send, receive = variants[name]
                up = await time_up(send, receive, payload)
                down = await time_down(send, receive, size)
                if rep >= warmup:
                    times.setdefault((name, "up"), []).append(up)
                    times.setdefault((name, "down"), []).append(down)
    print()
    print(f"{'variant':<14} {'dir':<5} {'median s':>9} {'min s':>8} {'MB/s':>8}")
    for (name, direction), samples in times.items():
        median = statistics.median(samples)
        print(
            f"{name:<14} {direction:<5} {median:>9.4f} {min(samples):>8.4f} "
            f"{size / 1e6 / median:>8.1f}"
        )
    print()
    for direction in ("up", "down"):
        bare = statistics.median(times[("bare aiohttp", direction)])
        ours = statistics.median(times[("aiopipe link", direction)])
        print(f"{direction:<5} throughput ratio link/bare = {bare / ours:.3f} (aim >= 0.8)")


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=13.0, help="frame size in MB (1e6 bytes)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    args = parser.parse_args()
    loop_factory = None
    if args.loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if args.loop == "uvloop":
                parser.error("uvloop is not installed")
        else:
            loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main(int(args.mb * 1e6), args.reps, args.warmup))


if __name__ == "__main__":
    run()
