"""The dashboard in a real headless Chromium (bench/chromium.py, over the DevTools
protocol): opened on a running test server before its devices join, it loads without an
error in the console, shows the server's devices, follows them as they join and leave,
and draws each epoch as it ends, without a reload. Its streams end every 1.5 s here (a
short handshake timeout), so the browser reconnects several times meanwhile, also
without an error. Skipped where no Chromium is installed (``.ci/run`` installs the
distribution's package)."""

from __future__ import annotations

import asyncio

import pytest
from bench_scripts import load_bench

from aiopipe import Device, RunConfig, Server
from aiopipe.auth import mint_token
from aiopipe.metrics.timeline import COLORS
from aiopipe.runtime.guard import ConnectionLimits

chromium = load_bench("chromium")

pytestmark = [
    pytest.mark.slow,  # (a browser and a training: about 10 s)
    pytest.mark.skipif(chromium.chromium_path() is None,
                       reason="no chromium installed (apt-get install chromium)"),
]

SECRET = b"test-secret-of-32-bytes-at-least"
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=400, batch_size=20, epochs=3,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5)
PAGE = "document.getElementById('dashboard').dataset"


async def _device(url: str, device_id: int) -> None:
    async with Device(url, device_id, token=mint_token(SECRET, device_id)) as device:
        await device.run()


def _devices(url: str) -> None:
    """Every device, in a loop of this thread's own: the devices' setup would hold the
    server's loop up for longer than the streams' margin ([Note: streams that end]; in
    a real fleet they are other processes)."""
    async def every() -> None:
        async with asyncio.TaskGroup() as tasks:
            for k in range(CONFIG.devices):
                tasks.create_task(_device(url, k))

    asyncio.run(every())


async def _look(page: object, seen: list[tuple[str, str]]) -> None:
    """Note what the page shows (its epochs, its devices) if it changed."""
    shown = await page.evaluate(f"[{PAGE}.epochs, {PAGE}.devices]")  # type: ignore[attr-defined]
    if not seen or seen[-1] != tuple(shown):
        seen.append(tuple(shown))


async def _watch(page: object, seen: list[tuple[str, str]]) -> None:
    """`_look` every 50 ms."""
    while True:
        await _look(page, seen)
        await asyncio.sleep(0.05)


async def test_the_page_shows_the_run_s_devices_and_each_epoch_as_it_ends() -> None:
    # streams of 1.5 s: reconnections, each ended 1.5 s before the guard's deadline (a
    # loop held up longer would let the guard cut one: [Note: streams that end])
    limits = ConnectionLimits(handshake_timeout=3.0)
    async with (Server(CONFIG, token_secret=SECRET, join_timeout=60, limits=limits) as server,
                chromium.open_chromium() as page):
        await page.navigate(server.dashboard_url)
        await page.wait_for(f"{PAGE}.devices === '0:waiting,1:waiting'")
        seen: list[tuple[str, str]] = []
        async with asyncio.TaskGroup() as tasks:
            watching = tasks.create_task(_watch(page, seen))
            tasks.create_task(asyncio.to_thread(_devices, server.url))
            await server.run()
            await page.wait_for(f"{PAGE}.epochs === '3' && {PAGE}.devices === '0:done,1:done' "
                                "&& document.getElementById('timeline-caption').innerText"
                                ".startsWith('(epoch 3,')")
            watching.cancel()
        await _look(page, seen)
        rows = await page.evaluate(
            "[...document.querySelectorAll('#devices tr')].map(r => r.innerText)")
        fills = await page.evaluate(
            "[...document.querySelectorAll('#timeline rect')].map(r => r.getAttribute('fill'))")
        points = await page.evaluate("document.querySelectorAll('#chart circle').length")
        table = await page.evaluate("document.querySelectorAll('#epochs tr').length")
        opens = await page.evaluate(f"Number({PAGE}.opens)")
        header = await page.evaluate("document.getElementById('run').innerText")
        shown_errors = await page.evaluate("document.getElementById('errors').innerText")
    assert page.errors == []
    assert shown_errors == ""
    # the devices, with their plan, and each state the page went through, live
    assert [r.split()[0] for r in rows] == ["0", "1"]
    assert all("split_point=2 parallel_batches=2" in r for r in rows)
    epochs_shown = [int(epochs) for epochs, _ in seen]
    assert epochs_shown == sorted(epochs_shown)
    assert epochs_shown[0] == 0
    assert epochs_shown[-1] == 3
    assert len(set(epochs_shown)) >= 3  # at least one epoch drawn before the run ended
    assert any(devices == "0:connected,1:connected" for _, devices in seen)
    # three epochs: charted (loss, test and training accuracy) and tabled
    assert points == 3 * 3
    assert table == 3
    # the timeline of one iteration, in timeline.png's colours
    assert fills
    assert set(fills) <= set(COLORS.values())
    assert {COLORS["f"], COLORS["s"], COLORS["b"]} <= set(fills)
    assert "finished" in header
    assert opens >= 2  # the stream was reopened, and nothing logged an error
