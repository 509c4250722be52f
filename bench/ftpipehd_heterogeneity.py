"""FTPipeHD's partition against PipeDream's on a 1, 1, 1, 10x fleet, on models cut
finely enough for the comparison to reach its bound (issue 48), and why a model's ratio
is what it is.

Four stages, device 0 holds the data, device 3 computes 10x slower
(``device_slowdown``). PipeDream's partition is FTPipeHD's planner with every capacity
1 (the homogeneous cuts); FTPipeHD's is the planner given the capacities 1, 1, 1, 10.
Both run in virtual time on unshaped links (``lan``), the model's costs measured here
first (fresh, never read from the cost cache), the last of two epochs shown; with
``--processes`` also as ``python -m aiopipe`` with four device processes (the slow one
waits on the clock for 9x its compute).

The bound. A pipeline's time per batch is its slowest stage. With the model's time T
divisible at will, the homogeneous cuts give every device T/4, so the 10x device takes
2.5 T; balanced by capacity, each fast device takes T/3.1 and the slow one 10 x T/31:
the ideal ratio is 2.5 x 3.1 = 7.75x. A model of units falls short of it by two
factors, printed for each model:

- *the baseline's share*: the slow device's part of T under the homogeneous cuts, s; the
  ratio's bound for those cuts is 10 x s x 3.1 (above 7.75 when s > 1/4: PipeDream
  balances the maximum, not the last stage);
- *granularity*: FTPipeHD's slowest part over T/3.1 (1 when the units let it balance;
  a unit larger than T/3.1 cannot be split, and the 10x device must hold at least the
  last unit: 10 x its time may exceed T/3.1).

The ratio is then 10 x s x T / FTPipeHD's slowest part: which units make each term is
printed, so a figure that moves with the table says which unit moved. vgg5 (5 units,
``--tables``) is the case: its ratio is 10 x (FC 4096-128 + FC 128-10) over its largest
convolution, a ratio of two measured times that the host's load moves; the same cuts
are charged from several fresh tables to show the spread and its cause.

The paper's 6.8x (ftpipehd.txt §IV-D) is on its own fleet: three processes, the
slowest 10x below the best (MobileNetV2, time to convergence 396.37 min under
PipeDream's partition against 58.03 min), whose ideal is 10 / 3 x 2.1 = 7.0x;
``--slowdowns 1,1,10`` is that fleet.

``gpt-12`` is the zoo's transformer (`aiopipe.models.gpt.GPT`: width 128, 4 heads) 12
blocks deep instead of ``gpt-tiny``'s 4, traced into 15 units (embed, 12 blocks, norm,
head), on ``stdlib-text``; the image models take ``synthetic-cifar10``.

    PYTHONPATH=. .venv/bin/python bench/ftpipehd_heterogeneity.py \\
        [--models gpt-12 resnet101 mobilenetv3-small] [--samples 1000] [--batch-size 20]
        [--slowdowns 1,1,1,10] [--processes] [--network lan]
    PYTHONPATH=. .venv/bin/python bench/ftpipehd_heterogeneity.py --tables 5 [--models vgg5]

Virtual time: the figures are the cost model's (each device its own CPU), not real
devices'. Between processes on a host of fewer cores than devices, the fast stages
share the cores and a run bound by them is slower than the model says.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.data import kind_of
from aiopipe.models.gpt import GPT
from aiopipe.runtime.plan import build_model, measure_planning_costs, train_dataset
from aiopipe.runtime.systems.base import planning_batch_sizes
from aiopipe.runtime.systems.ftpipehd.coordinator import Planner

HERE = Path(__file__).resolve().parent
SLOW = (1.0, 1.0, 1.0, 10.0)
PAPER = 6.8  # FTPipeHD's best over PipeDream at 10x heterogeneity (the paper's abstract)
#: the names this bench adds to the zoo's: (the model's ``module:function``, dataset)
ALIASES = {"gpt-12": ("ftpipehd_heterogeneity:gpt12", "stdlib-text")}


def gpt12(num_classes: int, in_shape: tuple[int]) -> nn.Module:
    """The zoo's transformer 12 blocks deep (``gpt-12``, module docstring)."""
    return GPT(num_classes, in_shape[0], depth=12)


def ideal_bound(slowdowns: tuple[float, ...] = SLOW) -> float:
    """The ratio with the model divisible at will: the homogeneous cuts' slowest device
    on T / S against T over the capacities' sum (module docstring)."""
    return max(slowdowns) / len(slowdowns) * math.fsum(1 / s for s in slowdowns)


def config_of(model: str, samples: int, batch: int, slowdowns: tuple[float, ...] = SLOW,
              network: str = "lan") -> RunConfig:
    """A device per slowdown; ``samples`` on device 0."""
    name, dataset = ALIASES.get(model, (model, "synthetic-cifar10"))
    return RunConfig(mode="ftpipehd", model=name, dataset=dataset, devices=len(slowdowns),
                     samples_per_device=samples, batch_size=batch, epochs=2,
                     test_samples=100, seed=3, momentum=0.5, learning_rate=0.02,
                     device_slowdown=slowdowns, network=network)


def fresh_table(config: RunConfig) -> tuple[CostTable, Planner]:
    """The model's cost table measured now (not the cache's) and its planner."""
    dataset = train_dataset(config)
    kind = kind_of(dataset)
    model = build_model(config, num_classes=kind.classes, in_shape=kind.in_shape)
    costs = measure_planning_costs(config, model, kind.inputs, dataset,
                                   sizes=planning_batch_sizes(config))
    return costs, Planner.of(config, costs, model, kind.inputs, config.batch_size)


@dataclass(frozen=True)
class Analysis:
    """One table's comparison: the cuts, their estimated time per batch under the
    slowdowns, and the two factors (module docstring)."""

    slowdowns: tuple[float, ...]
    shares: tuple[float, ...]  # each unit's part of the model's time T
    homogeneous: tuple[int, ...]
    ftpipehd: tuple[int, ...]
    homogeneous_s: float
    ftpipehd_s: float
    slow_share: float  # the slow device's part of T under the homogeneous cuts
    slowest_share: float  # FTPipeHD's slowest part (x its slowdown) over T

    @property
    def estimated(self) -> float:
        """The planner's ratio."""
        return self.homogeneous_s / self.ftpipehd_s

    @property
    def cuts_bound(self) -> float:
        """The ratio had FTPipeHD balanced perfectly: 10 x s x 3.1."""
        return self.slowdowns[-1] * self.slow_share * self.capacity

    @property
    def capacity(self) -> float:
        """The fleet's capacity in fast devices (3.1 for 1, 1, 1, 10)."""
        return math.fsum(1 / s for s in self.slowdowns)

    @property
    def granularity(self) -> float:
        """T / 3.1 over FTPipeHD's slowest part."""
        return 1 / self.capacity / self.slowest_share


def analyse(planner: Planner, slowdowns: tuple[float, ...],
            homogeneous: tuple[int, ...] | None = None,
            ftpipehd: tuple[int, ...] | None = None) -> Analysis:
    """The comparison on ``planner``'s table, of the planner's cuts or those given.
    The slow device is the last (``slowdowns[-1]``; the others 1)."""
    workers = range(len(slowdowns))
    total = math.fsum(planner.times)
    homogeneous = homogeneous or planner.cuts([1.0] * len(slowdowns), workers).cuts
    ftpipehd = ftpipehd or planner.cuts(list(slowdowns), workers).cuts
    last = math.fsum(planner.times[homogeneous[-1]:])
    fast_s = planner.time(ftpipehd, slowdowns, workers)
    return Analysis(slowdowns, tuple(t / total for t in planner.times), homogeneous,
                    ftpipehd, planner.time(homogeneous, slowdowns, workers), fast_s,
                    last / total, fast_s / total)


def parts(shares: tuple[float, ...], cuts: tuple[int, ...]) -> str:
    """Each stage's units and their part of T, e.g. ``0-3 24.1% | 4-6 25.0% | ...``."""
    edges = [0, *cuts, len(shares)]
    return " | ".join(f"{a}-{b - 1} {math.fsum(shares[a:b]) * 100:.1f}%"
                      for a, b in itertools.pairwise(edges))


async def virtual_epoch(config: RunConfig, costs: CostTable, cuts: tuple[int, ...]) -> float:
    """The last epoch's virtual seconds with ``cuts``."""
    result = await simulate(config.replace(options={"partition": cuts}),
                            clock=VirtualClock(), cost_table=costs)
    return result.epochs[-1].time_s


def process_epoch(config: RunConfig, cuts: tuple[int, ...]) -> float:
    """The last epoch's seconds of ``config`` with ``cuts`` as ``python -m aiopipe``: a
    server and four device processes over websockets on this host."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "aiopipe", "--mode", "ftpipehd",
            "--devices", str(config.devices),
            "--model", str(config.model), "--dataset", config.dataset,
            "--samples-per-device", str(config.samples_per_device),
            "--batch-size", str(config.batch_size), "--epochs", str(config.epochs),
            "--momentum", str(config.momentum), "--learning-rate", str(config.learning_rate),
            "--test-samples", str(config.test_samples), "--network", str(config.network),
            "--device-slowdown", ",".join(f"{config.device_slowdown_of(k):g}"
                                          for k in range(config.devices)),
            "--partition", ",".join(map(str, cuts)), "--out-dir", f"{tmp}/run"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=3000,
                       env=env)
        lines = Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()
    return float(json.loads(lines[-1])["time_s"])


async def compare(model: str, samples: int, batch: int, slowdowns: tuple[float, ...], *,
                  processes: bool, network: str) -> None:
    """One model's comparison (module docstring), printed."""
    config = config_of(model, samples, batch, slowdowns, network)
    started = time.monotonic()
    costs, planner = fresh_table(config)
    a = analyse(planner, slowdowns)
    slow, capacity = f"{slowdowns[-1]:g}", f"{a.capacity:g}"
    print(f"devices {', '.join(f'{s:g}' for s in slowdowns)}: ideal ratio "
          f"{ideal_bound(slowdowns):.2f}x")
    print(f"{model}: {len(a.shares)} units, {samples // batch} batches of {batch} an epoch; "
          f"table measured in {time.monotonic() - started:.0f} s; each unit's part of T "
          f"(forward, backward, step): {' '.join(f'{s * 100:.1f}' for s in a.shares)} %")
    print(f"  homogeneous (PipeDream) cuts {a.homogeneous}: {parts(a.shares, a.homogeneous)}"
          f"\n    the {slow}x device holds s = {a.slow_share * 100:.1f}% of T: bound for "
          f"these cuts {slow} x s x {capacity} = {a.cuts_bound:.2f}x")
    print(f"  FTPipeHD cuts {a.ftpipehd}: {parts(a.shares, a.ftpipehd)}\n    slowest part "
          f"(x its slowdown) {a.slowest_share * 100:.1f}% of T against T / {capacity} = "
          f"{100 / a.capacity:.1f}%: granularity {a.granularity:.2f}")
    homogeneous = await virtual_epoch(config, costs, a.homogeneous)
    ftpipehd = await virtual_epoch(config, costs, a.ftpipehd)
    print(f"  estimated (planner) x{a.estimated:.2f} = bound x granularity "
          f"{a.cuts_bound * a.granularity:.2f}; virtual time: epoch {homogeneous:.3f} s -> "
          f"{ftpipehd:.3f} s, x{homogeneous / ftpipehd:.2f} (paper {PAPER}x)", flush=True)
    if processes:
        homogeneous = process_epoch(config, a.homogeneous)
        ftpipehd = process_epoch(config, a.ftpipehd)
        print(f"  processes ({network}): epoch {homogeneous:.3f} s -> {ftpipehd:.3f} s, "
              f"x{homogeneous / ftpipehd:.2f}", flush=True)


async def tables(model: str, samples: int, batch: int, slowdowns: tuple[float, ...],
                 count: int) -> None:
    """The same cuts charged from ``count`` fresh tables: the spread of the ratio and
    which units' parts move it (module docstring)."""
    config = config_of(model, samples, batch, slowdowns)
    fixed: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    print(f"{model}: {count} tables measured one after the other; the cuts of the first "
          "kept for all")
    for i in range(count):
        costs, planner = fresh_table(config)
        own = analyse(planner, slowdowns)
        fixed = fixed or (own.homogeneous, own.ftpipehd)
        a = analyse(planner, slowdowns, *fixed)
        homogeneous = await virtual_epoch(config, costs, a.homogeneous)
        ftpipehd = await virtual_epoch(config, costs, a.ftpipehd)
        slow = math.fsum(a.shares[a.homogeneous[-1]:])
        print(f"  table {i + 1}: parts % {' '.join(f'{s * 100:.1f}' for s in a.shares)}; "
              f"cuts {a.homogeneous} -> {a.ftpipehd}: {slowdowns[-1]:g} x "
              f"{slow * 100:.1f}% / "
              f"{a.slowest_share * 100:.1f}% = x{a.estimated:.2f} (virtual x"
              f"{homogeneous / ftpipehd:.2f}); this table's own cuts {own.homogeneous} -> "
              f"{own.ftpipehd} x{own.estimated:.2f}", flush=True)


async def main() -> None:
    """Parse, then compare each model (or measure its tables)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-12", "resnet101",
                                                        "mobilenetv3-small"])
    parser.add_argument("--samples", type=int, default=1000, help="on device 0")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--processes", action="store_true",
                        help="also between real processes")
    parser.add_argument("--network", default="lan")
    parser.add_argument("--slowdowns", default="1,1,1,10",
                        help="each device's, the slow one last (the paper's: 1,1,10)")
    parser.add_argument("--tables", type=int, metavar="K",
                        help="the same cuts charged from K fresh tables instead")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))  # (gpt-12's factory, by name)
    slowdowns = tuple(float(s) for s in args.slowdowns.split(","))
    for model in args.models:
        if args.tables:
            await tables(model, args.samples, args.batch_size, slowdowns, args.tables)
        else:
            await compare(model, args.samples, args.batch_size, slowdowns,
                          processes=args.processes, network=args.network)


if __name__ == "__main__":
    asyncio.run(main())
