"""Mount an aiopipe server inside an existing aiohttp application.

The application already has its own route, ``GET /hello``. `aiopipe.Server` with
``host=None`` listens nowhere by itself; ``server.add_routes(app, prefix="/aiopipe")``
mounts the device websocket (``/aiopipe/ws``), ``/aiopipe/status`` and
``/aiopipe/metrics`` next to the app's routes. The app runs as usual with
``web.AppRunner`` / ``web.TCPSite`` on 127.0.0.1 (any free port). Two devices run as
`aiopipe.Device` tasks in the same event loop (each with its own compute thread) and
connect to ``ws://127.0.0.1:PORT/aiopipe/ws``; they could just as well be
``python -m aiopipe.device --server ws://127.0.0.1:PORT/aiopipe/ws --device-id K``
processes on other machines. One small epoch of PiPar trains; the app keeps answering
its own route while the devices train and afterwards.

    .venv/bin/python examples/embed_server.py      # about 10 s
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import torch
from aiohttp import web

import aiopipe
from aiopipe.auth import generate_secret, mint_token
from aiopipe.runtime.device import DeviceSummary

DEVICES = 2


async def hello(request: web.Request) -> web.Response:
    """The application's own route."""
    return web.Response(text="hello from my app")


def print_epoch(m: aiopipe.EpochMetrics) -> None:
    """Progress callback: one line per finished epoch (``m.epoch``: the first is 1)."""
    busy = ", ".join(f"{k} {v:.2f}" for k, v in m.busy_s.items())
    print(
        f"epoch {m.epoch}: time {m.time_s:.2f} s, loss {m.loss:.4f}, "
        f"test accuracy {m.accuracy:.3f}, train accuracy {m.train_accuracy:.3f}, "
        f"{m.samples} samples, busy s: {busy}, "
        f"{m.bytes_up / 1e6:.1f} MB up, {m.bytes_down / 1e6:.1f} MB down",
        flush=True,
    )


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    """Status and body of ``GET url``."""
    async with http.get(url) as response:
        return response.status, await response.text()


async def visit_while_training(http: aiohttp.ClientSession, base: str) -> None:
    """Once every device is connected, show that the app's own route still answers."""
    while True:
        _, body = await get(http, f"{base}/aiopipe/status")
        if len(aiopipe_status(body)["connected"]) == DEVICES:
            break
        await asyncio.sleep(0.05)
    status, text = await get(http, f"{base}/hello")
    print(f"GET /hello while {DEVICES} devices train: {status} {text}", flush=True)


def aiopipe_status(body: str) -> dict[str, Any]:
    """The JSON of ``GET /aiopipe/status``."""
    status: dict[str, Any] = json.loads(body)
    return status


async def main() -> None:
    torch.set_num_threads(1)
    config = aiopipe.RunConfig(
        mode="pipar",
        model="vgg5",
        dataset="synthetic-cifar10",
        devices=DEVICES,
        samples_per_device=200,
        batch_size=40,  # 4 micro-batches of 10: N divides B, and 5 batches use all 200
        split_point=2,
        parallel_batches=4,
        epochs=1,
        test_samples=500,
        seed=0,
    )
    secret = generate_secret().encode()  # each device gets its own token under it

    app = web.Application()
    app.router.add_get("/hello", hello)
    async with aiopipe.Server(
        config, host=None, token_secret=secret, progress=print_epoch
    ) as server:
        server.add_routes(app, prefix="/aiopipe")  # before the app starts (it freezes)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
            base, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/aiopipe/ws"
            print(
                f"app serving GET /hello and /aiopipe/{{ws,status,metrics}} at {base}", flush=True
            )

            async def device(k: int) -> DeviceSummary:
                async with aiopipe.Device(ws_url, k, token=mint_token(secret, k)) as node:
                    return await node.run()

            async with aiohttp.ClientSession() as http, asyncio.TaskGroup() as tasks:
                devices = [tasks.create_task(device(k)) for k in range(DEVICES)]
                tasks.create_task(visit_while_training(http, base))
                result = await server.run()
            # the devices have said goodbye and closed their links; the app still serves
            async with aiohttp.ClientSession() as http:
                status, text = await get(http, f"{base}/hello")
                print(f"GET /hello after training: {status} {text}", flush=True)
                status, body = await get(http, f"{base}/aiopipe/status")
                finished = [e["epoch"] for e in aiopipe_status(body)["finished_epochs"]]
                print(f"GET /aiopipe/status after training: {status}, finished epochs {finished}")
        finally:
            await runner.cleanup()
    summaries = [d.result() for d in devices]
    print("devices:", "; ".join(f"{s.device_id}: {s.samples} samples" for s in summaries))
    print(f"done: test accuracy {result.final.accuracy:.3f} after epoch {result.final.epoch}")


if __name__ == "__main__":
    asyncio.run(main())
