"""What the allocator's settings buy ([Note: allocator] in aiopipe/runtime/allocator.py).

Each setting runs in fresh processes, taking turns (glibc's thresholds are per process,
and with its defaults the figures move from one process to the next): glibc's defaults
(``AIOPIPE_TUNE_MALLOC=0``) and aiopipe's (`tune_malloc`, as every node sets it). Each
process times the whole model's training pass (forward, loss, backward; one torch
thread; thread CPU seconds, median of 20 after 5 untimed) of vgg5, resnet18 and
mobilenetv3-small at 2, 8 and 32 samples, with the gradients accumulating as a
pipelined iteration's micro-batches do, and one real epoch (`simulate` on the system
clock, the planner bench's setting: 2 devices slowed 4×, B = 32, 128 samples each, 4g)
of resnet18 PiPar P1 N8, whose server passes are 4 samples each; and the process's peak
resident memory over all of it.

    .venv/bin/python bench/allocator.py [--processes 3]

Prints, per figure, each setting's median over its processes, their range, and the
ratio default ÷ tuned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODELS = ("vgg5", "resnet18", "mobilenetv3-small")
SIZES = (2, 8, 32)


def measure() -> dict[str, float]:
    """This process's figures (milliseconds per pass, seconds per epoch)."""
    import torch
    from torch import nn

    from aiopipe import RunConfig, SystemClock, simulate
    from aiopipe.runtime.compute import warm_up_torch
    from aiopipe.runtime.plan import build_model, train_dataset

    warm_up_torch()  # tunes the allocator unless AIOPIPE_TUNE_MALLOC=0
    torch.set_num_threads(1)
    out: dict[str, float] = {}
    for name in MODELS:
        config = RunConfig(mode="pipar", model=name, devices=2, samples_per_device=128,
                           batch_size=32)
        data = train_dataset(config)
        model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
        for size in SIZES:
            x, y = torch.randn(size, *data.in_shape), torch.randint(10, (size,))

            def one_pass() -> None:
                nn.functional.cross_entropy(model(x), y).backward()  # noqa: B023

            for _ in range(5):
                one_pass()
            times = []
            for _ in range(20):
                start = time.thread_time()
                one_pass()
                times.append(time.thread_time() - start)
            out[f"{name} pass at {size} (ms)"] = statistics.median(times) * 1e3
            model.zero_grad(set_to_none=True)
    config = RunConfig(mode="pipar", model="resnet18", devices=2, samples_per_device=128,
                       batch_size=32, epochs=2, split_point=1, parallel_batches=8,
                       device_slowdown=4.0, test_samples=0, network="4g", torch_threads=1,
                       options={"replan": False})
    result = asyncio.run(simulate(config, clock=SystemClock(), progress=lambda m: None))
    out["resnet18 P1 N8 4g epoch (s)"] = result.epochs[-1].time_s
    out["resnet18 P1 N8 4g server busy (s)"] = result.epochs[-1].busy_s["server"]
    out["peak resident memory (MiB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    """Run the processes in turns and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--processes", type=int, default=3, help="per setting")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    settings = {"glibc default": "0", "tuned": "1"}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    print(f"# load before {os.getloadavg()[0]:.2f}", flush=True)
    for turn in range(args.processes):
        for name, flag in settings.items():
            env = {**os.environ, "AIOPIPE_TUNE_MALLOC": flag}
            done = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                                  capture_output=True, text=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"# process {turn + 1}/{args.processes}: {name} done", flush=True)
    print(f"# load after {os.getloadavg()[0]:.2f}")
    print("| figure | glibc default (median, range) | tuned (median, range) | default ÷ tuned |")
    print("|---|---|---|---|")
    for key in runs["tuned"][0]:
        cells, medians = [], []
        for name in settings:
            values = [r[key] for r in runs[name]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.3g} ({min(values):.3g}-{max(values):.3g})")
        print(f"| {key} | {cells[0]} | {cells[1]} | {medians[0] / medians[1]:.2f} |")


if __name__ == "__main__":
    main()
