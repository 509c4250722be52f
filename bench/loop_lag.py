"""Event-loop lag of a device node while it trains, vs the same compute run inline.

A probe task sleeps 1 ms over and over and records how late it wakes (lag = measured
sleep - 1 ms). It runs in this process, which is the device process, in three phases
measured one after the other in one run:

- ``idle``:   the loop does nothing else (the loop's own timer resolution and OS noise);
- ``device``: a real `aiopipe.Device` trains over a real loopback websocket against
              ``python -m aiopipe.server`` running in ANOTHER process; torch work runs in
              the device's compute thread while the loop moves bytes. Reported for the
              whole run and split into ``set-up`` (connect, plan, the first compute-thread
              item: data, model and optimizer built) and ``training`` (everything after);
              ``busy`` keeps only the wake-ups whose sleep overlapped compute-thread work;
- ``inline``: the same device-half work (forward of each micro-batch, backward with a
              gradient, optimizer step), same micro-batch size, same data pipeline, same
              iteration count, called directly on the event loop, yielding to the loop
              between work items as an async device without a compute thread would.

The compute thread's busy intervals come from the device's injected clock: `Compute`
wraps every item it runs in the thread in ``clock.hold()``, and the bench's clock records
those intervals (the library itself reads no clock here; the bench may).

Prints p50 / p99 / max lag in ms per phase, the worst wake-ups with their times, and the
ratio of inline to device p99.

Known (reported, not worked around): the ``closing`` phase takes the device's whole close
timeout (5 s) when the server is ``python -m aiopipe.server``: the server's aiohttp runner
starts cleaning up as soon as training ends, and from then on aiohttp drops every incoming
byte, so the device's close frame is never answered. The lag figures are not affected.

    .venv/bin/python bench/loop_lag.py [--mode pipar] [--samples 1000] [--epochs 1]
        [--split-point 2] [--parallel-batches 4] [--batch-size 50] [--network lan]
        [--device-slowdown 1] [--loop auto|asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import importlib.util
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import torch

import aiopipe
from aiopipe import data as datasets
from aiopipe import models
from aiopipe.config import MODES
from aiopipe.runtime.device import DeviceSummary

PROBE_S = 0.001
TOP = 5  # worst wake-ups listed per phase

Samples = list[tuple[float, float]]  # (wake-up start, perf_counter s; lag ms)


class WatchClock(aiopipe.SystemClock):
    """The system clock, recording when the compute thread is busy (`hold` intervals)."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Record the interval of one compute-thread item."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy.append((start, time.perf_counter()))


async def probe(samples: Samples, stop: asyncio.Event) -> None:
    """Sleep 1 ms repeatedly; record when each sleep began and how late it woke (ms)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        samples.append((t0, (time.perf_counter() - t0 - PROBE_S) * 1e3))


async def measure(work: Callable[[], Awaitable[Any]]) -> tuple[Samples, float, float, Any]:
    """Run ``work`` with the probe alongside; (samples, start, end, work's result)."""
    samples: Samples = []
    stop = asyncio.Event()
    task = asyncio.create_task(probe(samples, stop))
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    try:
        result = await work()
    finally:
        t1 = time.perf_counter()
        stop.set()
        await task
    return samples, t0, t1, result


async def start_server(
    args: argparse.Namespace, out_dir: str, token: str
) -> tuple[asyncio.subprocess.Process, str, asyncio.Task[list[str]]]:
    """``python -m aiopipe.server`` on a free loopback port; (process, url, its stdout)."""
    command = [
        sys.executable,
        "-m",
        "aiopipe.server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--mode",
        args.mode,
        "--devices",
        "1",
        "--epochs",
        str(args.epochs),
        "--samples-per-device",
        str(args.samples),
        "--batch-size",
        str(args.batch_size),
        "--split-point",
        str(args.split_point),
        "--parallel-batches",
        str(args.parallel_batches),
        "--network",
        args.network,
        "--device-slowdown",
        str(args.device_slowdown),
        "--seed",
        "0",
        "--out-dir",
        out_dir,
        "--join-timeout",
        "120",
    ]
    server = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, env={**os.environ, "AIOPIPE_TOKEN": token}
    )
    assert server.stdout is not None
    lines: list[str] = []
    url = ""
    while not url:
        raw = await server.stdout.readline()
        if not raw:
            raise SystemExit(f"server exited early with code {await server.wait()}")
        line = raw.decode().rstrip()
        lines.append(line)
        if "waiting for" in line:
            url = line.rsplit(" ", 1)[-1]

    async def drain() -> list[str]:
        assert server.stdout is not None
        async for raw in server.stdout:
            lines.append(raw.decode().rstrip())
        return lines

    return server, url, asyncio.create_task(drain())


def inline_work(args: argparse.Namespace, iterations: int) -> Callable[[], Awaitable[int]]:
    """A coroutine factory doing ``iterations`` iterations of device-half work on the loop."""
    dataset = datasets.open_dataset("synthetic-cifar10", split="train", size=args.samples, seed=0)
    torch.manual_seed(0)
    whole = models.build("vgg5", num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    split_point = models.unit_count(whole) if args.mode == "fl" else args.split_point
    half = models.split(whole, split_point)[0]
    optimizer = torch.optim.SGD(half.parameters(), lr=0.01, momentum=0.9)
    n = args.parallel_batches if args.mode == "pipar" else 1
    micro = args.batch_size // n
    order = np.random.default_rng(0).permutation(args.samples)
    # warm up outside the measurement, as the real device's set-up phase does
    out = half(dataset.batch(order[:micro])[0])
    torch.autograd.backward(out, torch.ones_like(out))
    optimizer.zero_grad(set_to_none=True)

    async def work() -> int:
        for it in range(iterations):
            base = (it * micro * n) % max(1, args.samples - micro * n + 1)
            outputs = []
            for k in range(n):
                x, y = dataset.batch(order[base + k * micro : base + (k + 1) * micro])
                out = half(x)
                if args.mode == "fl":
                    out = torch.nn.functional.cross_entropy(out, y)
                outputs.append(out)
                await asyncio.sleep(0)
            for out in outputs:
                torch.autograd.backward(out, None if out.ndim == 0 else torch.randn_like(out))
                await asyncio.sleep(0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            await asyncio.sleep(0)
        return iterations

    return work


def overlaps(t0: float, lag_ms: float, busy: list[tuple[float, float]]) -> bool:
    """Whether the sleep that began at ``t0`` overlapped a compute-thread interval.

    ``busy`` is sorted and its intervals do not overlap (the compute thread is serial), so
    only the last interval starting before the wake-up can reach back past ``t0``.
    """
    t1 = t0 + PROBE_S + lag_ms / 1e3
    i = bisect.bisect_left(busy, (t1,)) - 1
    return i >= 0 and busy[i][1] > t0


def row(name: str, samples: Samples, span_s: float, what: str) -> str:
    """One table row: p50, p99, max lag, wake-ups, seconds covered."""
    lags = np.asarray([lag for _, lag in samples]) if samples else np.zeros(1)
    return (
        f"{name:<16} {np.percentile(lags, 50):>7.2f} {np.percentile(lags, 99):>7.2f} "
        f"{lags.max():>7.2f} {len(samples):>8d} {span_s:>7.1f}  {what}"
    )


def worst(samples: Samples, origin: float) -> str:
    """The ``TOP`` worst wake-ups, in time order, as "lag ms @ s since origin"."""
    picked = sorted(samples, key=lambda s: s[1], reverse=True)[:TOP]
    return "; ".join(f"{lag:.1f} ms @ {t - origin:.2f} s" for t, lag in sorted(picked))


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(
        f"loop_lag: {args.mode} vgg5 synthetic-cifar10, 1 device x {args.samples} samples, "
        f"{args.epochs} epoch(s), B={args.batch_size} P={args.split_point} "
        f"N={args.parallel_batches}, network {args.network}, slowdown {args.device_slowdown}; "
        f"event loop: {loop_name}; probe: sleep {PROBE_S * 1e3:g} ms",
        flush=True,
    )
    started = time.perf_counter()

    idle, i0, i1, _ = await measure(lambda: asyncio.sleep(args.idle_s))

    token = secrets.token_urlsafe(16)
    clock = WatchClock()
    ends: list[float] = []  # when Device.run returned (the server's Bye)
    with tempfile.TemporaryDirectory(prefix="aiopipe-lag-") as out_dir:
        server, url, drained = await start_server(args, out_dir, token)
        try:

            async def device_run() -> DeviceSummary:
                async with aiopipe.Device(url, 0, token=token, clock=clock) as device:
                    summary = await device.run()
                    ends.append(time.perf_counter())
                    return summary

            dev, d0, d1, summary = await measure(device_run)
            code = await asyncio.wait_for(server.wait(), 60)
            lines = await drained
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    if code != 0:
        raise SystemExit(f"server exited with code {code}:\n" + "\n".join(lines))
    per_iteration = (
        (args.batch_size // args.parallel_batches) * args.parallel_batches
        if args.mode == "pipar"
        else args.batch_size
    )
    iterations = summary.samples // per_iteration
    set_up_end = clock.busy[0][1] if clock.busy else d0
    set_up = [s for s in dev if s[0] < set_up_end]
    bye = ends[0] if ends else d1
    training = [s for s in dev if set_up_end <= s[0] < bye]
    closing = [s for s in dev if s[0] >= bye]
    busy = [s for s in training if overlaps(*s, clock.busy[1:])]
    busy_s = sum(b - a for a, b in clock.busy[1:])

    inline, n0, n1, done = await measure(inline_work(args, iterations))

    print(
        f"{'phase':<16} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'wake-ups':>8} {'span s':>7}"
        "  what ran"
    )
    print(row("idle", idle, i1 - i0, "nothing: the loop's timer resolution and OS noise"))
    print(
        row(
            "device",
            dev,
            d1 - d0,
            f"aiopipe.Device over ws to a server process: {summary.samples} samples, "
            f"{iterations} iterations, torch in the compute thread",
        )
    )
    print(
        row(
            "  set-up",
            set_up,
            set_up_end - d0,
            "connect, plan, first compute item (data, model, optimizer: torch imports)",
        )
    )
    print(row("  training", training, bye - set_up_end, "after set-up until the server's Bye"))
    print(
        row(
            "  training, busy",
            busy,
            busy_s,
            "wake-ups overlapping compute-thread work (span: thread busy s)",
        )
    )
    slow_close = " (waits out the close timeout: see the module docstring)" if d1 - bye > 1 else ""
    print(row("  closing", closing, d1 - bye, f"closing the websocket after Bye{slow_close}"))
    print(
        row(
            "inline",
            inline,
            n1 - n0,
            f"same device-half work called on the loop: {done} iterations",
        )
    )
    d99 = float(np.percentile([lag for _, lag in training], 99)) if training else 0.0
    i99 = float(np.percentile([lag for _, lag in inline], 99)) if inline else 0.0
    print(
        f"p99 inline / device training: {i99:.2f} / {d99:.2f} ms = {i99 / max(d99, 1e-9):.1f}x;"
        f" device training p99 {'<=' if d99 <= 10 else '>'} 10 ms target"
    )
    print(f"worst wake-ups, device (s since connect): {worst(dev, d0)}")
    print(f"worst wake-ups, inline (s since start):   {worst(inline, n0)}")
    print(
        "server epochs (time s, loss, test acc, train acc, dev busy, srv busy, up MB, down MB):",
        *(line for line in lines if line.strip()[:1].isdigit()),
        sep="\n  ",
    )
    print(f"bench took {time.perf_counter() - started:.1f} s")


def parse() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--mode", default="pipar", choices=MODES)
    parser.add_argument("--samples", type=int, default=1000, help="samples on the device")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--split-point", type=int, default=2)
    parser.add_argument("--parallel-batches", type=int, default=4)
    parser.add_argument("--network", default="lan")
    parser.add_argument("--device-slowdown", type=float, default=1.0)
    parser.add_argument("--idle-s", type=float, default=2.0, help="length of the idle phase")
    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="auto: uvloop when installed, as the aiopipe commands do",
    )
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    use_uvloop = arguments.loop == "uvloop" or (
        arguments.loop == "auto" and importlib.util.find_spec("uvloop") is not None
    )
    if use_uvloop:
        import uvloop

        uvloop.run(main(arguments))
    else:
        asyncio.run(main(arguments))
