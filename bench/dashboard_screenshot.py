"""A screenshot of the live dashboard during a run (docs/img/dashboard.png).

Runs a PiPar server and its devices in this process over real websockets on loopback,
opens the server's page (``/``) in a headless Chromium (bench/chromium.py) before the
devices join, and takes the picture once ``--after`` epochs have ended while the run
goes on; it fails if the page logged an error.

    .venv/bin/python bench/dashboard_screenshot.py [--out docs/img/dashboard.png]
        [--devices 3] [--epochs 8] [--after 5] [--samples-per-device 600]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from chromium import open_chromium  # noqa: E402

from aiopipe import Device, RunConfig, Server  # noqa: E402


def _devices(url: str, count: int) -> None:
    """The devices, in a loop of this thread's own (in one loop with the server they
    would hold it up as they set up, longer than the page's streams may wait)."""
    async def device(k: int) -> None:
        async with Device(url, k) as it:
            await it.run()

    async def every() -> None:
        async with asyncio.TaskGroup() as tasks:
            for k in range(count):
                tasks.create_task(device(k))

    asyncio.run(every())


async def screenshot(*, devices: int, epochs: int, after: int,
                     samples_per_device: int) -> tuple[bytes, list[str]]:
    """The picture (a PNG, the whole page at 1280 pixels wide), and what the page logged
    as errors."""
    config = RunConfig(mode="pipar", devices=devices, samples_per_device=samples_per_device,
                       batch_size=20, epochs=epochs, split_point=2, parallel_batches=2,
                       test_samples=200, seed=3)
    async with (Server(config, join_timeout=60, torch_device="cpu") as server,
                open_chromium() as page):
        await page.navigate(server.dashboard_url)
        await page.wait_for("document.getElementById('dashboard').dataset.updates > 0")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(asyncio.to_thread(_devices, server.url, devices))
            training = tasks.create_task(server.run())
            await page.wait_for(f"document.getElementById('dashboard').dataset.epochs >= {after}",
                                seconds=600)
            await page.wait_for("document.querySelectorAll('#timeline rect').length > 0")
            await asyncio.sleep(1.0)  # a live busy fraction of the next epoch
            height = await page.evaluate("document.documentElement.scrollHeight")
            png = await page.screenshot(width=1280, height=int(height))
            await training
    return png, page.errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BENCH.parent / "docs/img/dashboard.png")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--after", type=int, default=5)
    parser.add_argument("--samples-per-device", type=int, default=600)
    args = parser.parse_args()
    png, errors = asyncio.run(screenshot(devices=args.devices, epochs=args.epochs,
                                         after=args.after,
                                         samples_per_device=args.samples_per_device))
    if errors:
        sys.exit("the page logged errors:\n" + "\n".join(errors))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(png)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
