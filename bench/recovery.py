"""Recovery time between real processes: how long a fault costs, measured.

``python -m aiopipe.server`` and three ``python -m aiopipe.device`` processes train over
real websockets on this machine (vgg5, synthetic-cifar10, 400 samples per device,
B = 20, N = 2, FedAvg every 2 iterations, so a round lasts a fraction of a second). Early
in epoch 2 device 2 suffers one fault per scenario, each in a fresh run:

- ``crash``: SIGKILL, never restarted. The kernel closes its socket, so the server sees
  the break at once; it waits ``reconnect_grace``, declares the device lost and its round
  goes on without it.
- ``restart``: SIGKILL, and a new device process started at once. The new process names
  no session, so the round it was in goes on without it when it says hello; it takes
  part again from the next round.
- ``stall``: SIGSTOP (the socket stays open, nothing moves). The server gives up on the
  connection after ``device_timeout`` of silence, then waits ``reconnect_grace``. After
  the device was declared lost it gets SIGCONT; it reconnects by itself and takes part
  again from a later round.
- ``drop``: device 2 reaches the server through a TCP proxy (tests/real_processes.py)
  that resets its connection; the process lives, reconnects with its session and goes
  on with the same round (nothing lost).

Every instant comes from the server's log lines, stamped with ``time.monotonic()`` as
they arrive here (a pipe: well under a millisecond), against the ``time.monotonic()`` at
which this script sent the signal or reset the connection. The lines: "device 2: ...;
waiting G s for it to reconnect" (the server has given up on the connection), "device 2
was lost", "round R goes on without device 2", "device 2 reconnected (resuming its
session | afresh ...)", "device 2 takes part again from round R".

Prints one figure per line and writes markdown (``--out``; default
bench/results/2026-11-21/recovery.md).

    .venv/bin/python bench/recovery.py [--repeat 3] [--device-timeout 2]
        [--reconnect-grace 1] [--heartbeat-interval 0.25] [--scenarios crash,restart,...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from real_processes import Output, Process, ProcessFleet, TcpProxy  # noqa: E402

#: FTPipeHD's recovery overhead (ftpipehd.txt, Table III): weight redistribution and
#: re-partition after a worker was killed, until training resumed.
FTPIPEHD_S = 2.24
VICTIM = 2
SCENARIOS = ("crash", "restart", "stall", "drop")


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured interval."""

    scenario: str
    name: str
    seconds: float
    expected: str


def run_config(args: argparse.Namespace) -> dict[str, float | int | str]:
    """The run every scenario trains (keys of the server's config file)."""
    return {"devices": 3, "samples_per_device": 400, "batch_size": 20, "parallel_batches": 2,
            "split_point": 2, "aggregation_every": 2, "epochs": 3, "test_samples": 100,
            "heartbeat_interval": args.heartbeat_interval,
            "device_timeout": args.device_timeout, "reconnect_grace": args.reconnect_grace}


def _since(output: Output, pattern: str, start: float, within: float) -> Awaitable[float]:
    """Seconds from ``start`` until the first server line matching ``pattern``."""

    async def wait() -> float:
        line = await output.wait_for(pattern, since=start, within=within)
        return line.at - start

    return wait()


async def _epoch_two(server: Process) -> None:
    """Return a little after epoch 2 began (mid-round: rounds last ~0.2 s)."""
    await server.output.wait_for(r"^\s+1\s", within=300)
    await asyncio.sleep(0.3)


async def crash(fleet: ProcessFleet, server: Process, devices: list[Process], proxy: TcpProxy,
                args: argparse.Namespace) -> list[Figure]:
    """SIGKILL device 2; it never comes back."""
    grace = args.reconnect_grace
    await _epoch_two(server)
    killed = time.monotonic()
    devices[VICTIM].send_signal(signal.SIGKILL)
    out = server.output
    noticed = await _since(out, rf"device {VICTIM}: .*waiting", killed, 30)
    lost = await _since(out, rf"device {VICTIM} was lost", killed, 30)
    on = await _since(out, rf"round \d+ goes on without device {VICTIM}", killed, 30)
    return [Figure("crash", "kill -> server has given up on the connection", noticed, "≈ 0"),
            Figure("crash", "kill -> device declared lost", lost, f"≈ grace ({grace:g})"),
            Figure("crash", "kill -> its round goes on without it", on,
                   f"≈ grace ({grace:g})")]


async def restart(fleet: ProcessFleet, server: Process, devices: list[Process], proxy: TcpProxy,
                  args: argparse.Namespace) -> list[Figure]:
    """SIGKILL device 2 and start a new device 2 process at once."""
    await _epoch_two(server)
    killed = time.monotonic()
    devices[VICTIM].send_signal(signal.SIGKILL)
    await devices[VICTIM].wait(30)
    devices.append(await fleet.start_device(VICTIM))
    spawned = time.monotonic() - killed
    out = server.output
    hello = await _since(out, rf"device {VICTIM} reconnected \(afresh", killed, 120)
    dropped = await _since(out, rf"round \d+ goes on without device {VICTIM}", killed, 120)
    again = await _since(out, rf"device {VICTIM} takes part again", killed, 120)
    return [Figure("restart", "kill -> new process started", spawned, "≈ 0"),
            Figure("restart", "kill -> new process said hello", hello,
                   "process start (python + torch import)"),
            Figure("restart", "kill -> its round goes on without it", dropped,
                   f"≈ grace ({args.reconnect_grace:g}), or the hello if sooner"),
            Figure("restart", "kill -> training again (next round)", again,
                   "hello + rest of the round")]


async def stall(fleet: ProcessFleet, server: Process, devices: list[Process], proxy: TcpProxy,
                args: argparse.Namespace) -> list[Figure]:
    """SIGSTOP device 2; SIGCONT once it was declared lost."""
    timeout, grace = args.device_timeout, args.reconnect_grace
    await _epoch_two(server)
    stopped = time.monotonic()
    devices[VICTIM].send_signal(signal.SIGSTOP)
    out = server.output
    try:
        gave_up = await _since(out, rf"device {VICTIM}: .*waiting", stopped, 60)
        lost = await _since(out, rf"device {VICTIM} was lost", stopped, 60)
        on = await _since(out, rf"round \d+ goes on without device {VICTIM}", stopped, 60)
    finally:
        resumed = time.monotonic()
        devices[VICTIM].send_signal(signal.SIGCONT)
    again = await _since(out, rf"device {VICTIM} takes part again", resumed, 120)
    return [Figure("stall", "SIGSTOP -> server gives up on the connection", gave_up,
                   f"≈ device_timeout ({timeout:g}) - up to one heartbeat"),
            Figure("stall", "SIGSTOP -> device declared lost", lost,
                   f"≈ device_timeout + grace ({timeout + grace:g})"),
            Figure("stall", "SIGSTOP -> its round goes on without it", on,
                   f"≈ device_timeout + grace ({timeout + grace:g})"),
            Figure("stall", "SIGCONT -> training again (later round)", again,
                   "its reconnect + rest of the round")]


async def drop(fleet: ProcessFleet, server: Process, devices: list[Process], proxy: TcpProxy,
               args: argparse.Namespace) -> list[Figure]:
    """Reset device 2's TCP connection (it goes through the proxy); the process lives."""
    await _epoch_two(server)
    dropped = time.monotonic()
    proxy.drop()
    out = server.output
    noticed = await _since(out, rf"device {VICTIM}: .*waiting", dropped, 30)
    back = await _since(out, rf"device {VICTIM} reconnected \(resuming its session\)",
                        dropped, 30)
    return [Figure("drop", "reset -> server has given up on the connection", noticed, "≈ 0"),
            Figure("drop", "reset -> training again (same round, resumed)", back,
                   "the device's reconnect: backoff <= 0.1 s + handshake")]


Scenario = Callable[[ProcessFleet, Process, list[Process], TcpProxy, argparse.Namespace],
                    Awaitable[list[Figure]]]


async def measure(name: str, args: argparse.Namespace) -> tuple[list[Figure], str]:
    """One fresh run with one fault; its figures and a check line from its metrics."""
    scenario: Scenario = {"crash": crash, "restart": restart, "stall": stall,
                          "drop": drop}[name]
    with tempfile.TemporaryDirectory() as tmp:
        async with ProcessFleet(Path(tmp), run_config(args)) as fleet:
            server = await fleet.start_server()
            async with fleet.proxy() as proxy:  # device 2's way to the server in "drop"
                devices = []
                for k in range(3):
                    via_proxy = name == "drop" and k == VICTIM
                    devices.append(await fleet.start_device(
                        k, url=fleet.proxy_url(proxy) if via_proxy else None))
                figures = await scenario(fleet, server, devices, proxy, args)
                if await server.wait(300) != 0:
                    raise RuntimeError(f"the server failed:\n{fleet.all_output()}")
                codes = [await device.wait(60) for device in devices]
            epochs = fleet.metrics()
    lost = [e["devices_lost"] for e in epochs]
    samples = [e["device_samples"] for e in epochs]
    return figures, (f"{name}: devices_lost per epoch {lost}; device_samples {samples}; "
                     f"device exit codes {codes}")


def _git() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (" (uncommitted changes)" if dirty else "")


def markdown(args: argparse.Namespace, runs: list[list[Figure]], checks: list[str],
             command: str, wall_s: float, load: tuple[float, float]) -> str:
    """The results page."""
    config = run_config(args)
    rows: dict[tuple[str, str], list[Figure]] = {}
    for figures in runs:
        for f in figures:
            rows.setdefault((f.scenario, f.name), []).append(f)
    lines = [
        f"# Recovery time between real processes — {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
        "",
        "`python -m aiopipe.server` and 3 `python -m aiopipe.device` processes over real "
        "websockets on one machine; one fault to device 2 early in epoch 2, a fresh run "
        "per scenario and repeat. Instants are the server's log lines as they arrive "
        "(stamped with `time.monotonic()` by the bench), against the instant the bench "
        "sent the signal or reset the connection.",
        "",
        "## What was run",
        "",
        f"- command: `{command}` (from the repository root)",
        "- run: " + ", ".join(f"{k} = {v}" for k, v in config.items()),
        f"- repeats per scenario: {args.repeat}; wall time of the bench: {wall_s / 60:.1f} "
        f"min; load average before {load[0]:.2f}, after {load[1]:.2f} (2 cores shared with "
        "other work: single figures are noisy)",
        f"- machine: {os.cpu_count()} cores, {platform.platform()}, python "
        f"{platform.python_version()}; aiopipe git {_git()}",
        "",
        "## Figures (seconds)",
        "",
        "| scenario | interval | median | min | max | expected |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for (scenario, name), figures in rows.items():
        values = [f.seconds for f in figures]
        lines.append(f"| {scenario} | {name} | {statistics.median(values):.3f} | "
                     f"{min(values):.3f} | {max(values):.3f} | {figures[0].expected} |")
    lines += ["", "Accounting of each run (from its metrics.jsonl):", ""]
    lines += [f"- {c}" for c in checks]
    medians = {key: statistics.median(f.seconds for f in figures)
               for key, figures in rows.items()}
    measured = [f"{label}: {medians[key]:.2f} s" for key, label in HEADLINES.items()
                if key in medians]
    lines += ["", "## Compared with FTPipeHD", "", COMPARISON.format(ftpipehd=FTPIPEHD_S),
              "Measured here (medians): " + "; ".join(measured) + ".", ""]
    return "\n".join(lines)


#: the figure of each scenario that answers "how long until the run is whole again"
HEADLINES = {
    ("crash", "kill -> its round goes on without it"): "crash (the others go on)",
    ("restart", "kill -> training again (next round)"): "crash + restart (training again)",
    ("stall", "SIGSTOP -> its round goes on without it"): "stall (the others go on)",
    ("drop", "reset -> training again (same round, resumed)"): "dropped connection "
                                                               "(training again)",
}

COMPARISON = """\
FTPipeHD reports {ftpipehd} s of recovery overhead after a worker is killed (ftpipehd.txt,
Table III): the time to redistribute weights and re-partition the pipeline before
training resumes; it does not say how long detecting the failure took. aiopipe has no
re-partition or weight redistribution to do (the server holds every device's server half
and the global model; a lost device's round is simply left out of FedAvg), so its
recovery time is the detection and grace policy, set by two knobs:

- a crash without a restart costs the others `reconnect_grace` (the break is seen at once
  because the kernel closes the dead process's socket); here that is the figure to set
  against FTPipeHD's {ftpipehd} s, and it is a setting, not work: a smaller grace recovers
  faster but gives a flaky link less time to come back;
- a silent device (stalled process, or a network that drops everything) costs
  `device_timeout` + `reconnect_grace`; `device_timeout` must exceed a frame's time on
  the slowest link, so in real deployments this is the longest of the figures;
- a device that crashes and is restarted at once is training again after its process
  start (python and torch imports: seconds on this loaded 2-core machine) plus the rest
  of the round; the others wait for it at most `reconnect_grace` (its hello, if sooner,
  ends its old round at once);
- a dropped connection whose process lives costs about the device's reconnect (backoff
  of at most 0.1 s plus a websocket handshake), and nothing is lost: the round resumes.
  (The backoff's jitter comes from `random.Random(device_id)`: device 2 waits 0.096 s
  every time.)

The settings here (grace 1 s, device_timeout 2 s) suit a quick bench over loopback, where
a frame takes milliseconds. With the defaults (reconnect_grace 10 s, device_timeout 60 s)
a crash costs the others about 10 s and a stall about 70 s. FTPipeHD's figure comes from
edge hardware (a MacBook, a desktop PC) over a real network; these figures come from one
machine over loopback: the comparison is of mechanisms, not of hardware.
"""


async def main_async(args: argparse.Namespace) -> None:
    """Run every scenario ``--repeat`` times; print the figures; write the page."""
    command = " ".join([".venv/bin/python bench/recovery.py", *sys.argv[1:]])
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    runs: list[list[Figure]] = []
    checks: list[str] = []
    for repeat in range(args.repeat):
        for name in args.scenarios:
            figures, check = await measure(name, args)
            runs.append(figures)
            checks.append(f"repeat {repeat + 1}, {check}")
            for f in figures:
                print(f"{f.scenario}: {f.name}: {f.seconds:.3f} s (expected {f.expected})",
                      flush=True)
    print(f"FTPipeHD recovery overhead (Table III): {FTPIPEHD_S} s")
    page = markdown(args, runs, checks, command, time.monotonic() - started,
                    (load_before, os.getloadavg()[0]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out}")


def main() -> None:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--device-timeout", type=float, default=2.0)
    parser.add_argument("--reconnect-grace", type=float, default=1.0)
    parser.add_argument("--heartbeat-interval", type=float, default=0.25)
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "2026-11-21" / "recovery.md")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
