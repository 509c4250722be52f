"""FTPipeHD's recovery between real processes (paper §IV-E): what a fault costs in time
and in accuracy, and the pipeline's throughput around it (like the paper's Fig. 5).

``python -m aiopipe.server`` and four ``python -m aiopipe.device --listen`` processes
train FTPipeHD's asynchronous pipeline over real websockets, device to device, on this
machine. Each scenario is a fresh run; in epoch 2 (early, mid-round) the bench:

- ``none``: does nothing (the undisturbed run every other is compared with);
- ``worker``: SIGKILLs device 2 (a middle stage);
- ``last``: SIGKILLs device 3 (the last stage: the one computing the loss);
- ``two``: SIGKILLs devices 1 and 2 at once;
- ``restart``: SIGKILLs device 2 and starts a new device 2 process at once.

Per scenario it reports:
- the final test accuracy, and its difference from ``none``'s (the paper: within 2
  points);
- the split of the time from the fault to training resumed. The *timer*: from the kill
  to the server giving the device up (the neighbours say at once that their round
  stopped, but the coordinator waits until no device is between connections). A killed
  process's socket closes at once, so this is ``reconnect_grace``; the paper's central
  node waits for a gradient's timer. The *recovery*: from then until device 0 computes
  the first forward of the replayed round (re-partition, `RoundStart`s, weights to every
  stage, relinking). The paper reports 2.24 s for its recovery.
- the batches played again: from the latest chain replica every stage's state survived
  in (``--chain-replication-every``) to the round's end, or the whole round under way
  when none did (the work lost is what its first attempt had done of them; an abandoned
  attempt reports no trace);
- the throughput over time: batches per second through the pipeline (device 0's
  backward passes, from ``trace.json``), plotted around the fault (``--out``).

The kill instant is the bench's ``time.monotonic()`` when it sent the signal; the
server's log lines are stamped as they arrive (a pipe: well under a millisecond); the
trace's instants are the server's clock (the same monotonic clock: one machine).

What it does not show: devices here are processes sharing 2 cores, so a stage's compute
is not a device's; the links are loopback (unshaped), so moving weights costs what it
costs on this machine, not on Wi-Fi.

    .venv/bin/python bench/ftpipehd_faults.py [--scenarios none worker last two restart]
        [--samples 2400] [--epochs 4] [--global-replication-every 30]
        [--chain-replication-every 50] [--out bench/results/DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from real_processes import Process, ProcessFleet  # noqa: E402

#: FTPipeHD's recovery overhead (ftpipehd.txt, Table III): until training resumed.
PAPER_RECOVERY_S = 2.24
KILLED = {"none": (), "worker": (2,), "last": (3,), "two": (1, 2), "restart": (2,)}


@dataclass(slots=True)
class Outcome:
    """What one scenario's run measured."""

    scenario: str
    accuracy: float
    epoch_times: list[float]
    samples: list[int]
    timer_s: float = float("nan")
    recovery_s: float = float("nan")
    lost_batches: int = 0
    workers: list[int] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)
    #: (seconds since the kill, batches per second) for the plot
    throughput: list[tuple[float, float]] = field(default_factory=list)
    kill_in_trace: float = float("nan")


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run every scenario trains (keys of the server's config file)."""
    return {"mode": "ftpipehd", "devices": 4, "model": args.model,
            "samples_per_device": args.samples, "batch_size": args.batch_size,
            "epochs": args.epochs, "momentum": 0.5, "learning_rate": 0.02,
            "global_replication_every": args.global_replication_every,
            "chain_replication_every": args.chain_replication_every, "test_samples": 1000,
            "heartbeat_interval": 0.5, "device_timeout": 5.0,
            "reconnect_grace": args.reconnect_grace}


async def run(scenario: str, args: argparse.Namespace) -> Outcome:
    """One fresh run of ``scenario`` (module docstring)."""
    killed = KILLED[scenario]
    with tempfile.TemporaryDirectory() as tmp:
        async with ProcessFleet(Path(tmp), run_config(args)) as fleet:
            server = await fleet.start_server()
            devices: list[Process] = [await fleet.start_device(k, "--listen", "127.0.0.1:0")
                                      for k in range(4)]
            await server.output.wait_for(r"^\s+1\s", within=600)  # epoch 2 has begun
            await asyncio.sleep(args.into_epoch)
            kill_at = time.monotonic()
            for k in killed:
                devices[k].send_signal(signal.SIGKILL)
            for k in killed:
                await devices[k].wait(30)
            left = [d for k, d in enumerate(devices) if k not in killed]
            if scenario == "restart":
                left += [await fleet.start_device(k, "--listen", "127.0.0.1:0")
                         for k in killed]
            given_up_at = None
            for k in killed:
                # given up, or replaced by its restarted process
                line = await server.output.wait_for(rf"device {k} (was lost|reconnected)",
                                                    since=kill_at, within=120)
                given_up_at = line.at
            await fleet.finish(server, left, within=1200)
            epochs = fleet.metrics()
            if args.verbose:
                print(server.output.text())
            trace = json.loads((fleet.out_dir / "trace.json").read_text())
    return _outcome(scenario, epochs, trace, kill_at, given_up_at, args)


def _outcome(scenario: str, epochs: list[dict[str, Any]], trace: dict[str, Any],
             kill_at: float, given_up_at: float | None, args: argparse.Namespace) -> Outcome:
    outcome = Outcome(scenario, float(epochs[-1]["accuracy"]),
                      [float(e["time_s"]) for e in epochs], [int(e["samples"]) for e in epochs])
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    slices = [(names[e["tid"]], e["cat"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
               e["args"]) for e in trace["traceEvents"] if e.get("ph") == "X"]
    stage0 = sorted((s for s in slices if s[0] == "device0/compute"), key=lambda s: s[2])
    recoveries = [c for e in epochs for c in e["changes"] if "stopped" in c]
    # given up, or replaced by its restarted process within the grace
    lost = [s for s in slices if s[0].endswith("/connection")
            and s[1] in ("lost", "reconnected")]
    if given_up_at is not None and recoveries and lost:
        # the trace's frame: a killed process's socket closes at once, so its connection
        # broke (the "lost" slice's start) at the kill; given up at the slice's end
        outcome.kill_in_trace = min(s[2] for s in lost)
        given_up = max(s[3] for s in lost)
        outcome.timer_s = given_up_at - kill_at  # (the bench's clock: the log line)
        resumed = min(s[2] for s in stage0 if s[1] == "f"
                      and s[2] >= recoveries[-1]["resumed_s"])
        outcome.recovery_s = resumed - given_up
        outcome.workers, outcome.cuts = recoveries[-1]["workers"], recoveries[-1]["after"]
        # the round under way was played again: at most its batches' work was lost (an
        # abandoned attempt reports no trace, so what it had done is not known here)
        outcome.lost_batches = sum(b - a for r in recoveries for a, b in [r["batches"]])
    zero = (outcome.kill_in_trace if given_up_at is not None
            else _epoch_two_start(epochs, args.into_epoch))
    ends = [s[3] - zero for s in stage0 if s[1] == "b"]
    width = args.bin
    lo, hi = -args.window[0], args.window[1]
    for i in range(int((hi - lo) / width)):
        a = lo + i * width
        outcome.throughput.append((a + width / 2,
                                   sum(1 for t in ends if a <= t < a + width) / width))
    return outcome


def _epoch_two_start(epochs: list[dict[str, Any]], into: float) -> float:
    """Where the kill would have been (the trace counts from training's start)."""
    return float(epochs[0]["time_s"]) + into


def markdown(outcomes: list[Outcome], args: argparse.Namespace, command: str, wall_s: float,
             load: tuple[float, float]) -> str:
    """The results page."""
    base = next((o for o in outcomes if o.scenario == "none"), None)
    lines = [
        f"# FTPipeHD faults between real processes — {time.strftime('%Y-%m-%d %H:%M %z')}",
        "",
        "`python -m aiopipe.server` and 4 `python -m aiopipe.device --listen` processes "
        "over real websockets on one 2-core machine, linked device to device; one fresh "
        "run per scenario, the fault early in epoch 2 (bench/ftpipehd_faults.py's "
        "docstring has the method).",
        "",
        f"- command: `{command}`",
        "- run: " + ", ".join(f"{k} = {v}" for k, v in run_config(args).items()),
        f"- wall time {wall_s / 60:.1f} min; load average before {load[0]:.2f}, after "
        f"{load[1]:.2f}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores",
        "",
        "| scenario | final accuracy | vs none | timer (kill → given up) | recovery "
        "(→ first forward of the replay) | batches replayed | workers after | cuts after "
        "| epoch times (s) | samples per epoch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        delta = f"{(o.accuracy - base.accuracy) * 100:+.1f} pt" if base else "–"
        lines.append(
            f"| {o.scenario} | {o.accuracy:.3f} | {delta} | {_s(o.timer_s)} | "
            f"{_s(o.recovery_s)} | {o.lost_batches if o.workers else '–'} | "
            f"{o.workers or '–'} | {o.cuts or '–'} | "
            f"{', '.join(f'{t:.1f}' for t in o.epoch_times)} | {o.samples} |")
    lines += ["", f"The paper's recovery took {PAPER_RECOVERY_S} s (Table III). Throughput "
              "around the fault: `faults.png` (batches per second through device 0 that "
              f"count, in {args.bin:g} s bins; 0 is the kill, or as far into epoch 2 for "
              "`none`; an abandoned attempt reports no trace, so its work does not show: "
              "the gap is the work lost plus the timer).", ""]
    return "\n".join(lines)


def _s(value: float) -> str:
    return "–" if value != value else f"{value:.2f} s"


def plot(outcomes: list[Outcome], path: Path) -> None:
    """Throughput around the fault, one line per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for o in outcomes:
        xs, ys = zip(*o.throughput, strict=True)
        ax.plot(xs, ys, label=o.scenario, drawstyle="steps-mid")
    ax.axvline(0, color="grey", linestyle=":", label="kill")
    ax.set_xlabel("seconds since the kill")
    ax.set_ylabel("batches / s through the pipeline")
    ax.set_title("FTPipeHD, 4 device processes: throughput around a fault")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main() -> None:
    """Run the scenarios; print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(KILLED), choices=list(KILLED))
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--samples", type=int, default=2400)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--global-replication-every", type=int, default=30)
    parser.add_argument("--chain-replication-every", type=int, default=50,
                        help="batches between chain replications (0: none)")
    parser.add_argument("--reconnect-grace", type=float, default=2.0)
    parser.add_argument("--into-epoch", type=float, default=0.5,
                        help="seconds into epoch 2 when the fault strikes")
    parser.add_argument("--bin", type=float, default=0.5)
    parser.add_argument("--window", type=float, nargs=2, default=(5.0, 15.0))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--verbose", action="store_true", help="print the server's output")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    outcomes = []
    for scenario in args.scenarios:
        outcome = await run(scenario, args)
        outcomes.append(outcome)
        print(f"{scenario:8} accuracy {outcome.accuracy:.3f}  timer {_s(outcome.timer_s)}  "
              f"recovery {_s(outcome.recovery_s)}  replayed {outcome.lost_batches}  "
              f"workers {outcome.workers}  epochs {[round(t, 1) for t in outcome.epoch_times]}",
              flush=True)
    command = "python bench/ftpipehd_faults.py " + " ".join(sys.argv[1:])
    page = markdown(outcomes, args, command, time.monotonic() - started,
                    (load_before, os.getloadavg()[0]))
    print(page)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(page)
        plot(outcomes, args.out / "faults.png")


if __name__ == "__main__":
    asyncio.run(main())
