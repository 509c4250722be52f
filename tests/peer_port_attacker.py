"""A stranger against a device's peer port, as its own process (tests/test_peer_port_processes.py):
``python -m peer_port_attacker HOST PORT SECONDS``.

It holds, for SECONDS or until SIGTERM, without ever speaking the peer handshake:

- ``--big`` websockets that each send a chunked frame of ``--big-mib`` MiB, laid out as a
  link sends one (aiopipe/transport/websocket.py, [Note: chunked frames]);
- ``--idle`` plain TCP connections that send nothing;
- ``--upgrades`` websockets that upgrade and then say nothing, opened again as the port
  closes them, so that an honest neighbour dials into a full flood.

It sends the big frames first (for at most 5 s: until the port closes their connections),
then floods. It prints one line per fact the test reads: ``big: N bytes sent``,
``flooding`` once the flood was started, and at the end ``idle: opened N, closed by the
port N`` and ``upgrades: opened N, refused N, failed N, closed by the port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time

import aiohttp

CHUNK = 1 << 20  # aiopipe.transport.websocket.CHUNK_BYTES


async def big_frame(url: str, mib: int, sent: list[int]) -> None:
    """Send the parts of one ``mib`` MiB frame until the port stops taking them."""
    part = bytes(CHUNK)
    with contextlib.suppress(aiohttp.ClientError, ConnectionError, RuntimeError):
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(url, max_msg_size=0,
                                       timeout=aiohttp.ClientWSTimeout(ws_close=1.0))
            await ws.send_bytes(b"APC\x01" + (mib * CHUNK).to_bytes(8, "little") + part)
            sent[0] += CHUNK
            for _ in range(mib - 1):
                if ws.closed:
                    break
                await ws.send_bytes(b"APC\x02" + part)
                sent[0] += CHUNK
            await ws.receive()  # held until the port closes it


async def hold(until: float, stop: asyncio.Event) -> None:
    """Wait until ``until`` (`time.monotonic`) or ``stop``, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, until - time.monotonic()))


async def idle_flood(host: str, port: int, count: int, until: float, stop: asyncio.Event,
                     counts: dict[str, int]) -> None:
    """Open ``count`` idle connections and hold them (those the port closes are counted)."""
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            held.append(await asyncio.open_connection(host, port))
            counts["idle opened"] += 1
    await hold(until, stop)
    for reader, writer in held:
        if reader.at_eof() or writer.is_closing():
            counts["idle closed by the port"] += 1
        writer.close()


async def upgrade_flood(url: str, count: int, until: float, stop: asyncio.Event,
                        counts: dict[str, int]) -> None:
    """Keep ``count`` silent websockets open, opening new ones as the port closes them."""
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=5)) as http:
        holders: set[asyncio.Task[None]] = set()

        async def hold_one() -> None:
            try:
                ws = await http.ws_connect(url, timeout=aiohttp.ClientWSTimeout(ws_close=0.5))
            except aiohttp.WSServerHandshakeError:
                counts["upgrades refused"] += 1
                return
            except (aiohttp.ClientError, ConnectionError, TimeoutError):
                counts["upgrades failed"] += 1
                return
            counts["upgrades opened"] += 1
            await ws.receive()  # returns once the port closes it
            counts["upgrades closed by the port"] += 1

        while time.monotonic() < until and not stop.is_set():
            holders = {task for task in holders if not task.done()}
            holders.update(asyncio.create_task(hold_one())
                           for _ in range(count - len(holders)))
            await hold(min(until, time.monotonic() + 0.5), stop)
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--big", type=int, default=2)
    parser.add_argument("--big-mib", type=int, default=200)
    parser.add_argument("--idle", type=int, default=200)
    parser.add_argument("--upgrades", type=int, default=100)
    args = parser.parse_args()
    url = f"ws://{args.host}:{args.port}/peer"
    until = time.monotonic() + args.seconds
    stop = asyncio.Event()  # SIGTERM: the flood ends now, and the counts are printed
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    counts: dict[str, int] = dict.fromkeys(
        ("idle opened", "idle closed by the port", "upgrades opened", "upgrades refused",
         "upgrades failed", "upgrades closed by the port"), 0)
    sent = [0]
    big = [asyncio.create_task(big_frame(url, args.big_mib, sent)) for _ in range(args.big)]
    # the big frames first, alone: taken or refused by the port's frame limit, not
    # evicted as the oldest strangers by the flood after them
    await asyncio.wait(big, timeout=5.0)
    print(f"big: {sent[0]} bytes sent", flush=True)
    flood = [asyncio.create_task(idle_flood(args.host, args.port, args.idle, until, stop,
                                            counts)),
             asyncio.create_task(upgrade_flood(url, args.upgrades, until, stop, counts))]
    await asyncio.sleep(1.0)
    print("flooding", flush=True)
    await asyncio.gather(*flood)
    for task in big:
        task.cancel()
    await asyncio.gather(*big, return_exceptions=True)
    print(f"idle: opened {counts['idle opened']}, closed by the port "
          f"{counts['idle closed by the port']}", flush=True)
    print(f"upgrades: opened {counts['upgrades opened']}, refused "
          f"{counts['upgrades refused']}, failed {counts['upgrades failed']}, closed by the "
          f"port {counts['upgrades closed by the port']}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
