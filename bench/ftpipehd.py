"""FTPipeHD's asynchronous pipeline side by side: against the synchronous pipeline
(learning), and its planner's partition against PipeDream's homogeneous one on a
heterogeneous fleet (throughput, ``--throughput``).

Both in virtual time over memory links (``aiopipe.simulate``), three stages of the same
model cut at the same points, the same data, epochs and learning rate: ``ftpipehd``
(asynchronous 1F1B, weight stashing, vertical sync, weight aggregation every
``version_aggregation`` x (S - p) updates) and ``pipeline`` (synchronous 1F1B, one
micro-batch per iteration, so each step uses the freshest weights), at each momentum
given. Prints per epoch the training loss and test accuracy of each.

What it shows: what staleness (batch b computes with the weights after update b - S)
costs in learning per epoch, and how momentum interacts with it.

``--throughput``: 4 stages, devices 1, 1, 1 and 10x slower (``device_slowdown``), the
model's costs measured on this machine at the start (virtual time then charges them):
the epoch time of FTPipeHD's cuts for those capacities against the homogeneous cuts
(the same planner with every capacity 1, PipeDream's assumption), and of a run that
declares every device alike and re-partitions from what its first epoch measured.
Virtual time: the figures are the cost model's (each stage's compute, the links'
shaping), not a measurement of real devices; a slowdown factor is not a slow device.
The same comparison on models cut finely enough to reach the ideal ratio, with the
factors that keep a model below it and the spread of vgg5's figure over several
measured tables: bench/ftpipehd_heterogeneity.py.

    .venv/bin/python bench/ftpipehd.py [--model vgg5] [--samples 1000] [--epochs 4]
        [--momentum 0.9 0.5 0.0] [--aggregation 1 0]
    .venv/bin/python bench/ftpipehd.py --throughput [--models vgg5 mobilenetv3-small]
        [--processes [--network wifi]]
    .venv/bin/python bench/ftpipehd.py --replication-cost 0 100 50 25 [--samples 4000]
    .venv/bin/python bench/ftpipehd.py --capacity-change 200 [--replication-every 50]
        [--samples 10000] [--out DIR]
    .venv/bin/python bench/ftpipehd.py --chain-cost 0 50 25 10 [--samples 4000]

``--processes``: the same two partitions also as ``python -m aiopipe`` with four device
processes over real websockets (links paced to ``--network``; the slowdown makes a
device wait on the clock for 9x its compute, so the four processes on 2 cores do not
slow each other by it): the last epoch's time of each.

``--replication-cost EVERY...``: one epoch with a global replication every EVERY batches
(0: one an epoch), on lan and wifi links (virtual time): the epoch's time (the flush's
fill and drain, and moving the weights and momentum both ways) and the bytes the
coordinator moved.

``--chain-cost EVERY...``: one epoch with a chain replication every EVERY batches (0:
none) and the default global replication (every 100), on lan and wifi links (virtual
time): the epoch's time, the bytes the replicas moved (each stage's weights, buffers
and momentum per chain point) and the seconds they held the links.

``--capacity-change BATCH``: every device declared alike, device 3 turns 10x slower at
batch BATCH; the homogeneous cuts kept against FTPipeHD's re-partitioning at every
global replication (virtual time): batches per second over windows of the replication
interval, and a plot (``--out``) like the paper's Fig. 6.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.api import _measure
from aiopipe.models import unit_count
from aiopipe.runtime.plan import build_model
from aiopipe.runtime.systems.ftpipehd.coordinator import Planner


async def _run(config: RunConfig) -> tuple[list[float], list[float]]:
    units = unit_count(build_model(config, num_classes=10, in_shape=(3, 32, 32)))
    costs = CostTable.uniform(units, forward=0.001, backward=0.002)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    return [e.loss for e in result.epochs], [e.accuracy for e in result.epochs]


def _between_processes(config: RunConfig, network: str) -> float:
    """The last epoch's time of ``config`` as ``python -m aiopipe`` with four device
    processes (links shaped to ``network``)."""
    assert isinstance(config.options.partition, tuple)
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "aiopipe", "--mode", "ftpipehd", "--devices", "4",
            "--model", str(config.model), "--samples-per-device",
            str(config.samples_per_device), "--batch-size", str(config.batch_size),
            "--epochs", str(config.epochs), "--momentum", str(config.momentum),
            "--learning-rate", str(config.learning_rate), "--network", network,
            "--device-slowdown", ",".join(f"{config.device_slowdown_of(k):g}" for k in range(4)),
            "--partition", ",".join(map(str, config.options.partition)), "--out-dir", f"{tmp}/run"]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
        lines = Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()
    return float(json.loads(lines[-1])["time_s"])


async def throughput(model: str, samples: int, batch: int, *, processes: bool = False,
                     network: str = "wifi") -> None:
    """Epoch times of the partitions on a 1, 1, 1, 10x fleet (module docstring)."""
    slow = (1.0, 1.0, 1.0, 10.0)
    base = RunConfig(mode="ftpipehd", model=model, devices=4, samples_per_device=samples,
                     batch_size=batch, epochs=2, test_samples=100, seed=3, momentum=0.5,
                     learning_rate=0.02, device_slowdown=slow,
                     network=network if processes else "lan")
    costs = _measure(base, None)
    planner = Planner.of(base, costs, build_model(base, num_classes=10,
                                                   in_shape=(3, 32, 32)), (3, 32, 32), batch)
    homogeneous = planner.cuts([1.0] * 4, range(4))
    dynamic = planner.cuts(list(slow), range(4))
    rows = []
    for name, config in (
            ("homogeneous (PipeDream)", base.replace(options={"partition": homogeneous.cuts})),
            ("FTPipeHD, declared", base.replace(options={"partition": dynamic.cuts})),
    ):
        result = await simulate(config, clock=VirtualClock(), cost_table=costs)
        rows.append((name, config.options.partition, result.epochs[-1].time_s))
    # declared alike, really 1, 1, 1, 10: the first epoch measures, the second re-plans
    from aiopipe.runtime import device_node as device_module

    honest = device_module.DeviceNode._run_config

    def really_slow(self: Any, plan: Any) -> RunConfig:
        return honest(self, plan).replace(device_slowdown=slow)

    device_module.DeviceNode._run_config = really_slow  # type: ignore[method-assign]
    try:
        measured = await simulate(base.replace(device_slowdown=1.0, options={"partition": "auto"}),
                                  clock=VirtualClock(), cost_table=costs)
    finally:
        device_module.DeviceNode._run_config = honest  # type: ignore[method-assign]
    first, second = measured.epochs
    if processes:
        for name, config in (
                ("processes, homogeneous", base.replace(options={"partition": homogeneous.cuts})),
                ("processes, FTPipeHD", base.replace(options={"partition": dynamic.cuts})),
        ):
            rows.append((name, config.options.partition, _between_processes(config, network)))
    estimate = planner.time(homogeneous.cuts, slow, range(4))
    print(f"{model}: 4 stages, devices 1, 1, 1, 10x; {samples} samples, B = {batch}; "
          f"estimated batch time homogeneous {estimate:.4f} s, "
          f"FTPipeHD {dynamic.time_s:.4f} s")
    for i, (name, cuts, seconds) in enumerate(rows):
        reference = rows[2 if i >= 2 else 0][2]  # processes against processes
        print(f"  {name:<26} cuts {cuts!s:<14} epoch {seconds:8.3f} s  "
              f"x{reference / seconds:.2f}")
    print(f"  {'measured, re-partitioned':<26} epoch 1 {first.time_s:.3f} s -> epoch 2 "
          f"{second.time_s:.3f} s (cuts {[p['units'] for p in second.plan]})")


async def capacity_change(model: str, samples: int, batch: int, every: int, at: int,
                          out: Path | None) -> None:
    """Four devices declared alike; from batch ``at`` on, device 3 computes 10x slower.
    The homogeneous cuts kept (no re-partitioning) against "auto" cuts, re-planned at
    every global replication (every ``every`` batches) from what each round measured:
    throughput over time, in virtual time (module docstring's caveat)."""
    from aiopipe.runtime.device_half import DeviceHalf

    base = RunConfig(mode="ftpipehd", model=model, devices=4, samples_per_device=samples,
                     batch_size=batch, epochs=1, test_samples=100, seed=3, momentum=0.5,
                     learning_rate=0.02, options={"global_replication_every": every})
    costs = _measure(base, None)
    planner = Planner.of(base, costs, build_model(base, num_classes=10,
                                                   in_shape=(3, 32, 32)), (3, 32, 32), batch)
    homogeneous = planner.cuts([1.0] * 4, range(4)).cuts
    honest = DeviceHalf.run_round

    async def slow_from_batch(self: Any, message: Any) -> int:
        if self.node.device_id == 3:
            self.node.compute.slowdown = 10.0 if message.first_iteration >= at else 1.0
        return await honest(self, message)

    curves = {}
    DeviceHalf.run_round = slow_from_batch  # type: ignore[method-assign]
    try:
        for name, config in (("homogeneous cuts kept",
                              base.replace(options={"partition": homogeneous})),
                             ("FTPipeHD re-partitioning", base)):
            result = await simulate(config, clock=VirtualClock(), cost_table=costs)
            ends = sorted(t.end - result.trace_origin for t in result.trace
                          if t.track == "device0/compute" and t.name == "b")
            # batches per second over each window of `every` batches, and when it ended
            curve = [(ends[i + every - 1], every / (ends[i + every - 1] - ends[i]))
                     for i in range(0, len(ends) - every + 1, every // 2)]
            changes = [(c["round"], c.get("after")) for c in result.epochs[0].changes]
            curves[name] = (curve, changes, result.epochs[0].time_s)
    finally:
        DeviceHalf.run_round = honest  # type: ignore[method-assign]
    print(f"{model}: 4 devices declared alike, device 3 10x slower from batch {at}; "
          f"{samples // batch} batches, global replication every {every}")
    for name, (curve, changes, seconds) in curves.items():
        rates = ", ".join(f"{r:.0f}" for _, r in curve)
        print(f"  {name:<26} epoch {seconds:7.2f} s; re-partitions {changes}\n"
              f"    batches/s per {every}-batch window: {rates}")
    if out is not None:
        _plot({name: c[0] for name, c in curves.items()}, f"batches / s (over {every} batches)",
              f"{model}: device 3 10x slower from batch {at}",
              out / f"capacity-change-{model}.png")


def _plot(curves: dict[str, list[tuple[float, float]]], ylabel: str, title: str,
          path: Path, xlabel: str = "virtual seconds") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, curve in curves.items():
        ax.plot(*zip(*curve, strict=True), marker=".", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


async def replication_cost(model: str, samples: int, batch: int,
                           intervals: list[int]) -> None:
    """What global replication costs: the same epoch with a round every ``intervals``
    batches (0: one round), in virtual time on lan links (unshaped: the bytes cost no
    wire time) and on wifi: epoch time and bytes the coordinator moved."""
    base = RunConfig(mode="ftpipehd", model=model, devices=4, samples_per_device=samples,
                     batch_size=batch, epochs=1, test_samples=100, seed=3, momentum=0.5,
                     learning_rate=0.02)
    costs = _measure(base, None)
    model_bytes = sum(p.numel() * p.element_size() for p in build_model(
        base, num_classes=10, in_shape=(3, 32, 32)).parameters())
    print(f"{model}: 4 stages, {samples // batch} batches; parameters {model_bytes / 1e6:.2f}"
          " MB (a replication moves them and their momentum down and back up)")
    for network in ("lan", "wifi"):
        rows = []
        for every in intervals:
            config = base.replace(network=network,
                                  options={"global_replication_every": every})
            epoch = (await simulate(config, clock=VirtualClock(), cost_table=costs)).epochs[0]
            rows.append((every, epoch.time_s, epoch.bytes_up + epoch.bytes_down))
        reference = next(t for e, t, _ in rows if e == 0) if 0 in intervals else rows[0][1]
        for every, seconds, moved in rows:
            print(f"  {network:<5} every {every or 'epoch':>5}: epoch {seconds:7.3f} s "
                  f"(+{(seconds / reference - 1) * 100:5.1f}%), coordinator moved "
                  f"{moved / 1e6:7.2f} MB")


async def chain_cost(model: str, samples: int, batch: int, intervals: list[int]) -> None:
    """What chain replication costs: the same epoch with a chain replication every
    ``intervals`` batches (0: none), in virtual time on lan and wifi links: epoch time,
    the replicas' bytes and their seconds on the links (trace slices named "replica")."""
    base = RunConfig(mode="ftpipehd", model=model, devices=4, samples_per_device=samples,
                     batch_size=batch, epochs=1, test_samples=100, seed=3, momentum=0.5,
                     learning_rate=0.02)
    costs = _measure(base, None)
    whole = build_model(base, num_classes=10, in_shape=(3, 32, 32))
    replica_bytes = (sum(t.numel() * t.element_size() for t in whole.state_dict().values())
                     + sum(p.numel() * p.element_size() for p in whole.parameters()))
    batches = samples // batch
    print(f"{model}: 4 stages, {batches} batches, global replication every 100; a chain "
          f"point moves every stage's state and momentum: {replica_bytes / 1e6:.2f} MB")
    for network in ("lan", "wifi"):
        rows = []
        for every in intervals:
            config = base.replace(network=network,
                                  options={"chain_replication_every": every})
            result = await simulate(config, clock=VirtualClock(), cost_table=costs)
            wire = sum(s.duration for s in result.trace if s.name == "replica")
            points = sum(len(range(every, min(100, batches - r), every)) if every else 0
                         for r in range(0, batches, 100))
            rows.append((every, result.epochs[0].time_s, points * replica_bytes, wire))
        reference = rows[0][1]
        for every, seconds, moved, wire in rows:
            print(f"  {network:<5} every {every or 'never':>5}: epoch {seconds:7.3f} s "
                  f"(+{(seconds / reference - 1) * 100:5.1f}%), replicas {moved / 1e6:7.2f} MB "
                  f"({moved / batches / 1e3:7.1f} kB a batch), on the links "
                  f"{wire:6.3f} s ({wire / batches * 1e3:6.2f} ms a batch)")


async def main() -> None:
    """Run every variant and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, nargs="+", default=[0.9, 0.5, 0.0])
    parser.add_argument("--aggregation", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--throughput", action="store_true",
                        help="the heterogeneous-fleet comparison instead")
    parser.add_argument("--models", nargs="+", default=["vgg5", "mobilenetv3-small"])
    parser.add_argument("--processes", action="store_true",
                        help="with --throughput: also between real processes")
    parser.add_argument("--network", default="wifi",
                        help="with --processes: the links' preset (shaped)")
    parser.add_argument("--capacity-change", type=int, metavar="BATCH",
                        help="device 3 turns 10x slower at this batch (see the docstring)")
    parser.add_argument("--replication-every", type=int, default=50)
    parser.add_argument("--out", type=Path, help="where --capacity-change draws its plot")
    parser.add_argument("--replication-cost", type=int, nargs="+", metavar="EVERY",
                        help="epoch time and bytes with a global replication every "
                             "EVERY batches (0: one an epoch)")
    parser.add_argument("--chain-cost", type=int, nargs="+", metavar="EVERY",
                        help="epoch time, bytes and link time with a chain replication "
                             "every EVERY batches (0: none)")
    args = parser.parse_args()
    if args.chain_cost:
        for model in args.models:
            await chain_cost(model, args.samples, args.batch_size, args.chain_cost)
        return
    if args.replication_cost:
        for model in args.models:
            await replication_cost(model, args.samples, args.batch_size,
                                   args.replication_cost)
        return
    if args.capacity_change is not None:
        for model in args.models:
            await capacity_change(model, args.samples, args.batch_size,
                                  args.replication_every, args.capacity_change, args.out)
        return
    if args.throughput:
        for model in args.models:
            await throughput(model, args.samples // 5, args.batch_size,
                             processes=args.processes, network=args.network)
        return
    base = RunConfig(model=args.model, devices=3, samples_per_device=args.samples,
                     batch_size=args.batch_size, epochs=args.epochs,
                     test_samples=500, seed=3, learning_rate=args.learning_rate,
                     mode="pipeline", parallel_batches=1, options={"partition": (1, 3)})
    print(f"{args.model}, 3 stages cut at (1, 3), {args.samples} samples, B = "
          f"{args.batch_size}, lr {args.learning_rate}, {args.epochs} epochs; "
          "loss / test accuracy per epoch")
    for momentum in args.momentum:
        variants = [("pipeline (sync)", base.replace(momentum=momentum))]
        variants += [(f"ftpipehd agg {m}", base.replace(mode="ftpipehd", momentum=momentum,
                                                        options={"version_aggregation": m}))
                     for m in args.aggregation]
        for name, config in variants:
            started = time.monotonic()
            losses, accuracies = await _run(config)
            cells = "  ".join(f"{loss:.3f}/{acc:.3f}" for loss, acc in
                              zip(losses, accuracies, strict=True))
            print(f"momentum {momentum:<4} {name:<17} {cells}   "
                  f"({time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
