"""What judging peers' tensors costs and how far honest runs stay from its limit (issue
41, item 3; [Note: judging arrivals] in aiopipe/runtime/judge.py).

For each mode whose devices send each other tensors (pipeline, ftpipehd, asteroid,
hadfl), honest runs of vgg5 (4 devices, unshaped memory links, real compute on the
system clock, so that compute is the busiest resource and the checks' share is as large
as it gets), side by side in one process, interleaved: the arrival judge on (as every
run has it) and off (its methods replaced by no-ops). Printed per mode:

- the epoch time, min and median over the runs, on and off, and their ratio;
- the CPU seconds spent inside the judge over the CPU seconds of the whole process
  (``time.thread_time`` around each call, ``time.process_time`` around the run): its
  share of the work, measured directly (the side-by-side ratio moves with the
  machine's load, and wall time inside a call counts the compute threads' turns);
- the largest ratio of an accepted tensor's scale to its reference (the limit refuses
  above 1000): how far honest training stays from a refusal.

    .venv/bin/python bench/arrival_checks.py [--runs 2] [--epochs 2] [--samples 400]

Emulation, said plainly: four devices and the server share this machine's cores, so an
epoch here is the sum of everyone's compute, not a fleet's; the judge's share of it is
what the measurement means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiopipe import RunConfig, simulate
from aiopipe.runtime import judge as judge_module
from aiopipe.runtime.judge import ArrivalJudge

MODES: dict[str, dict[str, Any]] = {
    "pipeline": {"parallel_batches": 2},
    "ftpipehd": {"parallel_batches": 2},
    "asteroid": {},
    "hadfl": {"options": {"warmup_epochs": 0, "local_steps": 2}},
}
JUDGING = ("judge", "judge_data", "judge_tensors", "judge_against")


class Tally:
    """Seconds inside the judge's public methods and the largest accepted ratio."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.largest_ratio = 0.0


@contextlib.contextmanager
def instrumented(tally: Tally, *, on: bool) -> Iterator[None]:
    """The judge timed (on) or replaced by no-ops (off), for the ``with`` block."""
    saved = {name: getattr(ArrivalJudge, name) for name in (*JUDGING, "_within")}

    depth = [0]  # judge_data calls judge: count the outermost call only

    def timed(method: Callable[..., None]) -> Callable[..., None]:
        def run(self: ArrivalJudge, *args: Any, **kwargs: Any) -> None:
            depth[0] += 1
            start = time.thread_time()
            try:
                method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    tally.seconds += time.thread_time() - start
                    tally.calls += 1
        return run

    def within(self: ArrivalJudge, sender: str, what: str, scale: float,
               reference: float | None, against: str) -> None:
        saved["_within"](self, sender, what, scale, reference, against)
        if reference:
            tally.largest_ratio = max(tally.largest_ratio, scale / reference)

    try:
        for name in JUDGING:
            setattr(ArrivalJudge, name, timed(saved[name]) if on else
                    (lambda self, *args, **kwargs: None))
        ArrivalJudge._within = within  # type: ignore[method-assign]
        yield
    finally:
        for name, method in saved.items():
            setattr(ArrivalJudge, name, method)


async def one_run(config: RunConfig, *, on: bool) -> tuple[float, float, Tally]:
    """(median epoch seconds, the process's CPU seconds, the judge's tally) of one honest
    run."""
    tally = Tally()
    with instrumented(tally, on=on):
        start = time.process_time()
        result = await simulate(config)
        cpu = time.process_time() - start
    return statistics.median(e.time_s for e in result.epochs), cpu, tally


def main() -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}; limit {judge_module.DEFAULT_SCALE_LIMIT:g}")
    print("| mode | epoch s on (min / median) | epoch s off (min / median) | on ÷ off "
          "(medians) | judge CPU ÷ process CPU | judge calls | largest honest ratio |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        config = RunConfig(mode=mode, model="vgg5", devices=4,
                           samples_per_device=args.samples, batch_size=20,
                           epochs=args.epochs, test_samples=200, network="lan",
                           **MODES[mode])
        times: dict[bool, list[float]] = {True: [], False: []}
        shares, calls, ratio = [], 0, 0.0
        for _ in range(args.runs):
            for on in (True, False):
                epoch, cpu, tally = asyncio.run(one_run(config, on=on))
                times[on].append(epoch)
                if on:
                    shares.append(tally.seconds / cpu)
                    calls = tally.calls
                    ratio = max(ratio, tally.largest_ratio)
        on_s, off_s = times[True], times[False]
        print(f"| {mode} | {min(on_s):.2f} / {statistics.median(on_s):.2f} | "
              f"{min(off_s):.2f} / {statistics.median(off_s):.2f} | "
              f"{statistics.median(on_s) / statistics.median(off_s):.3f} | "
              f"{100 * max(shares):.2f}% | {calls} | {ratio:.1f} |")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
