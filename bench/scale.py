"""Scale of virtual-time simulation: wall time and peak memory for K = 10, 100, 1000 devices.

Each K runs ``aiopipe.simulate(config, clock=VirtualClock(), cost_table=COSTS)`` in a
fresh Python process (so peak RSS is per run): PiPar, vgg5 on synthetic-cifar10, small
per-device data (40 samples, B = 20, N = 2, P = 2, 1 epoch, 100 test samples), network
"4g". Every child charges the same cost table: uniform by default (1 ms forward, 2 ms
backward, 0.1 ms step per unit at B' = 10: deterministic, so virtual times compare
across runs and machines), measured once in this process (``--costs measured``; on a
loaded machine the figures, and so the virtual times, vary from run to run), or read
from a JSON file (``--costs FILE``; ``--save-costs FILE`` writes the one used).

Per K, side by side in one table:

- ``wall s``: wall time of ``asyncio.run(simulate(...))`` in the child (imports excluded),
  ``user s`` / ``sys s``: its CPU time (sys is mostly page faults), ``ms/smp``: wall ms
  per trained sample; ``proc s``: the child process from start to exit;
- ``peak MiB``: the child's ``ru_maxrss``; ``base MiB``: its ``ru_maxrss`` just before
  ``simulate`` (torch and aiopipe imported, nothing built); ``MiB/dev``: (peak - base) / K;
  ``marg``: marginal MiB per device, (peak - previous row's peak) / (K - previous K),
  which leaves out the fixed costs of a run (server model, test set, lazy imports);
  ``flt/dev``: minor page faults during ``simulate`` per device;
- the compute floor (printed last): wall ms per sample of the same training in a plain
  PyTorch loop in the parent (`plain_loop_ms`), to read ``ms/smp`` against;
- ``est MiB``: the model's estimate of the peak (below); ``virt s``: the virtual epoch
  time the run reports; ``samples``: samples trained (must be K x samples_per_device
  per epoch, or ``--devices-per-round`` x samples_per_device when devices are sampled);
- ``slices``: slices in ``result.trace`` (one per f/u/s/d/b/step/model transfer) and
  ``slices/s`` per wall second; ``wakeups/s``: timed sleeps on the virtual clock per wall
  second (each is a future the clock's driver resolves).

The estimate: base + K x (server replica: parameters + momentum + gradients of the
server half; device half: the same three; device inputs: the N micro-batch inputs a
device's stage keeps until their gradients return, since in virtual time it forwards
them again at the backward instead of keeping their graphs, [Note: recomputed
activations]; frames: N activations and N gradients). Every term is measured from vgg5
here, not guessed. It leaves out malloc fragmentation and Python objects. With every
device mid-round at once (all active), it is also the floor of what PiPar's definition
holds a device: each device's server half is trained on a replica of its own, with its
own gradients and momentum, until the round's aggregation. The header line also gives
what the N graphs would take without recomputing (measured with
``saved_tensors_hooks``).

The machine is shared, so memory is guarded: a K whose estimate (or the last run's
MiB/dev, when larger) would leave less than ``--keep-free-gib`` of MemAvailable is
skipped (``--force`` runs it anyway, still guarded), and a child is killed as soon as
MemAvailable falls below it; ``--timeout`` bounds each child. The table then says so,
and the figures are extrapolated from the largest K that ran.

``--against REV`` runs every K twice, first with commit REV's aiopipe (extracted with
``git archive``, first on the child's PYTHONPATH; the child reports which package it
imported), then with this tree's: old and new side by side in one run, on one machine
state. The costs, config and child script are this tree's for both.

``--mode fl`` simulates FedAvg instead of PiPar (the same model and data; B, N as given:
``--parallel-batches 1`` for textbook FL). The population mode, for sampled fleets
(issue 48 part 4: memory must follow the devices in a round, not those that have ever
trained): ``--marks 10,100`` has each child note, after each of those rounds (an epoch
is one round here), the process's peak RSS so far (``VmHWM``), its RSS and PSS now
(``/proc/self/smaps_rollup``: one process, so PSS is RSS less what it shares with other
processes) and the wall time so far, printed as one line per K and mark; ``--epochs``
defaults to the largest mark. ``--local-optimizer fresh|kept`` sets the star option in
this tree's children (an ``--against`` commit's children run as that commit does).

``--profile K`` runs one more child with cProfile around its ``simulate`` call and
prints the top functions by cumulative time (all, then aiopipe's) and by own time.
``--malloc-mmap-threshold BYTES`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` in the
children (a fixed threshold stops glibc from serving freed multi-MB tensors out of the
heap, where they stay resident).

    .venv/bin/python bench/scale.py [--devices 10,100,1000] [--costs uniform|measured|FILE]
        [--samples-per-device 40] [--batch-size 20] [--parallel-batches 2]
        [--split-point 2] [--epochs 1] [--test-samples 100] [--network 4g]
        [--timeout 900] [--keep-free-gib 2] [--force] [--profile K] [--top 15]
        [--profile-out FILE] [--malloc-mmap-threshold BYTES] [--save-costs FILE]
        [--against REV] [--mode pipar|fl] [--marks 10,100] [--local-optimizer fresh|kept]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import math
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import aiopipe
from aiopipe import models
from aiopipe.clock import VirtualClock
from aiopipe.scheduler.costs import CostTable, measure_costs

MIB = 1 << 20
MARK = "SCALE-RESULT "
ROUND_MARK = "SCALE-ROUND "  # a mark's figures, printed as it passes (kept if killed later)


# -- the child: one simulation ---------------------------------------------------------


class CountingClock(VirtualClock):
    """A VirtualClock that counts its timed sleeps (each one a wake-up of the driver)."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    async def sleep(self, seconds: float) -> None:
        """As `VirtualClock.sleep`, counted when it waits on the clock."""
        if seconds > 0:
            self.wakeups += 1
        await super().sleep(seconds)


def config_of(args: argparse.Namespace, devices: int) -> aiopipe.RunConfig:
    """The run for ``devices`` devices."""
    local = getattr(args, "local_optimizer", "")
    return aiopipe.RunConfig(
        mode=getattr(args, "mode", "pipar"),
        **({"options": {"local_optimizer": local}} if local else {}),
        model="vgg5",
        dataset="synthetic-cifar10",
        devices=devices,
        samples_per_device=args.samples_per_device,
        batch_size=args.batch_size,
        parallel_batches=args.parallel_batches,
        split_point=args.split_point,
        epochs=args.epochs,
        test_samples=args.test_samples,
        network=args.network,
        seed=0,
        devices_per_round=min(args.devices_per_round, devices),
    )


def plain_loop_ms(args: argparse.Namespace, samples: int = 2000) -> float:
    """The compute floor: wall ms per sample of the same training in a plain PyTorch loop
    (one process, one thread, vgg5 whole, micro-batches of B / N from the same synthetic
    data, a step every N), after one warm-up batch."""
    from aiopipe.runtime.plan import build_model, train_dataset

    config = config_of(args, 1)
    data = train_dataset(config.replace(samples_per_device=samples))
    model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)
    micro, n = args.batch_size // args.parallel_batches, args.parallel_batches
    batches = [data.batch(range(i, i + micro)) for i in range(0, samples, micro)]
    started = 0.0
    for i, (x, y) in enumerate(batches):
        if i == n:
            started = time.perf_counter()  # the first N micro-batches warm up
        (torch.nn.functional.cross_entropy(model(x), y) / n).backward()
        if (i + 1) % n == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return 1e3 * (time.perf_counter() - started) / (samples - n * micro)


def run_child(args: argparse.Namespace) -> None:
    """Run one simulation; print its figures as one JSON line after ``MARK``."""
    torch.set_num_threads(1)
    costs = CostTable.from_mapping(json.loads(Path(args.costs_file).read_text()))
    config = config_of(args, args.child)
    clock = CountingClock()
    before = resource.getrusage(resource.RUSAGE_SELF)
    base_kib = before.ru_maxrss
    profiler = cProfile.Profile() if args.child_profile else None
    marks = {int(m) for m in args.marks.split(",") if m.strip()}
    noted: list[dict[str, float]] = []

    def note(epoch: Any) -> None:  # the population mode's figures after a round
        if epoch.epoch in marks:  # (numbered from 1)
            noted.append({"round": epoch.epoch, "wall_s": time.perf_counter() - started,
                          "hwm_mib": proc_status_mib(os.getpid(), "VmHWM"),
                          "rss_mib": proc_status_mib(os.getpid(), "VmRSS"),
                          "pss_mib": pss_mib()})
            print(ROUND_MARK + json.dumps(noted[-1]), flush=True)

    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = asyncio.run(aiopipe.simulate(config, clock=clock, cost_table=costs,
                                          progress=note if marks else None))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.child_profile)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    peak_kib = after.ru_maxrss
    final = result.final
    print(
        MARK
        + json.dumps(
            {
                "devices": config.devices,
                "wall_s": wall,
                "base_mib": base_kib / 1024,
                "peak_mib": peak_kib / 1024,
                "virtual_s": sum(e.time_s for e in result.epochs),
                "samples": sum(e.samples for e in result.epochs),
                "accuracy": final.accuracy,
                "slices": len(result.trace),
                "wakeups": clock.wakeups,
                "user_s": after.ru_utime - before.ru_utime,
                "sys_s": after.ru_stime - before.ru_stime,
                "minor_faults": after.ru_minflt - before.ru_minflt,
                "package": str(Path(aiopipe.__file__).parent),
                "marks": noted,
            }
        ),
        flush=True,
    )


# -- the parent: cost table, estimate, one child per K, the table ----------------------


def cost_table(args: argparse.Namespace) -> CostTable:
    """Uniform (1 ms forward, 2 ms backward per unit at B'), measured once on this machine
    at B' and B, or read from a JSON file (`CostTable.to_mapping` form).

    Raises:
        ConfigError: the file does not hold a cost table.
        OSError: the file cannot be read.
    """
    if args.costs not in ("uniform", "measured"):
        return CostTable.from_mapping(json.loads(Path(args.costs).read_text()))
    if args.costs == "uniform":
        return CostTable.uniform(
            5,
            forward=0.001,
            backward=0.002,
            step=0.0001,
            batch=args.batch_size // args.parallel_batches,
        )
    torch.manual_seed(0)
    model = models.build("vgg5", num_classes=10, in_shape=(3, 32, 32))
    micro = args.batch_size // args.parallel_batches
    return measure_costs(model, (3, 32, 32), sorted({micro, args.batch_size}))


def per_device_bytes(args: argparse.Namespace) -> dict[str, int]:
    """The terms of the per-device memory estimate, in bytes, measured from vgg5."""
    torch.manual_seed(0)
    model = models.build("vgg5", num_classes=10, in_shape=(3, 32, 32))
    device_half, server_half = models.split(model, args.split_point)
    micro = args.batch_size // args.parallel_batches

    def state_bytes(module: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in module.state_dict().values())

    inputs = torch.randn(micro, 3, 32, 32)
    out = device_half(inputs)
    activation = out.numel() * out.element_size()
    n = args.parallel_batches
    return {
        # parameters + momentum + gradients (gradients live from the first micro-batch's
        # backward to the step; with K devices queued, most replicas hold them at once)
        "server replica": 3 * state_bytes(server_half),
        "device half": 3 * state_bytes(device_half),
        # PiPar runs N forwards before the first backward; in virtual time on the CPU a
        # device's stage keeps each micro-batch's input, not its graph, and forwards it
        # again at the backward ([Note: recomputed activations] in aiopipe.runtime.stage)
        "device inputs": n * inputs.numel() * inputs.element_size(),
        # N activation frames up, N gradients cached + N gradient frames down
        "frames": 3 * n * activation,
    }


def saved_graph_bytes(args: argparse.Namespace) -> int:
    """What a device's stage would keep for its N forwards without recomputing them:
    the N graphs' saved tensors (measured with ``saved_tensors_hooks``), for the note
    of what recomputing saves."""
    torch.manual_seed(0)
    model = models.build("vgg5", num_classes=10, in_shape=(3, 32, 32))
    device_half = models.split(model, args.split_point)[0]
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in device_half.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:  # weights are shared by the N graphs
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        device_half(torch.randn(args.batch_size // args.parallel_batches, 3, 32, 32))
    return args.parallel_batches * sum(storages.values())


def estimate_mib(base_mib: float, devices: int, terms: dict[str, int]) -> float:
    """Estimated peak RSS in MiB for ``devices`` devices."""
    return base_mib + devices * sum(terms.values()) / MIB


def _proc_mib(path: str, key: str, missing: float) -> float:
    """The ``key:`` line of a /proc file that counts in kB, in MiB (``missing`` where the
    file or the line is not there)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return missing


def mem_available_mib() -> float:
    """MemAvailable of /proc/meminfo (inf where there is none)."""
    return _proc_mib("/proc/meminfo", "MemAvailable", math.inf)


def child_command(args: argparse.Namespace, devices: int, costs_file: Path) -> list[str]:
    """The command line of the child that simulates ``devices`` devices."""
    return [
        sys.executable,
        __file__,
        "--child",
        str(devices),
        "--costs-file",
        str(costs_file),
        "--samples-per-device",
        str(args.samples_per_device),
        "--batch-size",
        str(args.batch_size),
        "--parallel-batches",
        str(args.parallel_batches),
        "--split-point",
        str(args.split_point),
        "--epochs",
        str(args.epochs),
        "--test-samples",
        str(args.test_samples),
        "--network",
        args.network,
        "--devices-per-round",
        str(args.devices_per_round),
        "--mode",
        args.mode,
        "--marks",
        args.marks,
    ]


def child_env(args: argparse.Namespace, package_root: Path | None = None) -> dict[str, str]:
    """The children's environment (with glibc's mmap threshold when asked; importing
    aiopipe from ``package_root`` when given: another commit's)."""
    env = dict(os.environ)
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(package_root), *filter(None, [env.get("PYTHONPATH", "")])])
    return env


def export_commit(rev: str, into: Path) -> Path:
    """``rev``'s aiopipe package, extracted under ``into`` (``git archive``): the
    directory to put first on a child's PYTHONPATH."""
    repo = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "aiopipe"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def pss_mib() -> float:
    """This process's proportional set size in MiB (0 where smaps_rollup is missing)."""
    return _proc_mib("/proc/self/smaps_rollup", "Pss", 0.0)


def proc_status_mib(pid: int, key: str) -> float:
    """A ``VmHWM``/``VmRSS``-style figure of process ``pid`` in MiB (0 when unreadable)."""
    return _proc_mib(f"/proc/{pid}/status", key, 0.0)


def run_one(args: argparse.Namespace, devices: int, costs_file: Path,
            package_root: Path | None = None) -> dict[str, Any]:
    """One child; its figures, or ``{"error": ...}`` when it failed or was stopped.

    The child is killed when it runs past ``--timeout`` or when MemAvailable falls below
    ``--keep-free-gib`` (the machine is shared: never push others into the OOM killer).
    """
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        command = child_command(args, devices, costs_file)
        if package_root is None and args.local_optimizer:  # (an older commit has none)
            command += ["--local-optimizer", args.local_optimizer]
        process = subprocess.Popen(
            command,
            env=child_env(args, package_root),
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
        )
        stopped = ""
        while process.poll() is None:
            elapsed = time.perf_counter() - started
            available = mem_available_mib()
            if elapsed > args.timeout:
                stopped = f"killed after {elapsed:.0f} s (--timeout)"
            elif available < args.keep_free_gib * 1024:
                stopped = (
                    f"killed after {elapsed:.0f} s: MemAvailable {available / 1024:.1f} GiB < "
                    f"{args.keep_free_gib:g} GiB with the child at "
                    f"{proc_status_mib(process.pid, 'VmRSS') / 1024:.1f} GiB RSS "
                    f"(peak {proc_status_mib(process.pid, 'VmHWM') / 1024:.1f} GiB)"
                )
            if stopped:
                process.kill()
                process.wait()
                break
            time.sleep(0.25)
        proc = time.perf_counter() - started
        output.seek(0)
        text = output.read()
    if stopped:
        passed = [json.loads(line[len(ROUND_MARK):]) for line in text.splitlines()
                  if line.startswith(ROUND_MARK)]
        return {"devices": devices, "error": stopped, "marks": passed}
    for line in text.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK) :]), "proc_s": proc}
    tail = " | ".join(text.strip().splitlines()[-3:])
    return {"devices": devices, "error": f"exit code {process.returncode}: {tail}"}


def table(rows: list[dict[str, Any]], terms: dict[str, int], base_mib: float) -> list[str]:
    """The results table, one row per K."""
    head = (
        f"{'K':>5} {'wall s':>7} {'user s':>7} {'sys s':>6} {'ms/smp':>6} {'proc s':>7} "
        f"{'base MiB':>8} {'peak MiB':>8} {'MiB/dev':>7} {'marg':>6} {'est MiB':>8} {'flt/dev':>7} "
        f"{'virt s':>7} {'samples':>7} {'slices':>7} {'slices/s':>8} {'wakeups/s':>9}"
    )
    out = [head + (f" {'version':>10}" if any("version" in r for r in rows) else "")]
    previous: dict[str, Any] | None = None
    for row in rows:
        k = row["devices"]
        version = f" {row['version']:>10}" if "version" in row else ""
        if "error" in row:
            est = estimate_mib(base_mib, k, terms)
            out.append(f"{k:>5} {'-':>7} ... est {est:.0f} MiB: {row['error']}{version}")
            continue
        wall = row["wall_s"]
        per_dev = (row["peak_mib"] - row["base_mib"]) / k
        marginal = (
            f"{(row['peak_mib'] - previous['peak_mib']) / (k - previous['devices']):>6.2f}"
            if previous is not None and k != previous["devices"]
            and previous.get("version") == row.get("version")
            else f"{'-':>6}"
        )
        previous = row
        est = estimate_mib(row["base_mib"], k, terms)
        out.append(
            f"{k:>5} {wall:>7.1f} {row['user_s']:>7.1f} {row['sys_s']:>6.1f} "
            f"{1e3 * wall / max(1, row['samples']):>6.2f} {row['proc_s']:>7.1f} "
            f"{row['base_mib']:>8.0f} {row['peak_mib']:>8.0f} {per_dev:>7.2f} {marginal} "
            f"{est:>8.0f} {row['minor_faults'] / k:>7.0f} {row['virtual_s']:>7.3f} "
            f"{row['samples']:>7} {row['slices']:>7} {row['slices'] / wall:>8.0f} "
            f"{row['wakeups'] / wall:>9.0f}{version}"
        )
    return out


def marks(rows: list[dict[str, Any]]) -> list[str]:
    """The population mode's lines: per K (and version) and mark, memory after that
    round and the wall time so far."""
    out = []
    for row in rows:
        version = f" ({row['version']})" if "version" in row else ""
        for mark in row.get("marks", ()):
            out.append(f"K = {row['devices']}{version}, after round {mark['round']}: peak RSS "
                       f"{mark['hwm_mib']:.0f} MiB, RSS {mark['rss_mib']:.0f} MiB, PSS "
                       f"{mark['pss_mib']:.0f} MiB, wall {mark['wall_s']:.1f} s")
    return out


def per_device_slopes(done: list[dict[str, Any]]) -> tuple[dict[str, Any], float, float]:
    """The largest run, and wall seconds and MiB per extra device: marginal between the
    two largest runs when there are two, else that run's figures over its K (which then
    include the run's fixed costs)."""
    largest: dict[int, dict[str, Any]] = {}  # per K, its largest run (of any version)
    for row in done:
        if row["peak_mib"] >= largest.get(row["devices"], {}).get("peak_mib", -1.0):
            largest[row["devices"]] = row
    ordered = [largest[k] for k in sorted(largest)]
    last = ordered[-1]
    if len(ordered) >= 2:
        first = ordered[-2]
        dk = last["devices"] - first["devices"]
        return (
            last,
            (last["wall_s"] - first["wall_s"]) / dk,
            (last["peak_mib"] - first["peak_mib"]) / dk,
        )
    k0 = last["devices"]
    return last, last["wall_s"] / k0, (last["peak_mib"] - last["base_mib"]) / k0


def extrapolate(rows: list[dict[str, Any]], terms: dict[str, int]) -> list[str]:
    """Linear extrapolation, from the largest K that ran, to the Ks that did not."""
    done = [r for r in rows if "error" not in r]
    failed = [r for r in rows if "error" in r]
    if not done or not failed:
        return []
    last, wall_per_device, mib_per_device = per_device_slopes(done)
    k0 = last["devices"]
    lines = [
        f"extrapolated linearly from K = {k0} ({wall_per_device:.3f} s and "
        f"{mib_per_device:.2f} MiB per further device):"
    ]
    for row in failed:
        k = row["devices"]
        wall = last["wall_s"] + wall_per_device * (k - k0)
        peak = last["peak_mib"] + mib_per_device * (k - k0)
        lines.append(
            f"  K = {k}: wall ~{wall:.0f} s, peak RSS ~{peak / 1024:.1f} GiB "
            f"(estimate {estimate_mib(last['base_mib'], k, terms) / 1024:.1f} GiB)"
        )
    return lines


def profile(args: argparse.Namespace, devices: int, costs_file: Path) -> None:
    """Profile one child's ``simulate`` call (cProfile; imports before it excluded) and
    print the top functions: by cumulative time, the same within aiopipe, by own time."""
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(args.profile_out or Path(tmp) / "scale.prof")
        command = [*child_command(args, devices, costs_file), "--child-profile", str(stats)]
        print(f"--- cProfile of simulate(), K = {devices}", flush=True)
        subprocess.run(
            command,
            env=child_env(args),
            check=True,
            timeout=args.timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        pstats.Stats(str(stats)).sort_stats("cumulative").print_stats(args.top)
        pstats.Stats(str(stats)).sort_stats("cumulative").print_stats("aiopipe/", args.top)
        pstats.Stats(str(stats)).sort_stats("tottime").print_stats(args.top)


def parse_args() -> argparse.Namespace:
    """Command-line options (``--child`` marks the internal child process)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--devices", default="10,100,1000", help="comma-separated Ks")
    parser.add_argument(
        "--costs", default="uniform", help='"uniform" (default), "measured" or FILE.json'
    )
    parser.add_argument("--save-costs", default="", metavar="FILE", help="write the table used")
    parser.add_argument("--samples-per-device", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--parallel-batches", type=int, default=2)
    parser.add_argument("--split-point", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=0,
                        help="epochs (rounds, when sampled): 1, or the largest of --marks")
    parser.add_argument("--test-samples", type=int, default=100)
    parser.add_argument("--network", default="4g")
    parser.add_argument("--floor-samples", type=int, default=2000,
                        help="samples the plain PyTorch loop of the compute floor trains on")
    parser.add_argument("--devices-per-round", type=int, default=0,
                        help="devices sampled to train in each round (0: every device; "
                             "capped at K)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument(
        "--keep-free-gib",
        type=float,
        default=2.0,
        help="skip a K that would leave less MemAvailable; kill a child that does",
    )
    parser.add_argument("--force", action="store_true", help="run every K regardless")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="K",
        help="also profile one run with K devices (cProfile)",
    )
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--profile-out", default="", help="keep the cProfile stats here")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES")
    parser.add_argument(
        "--against", default="", metavar="REV",
        help="also run each K with commit REV's aiopipe (git archive), side by side")
    parser.add_argument("--mode", choices=("pipar", "fl"), default="pipar")
    parser.add_argument("--marks", default="", metavar="R,...",
                        help="population mode: memory after each of these rounds")
    parser.add_argument("--local-optimizer", default="", choices=("", "fresh", "kept"),
                        help="the star option, in this tree's children (default: its default)")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--costs-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.epochs = args.epochs or max((int(m) for m in args.marks.split(",") if m.strip()),
                                     default=1)
    if args.child:
        run_child(args)
        return
    torch.set_num_threads(1)
    ks = [int(k) for k in args.devices.split(",") if k.strip()]
    costs = cost_table(args)
    terms = per_device_bytes(args)
    base_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # rough, until a run
    micro, p = args.batch_size // args.parallel_batches, args.split_point
    device_ms = 1e3 * (costs.forward_time(0, p, micro) + costs.backward_time(0, p, micro))
    server_ms = 1e3 * (
        costs.forward_time(p, costs.units, micro) + costs.backward_time(p, costs.units, micro)
    )
    print(
        f"{args.mode} vgg5 synthetic-cifar10, {args.samples_per_device} samples/device, "
        f"B={args.batch_size} N={args.parallel_batches} P={p}, {args.epochs} epoch(s), "
        f"network {args.network}, {args.costs} costs (at B'={micro}: device f+b "
        f"{device_ms:.2f} ms, server f+b {server_ms:.2f} ms)"
        + (
            f", MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}"
            if args.malloc_mmap_threshold
            else ""
        )
        + (
            f", {args.devices_per_round} devices sampled per round"
            if args.devices_per_round
            else ""
        )
        + (f", local_optimizer {args.local_optimizer}" if args.local_optimizer else "")
    )
    print(
        "per-device memory estimate: "
        + ", ".join(f"{name} {b / MIB:.2f} MiB" for name, b in terms.items())
        + f"; total {sum(terms.values()) / MIB:.2f} MiB/device (the N graphs, were they "
        f"kept instead of the inputs: {saved_graph_bytes(args) / MIB:.2f} MiB)"
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        costs_file = Path(tmp) / "costs.json"
        costs_file.write_text(json.dumps(costs.to_mapping()))
        if args.save_costs:
            Path(args.save_costs).write_text(json.dumps(costs.to_mapping(), indent=1))
        versions: list[tuple[str, Path | None]] = [("this tree", None)]
        if args.against:  # the old commit first, then this tree, per K
            old = export_commit(args.against, Path(tmp) / "against")
            versions.insert(0, (args.against[:10], old))
        for k in ks:
            available = mem_available_mib()
            need = estimate_mib(base_mib, k, terms)
            ran = [r for r in rows if "error" not in r]
            if ran:  # what the runs so far measured per device, if more than the estimate
                last, _, mib_per_device = per_device_slopes(ran)
                base_mib = last["base_mib"]
                need = max(
                    estimate_mib(base_mib, k, terms),
                    last["peak_mib"] + mib_per_device * (k - last["devices"]),
                )
            if not args.force and need > available - args.keep_free_gib * 1024:
                rows.append(
                    {
                        "devices": k,
                        "error": (
                            f"skipped: needs ~{need / 1024:.1f} GiB > MemAvailable "
                            f"{available / 1024:.1f} GiB - {args.keep_free_gib:g} GiB kept free "
                            "(--force runs it)"
                        ),
                    }
                )
                print(f"--- K = {k}: {rows[-1]['error']}", flush=True)
                continue
            for version, root in versions:
                print(f"--- K = {k}{f' ({version})' if args.against else ''} "
                      f"(MemAvailable {mem_available_mib() / 1024:.1f} GiB) ...", flush=True)
                rows.append(run_one(args, k, costs_file, root))
                if args.against:
                    rows[-1]["version"] = version
                print("    " + json.dumps(rows[-1]), flush=True)
        print()
        for line in table(rows, terms, base_mib) + extrapolate(rows, terms) + marks(rows):
            print(line)
        # after the children: a child's ru_maxrss starts from its parent's RSS at the fork
        floor = plain_loop_ms(args, args.floor_samples)
        print(f"compute floor: {floor:.2f} ms per sample in a plain PyTorch "
              "loop (same model, data and micro-batches, one thread; data generation "
              "included)")
        if args.profile:
            print()
            profile(args, args.profile, costs_file)


if __name__ == "__main__":
    main()
