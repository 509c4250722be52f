"""Asteroid's HPP planner (aiopipe/scheduler/asteroid.py): how good its plans are and
how long it takes.

``--planner`` (the default):

- **Quality**: random small cases (1–5 devices with slowdowns 1–8x, memory budgets of
  8–64 MiB and links of 20–100 Mbit/s; 2–8 units with random compute, activations and
  weights, compute linear or sub-linear in the batch size), the dynamic program's plan
  against the best of every plan of the same shape (`exhaustive_plan`), both scored by
  the same estimate: the share of cases where it is the best, and the worst ratio. Run
  with the paper's one sub-pipeline per state (``keep = 1``) and with the default.
- **Planning time**: resnet101 (35 units) on 8 devices, its compute measured on this
  machine at a few batch sizes, its outputs and state from the model (the profile every
  planner shares, `aiopipe.runtime.plan.model_profile`).

The estimates are the planner's model (Eqs. 3–11 of the paper), not measured rounds.

``--throughput``: training throughput (samples per second) of a heterogeneous fleet
(by default 5 devices with slowdowns 1, 2, 4, 4, 8, times ``--scale``, memory budgets
of 64, 32, 16, 12 and 8 MiB, wifi-like links of ``--mbps`` 50 Mbit/s and 2 ms; vgg5,
batches of 64 in 4 micro-batches), in virtual time with one cost table measured here
for every run: Asteroid's plan ("auto"), the hybrid baselines' plans (``planner``
"equal-groups" and "equal-groups-by-speed", `aiopipe.scheduler.hpp_baseline`; more
fleets in bench/asteroid_baselines.py), pure data parallelism (one stage, every device
the whole model on its rows of every micro-batch, all-reduce), pure pipeline
parallelism (``mode = "pipeline"``: one device per stage, balanced by the slowdowns) and
FL (FedAvg, each device its own data), side by side; and Asteroid's measured time per
iteration against its planner's estimate.

    .venv/bin/python bench/asteroid.py [--cases 1000] [--seed 25]
    .venv/bin/python bench/asteroid.py --throughput [--scale 1] [--mbps 50] [--out DIR]
    .venv/bin/python bench/asteroid.py --processes [--scale 1] [--mbps 50] [--samples 640]

``--processes``: the same four runs between real processes (``python -m aiopipe``).

``--faults``: between real processes (a server and three ``python -m aiopipe.device``),
stage 0 on devices 0 and 1, stage 1 on device 2; in epoch 2 device 1 (a group's member)
or device 2 (a stage's only device) is SIGKILLed, with ``rescheduling`` "lightweight"
(the plan adjusted) or "heavy" (planned from scratch), with stage backups every 5
batches or none; the time until the server gives it up, the time from the first stall a
device reported to the replay sent (waiting for the server to give the dead device up,
gathering the latest backup point, re-planning), the re-planning's own time, the batch
the replay starts from, and the test accuracy against an undisturbed run. The planner
bench (the default) also times both re-plannings on resnet101 over 8 devices.

    .venv/bin/python bench/asteroid.py --faults [--into 0.5] [--scale 1] [--samples 960]
        [--scenario NAME ...] [--out DIR]

``--backups``: what stage backups cost (virtual time): vgg5 on two one-device stages over
wifi, backups every 1, 5 or 20 batches against none.

    .venv/bin/python bench/asteroid.py --backups [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scheduler"))

from test_scheduler_asteroid import _random_case  # noqa: E402

from aiopipe import RunConfig, VirtualClock, models, simulate  # noqa: E402
from aiopipe.runtime.plan import (  # noqa: E402
    build_model,
    measure_planning_costs,
    model_profile,
    train_dataset,
)
from aiopipe.runtime.systems.base import planning_batch_sizes  # noqa: E402
from aiopipe.scheduler.asteroid import (  # noqa: E402
    KEEP,
    Device,
    HppModel,
    HppStage,
    adjusted_plan,
    exhaustive_plan,
    plan,
)
from aiopipe.scheduler.costs import CostTable, measure_costs  # noqa: E402

MIB = 2.0**20


def quality(cases: int, seed: int) -> None:
    """The dynamic program against every plan of its shape (module docstring)."""
    rng = random.Random(seed)
    drawn = []
    while len(drawn) < cases:
        model, fleet, m, b = _random_case(rng)
        best = exhaustive_plan(model, fleet, m, b)
        if best is not None:
            drawn.append((model, fleet, m, b, best.round_s))
    for keep in sorted({1, KEEP}):
        ratios = [best / plan(model, fleet, m, b, keep=keep).round_s
                  for model, fleet, m, b, best in drawn]
        optimal = sum(r >= 1 - 1e-9 for r in ratios)
        print(f"  keep {keep}: best of its shape in {optimal}/{cases} cases "
              f"({optimal / cases:.1%}); worst ratio {min(ratios):.3f}")


def planning_time(model_name: str, batch: int, micro_batches: int) -> None:
    """The planner on ``model_name`` over 8 devices (module docstring)."""
    model = models.build(model_name, num_classes=10, in_shape=(3, 32, 32))
    units = models.unit_count(model)
    started = time.perf_counter()
    costs = measure_costs(model, (3, 32, 32), [1, 4, batch], repeats=2, warmup=1)
    measured = time.perf_counter() - started
    profile = HppModel.of(model_profile(model, (3, 32, 32), costs))  # SGD with momentum
    fleet = [Device(s, m * MIB, 6.25e6) for s, m in
             zip([1, 2, 4, 4, 8, 1, 2, 2], [1024, 512, 512, 256, 256, 1024, 512, 256],
                 strict=True)]
    for keep in sorted({1, KEEP}):
        started = time.perf_counter()
        chosen = plan(profile, fleet, micro_batches, batch, keep=keep)
        seconds = time.perf_counter() - started
        stages = [(s.first, s.stop, s.devices) for s in chosen.stages]
        print(f"  {model_name} ({units} units) on 8 devices, keep {keep}: planned in "
              f"{seconds:.2f} s; {len(stages)} stages {stages}; estimated round "
              f"{chosen.round_s:.2f} s")
    print(f"  (measuring its compute at batch sizes 1, 4, {batch} took {measured:.0f} s)")
    replanning(profile, fleet, chosen.stages, micro_batches, batch)


def replanning(profile: HppModel, fleet: list[Device], stages: tuple[HppStage, ...],
               micro_batches: int, batch: int) -> None:
    """Each device of the plan lost in turn: lightweight re-planning (`adjusted_plan`)
    against the planner from scratch over the devices left, time and estimated round."""
    light_s, heavy_s, ratios = [], [], []
    for lost in range(len(fleet)):
        started = time.perf_counter()
        adjusted = adjusted_plan(profile, fleet, stages, {lost}, micro_batches, batch)
        light_s.append(time.perf_counter() - started)
        left = [d for d in range(len(fleet)) if d != lost]
        started = time.perf_counter()
        scratch = plan(profile, [fleet[d] for d in left], micro_batches, batch)
        heavy_s.append(time.perf_counter() - started)
        if adjusted is not None:
            ratios.append(scratch.round_s / adjusted.round_s)
    print(f"  a device lost (each of the {len(fleet)} in turn): lightweight re-planning "
          f"{1e3 * sum(light_s) / len(light_s):.1f} ms on average, from scratch "
          f"{sum(heavy_s) / len(heavy_s):.2f} s ({sum(heavy_s) / sum(light_s):.0f}x); "
          f"the adjusted plan's estimated throughput {min(ratios):.2f}-{max(ratios):.2f} "
          f"of the new plan's ({len(ratios)} of {len(fleet)} could be adjusted)")


SLOWDOWNS = (1.0, 2.0, 4.0, 4.0, 8.0)
BUDGETS_MB = (64.0, 32.0, 16.0, 12.0, 8.0)


def _fleet_config(scale: float, mbps: float, **changes: object) -> RunConfig:
    base = RunConfig(mode="asteroid", model="vgg5", devices=len(SLOWDOWNS),
                     samples_per_device=1280, batch_size=64, parallel_batches=4, epochs=1,
                     device_slowdown=tuple(scale * s for s in SLOWDOWNS),
                     device_memory_mb=BUDGETS_MB,
                     network={"up_mbps": mbps, "down_mbps": mbps, "latency_ms": 2},
                     test_samples=0, seed=1, learning_rate=0.02)
    return base.replace(**changes)


THROUGHPUT_RUNS: dict[str, dict[str, object]] = {
    "asteroid (auto)": {},
    "equal-groups (HPP baseline)": {"options": {"planner": "equal-groups"}},
    "equal-groups-by-speed": {"options": {"planner": "equal-groups-by-speed"}},
    "data parallel": {"options": {"stage_groups": [list(range(len(SLOWDOWNS)))],
                                  "partition": []}},
    "pipeline parallel": {"mode": "pipeline", "device_memory_mb": 0.0},
    "fl": {"mode": "fl", "parallel_batches": 1, "split_point": 5, "device_memory_mb": 0.0},
}


async def _simulated(config: RunConfig, costs: CostTable) -> dict[str, Any]:
    """One epoch in virtual time; and the time an iteration adds (an epoch of half the
    samples run too: the difference leaves out what a round costs once, the weights
    sent down and the trained stages up)."""
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    half = await simulate(config.replace(samples_per_device=config.device_samples_of(0) // 2),
                          clock=VirtualClock(), cost_table=costs)
    epoch = result.final
    batch = config.batch_size
    added = (epoch.time_s - half.final.time_s) / ((epoch.samples - half.final.samples) / batch)
    return {"time_s": epoch.time_s, "samples": epoch.samples,
            "samples_per_s": epoch.samples / epoch.time_s, "iteration_s": added,
            "plan": epoch.plan, "stages": epoch.stages}


def throughput(out: Path | None, scale: float, mbps: float) -> None:
    """Asteroid against data, pipeline parallelism and FL (module docstring)."""
    config = _fleet_config(scale, mbps)
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    started = time.perf_counter()
    costs = measure_planning_costs(config, model, dataset.in_shape, None,
                                   sizes=[1, 2, 4, 8, 16, 32, 64])
    print(f"  cost table measured in {time.perf_counter() - started:.0f} s")
    rows: dict[str, dict[str, Any]] = {}
    for name, changes in THROUGHPUT_RUNS.items():
        started = time.perf_counter()
        rows[name] = asyncio.run(_simulated(_fleet_config(scale, mbps, **changes), costs))
        rows[name]["wall_s"] = time.perf_counter() - started
    ours = rows["asteroid (auto)"]
    lines = [f"Slowdowns {list(config.device_slowdown)}, budgets {list(BUDGETS_MB)} MiB, "
             f"links of {mbps:g} Mbit/s (2 ms), vgg5, batches of {config.batch_size} in "
             f"{config.parallel_batches} micro-batches.", "",
             "| run | samples | epoch s (virtual) | samples/s | Asteroid ÷ it | "
             "s per iteration (batch) |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['samples']} | {row['time_s']:.2f} | "
                     f"{row['samples_per_s']:.1f} | "
                     f"{ours['samples_per_s'] / row['samples_per_s']:.2f} | "
                     f"{row['iteration_s']:.3f} |")
    plan = ours["plan"]
    estimate = float(plan[0]["estimate_s"])
    measured = ours["iteration_s"]
    stages = sorted({(e["stage"], tuple(e["units"])) for e in plan})
    groups = {p: [(e["device"], tuple(e["rows"])) for e in plan if e["stage"] == p]
              for p, _ in stages}
    lines += ["", "Asteroid's plan: " + "; ".join(
        f"stage {p} units {u[0]}..{u[1] - 1} on {groups[p]}" for p, u in stages),
        f"Iteration: measured {measured * 1e3:.1f} ms, planner's estimate "
        f"{estimate * 1e3:.1f} ms (measured ÷ estimate {measured / estimate:.2f})", "",
        "Asteroid's memory per device (MiB): what training held at most, measured; the "
        "planner's Eq. 3; the budget", "",
        "| device | stage | rows | measured | Eq. 3 | budget |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['device']} | {s['stage']} | {s['rows']} | {s['peak_memory_mb']:.2f} | "
              f"{s['planned_memory_mb']:.2f} | {s['budget_mb']:g} |" for s in ours["stages"]]
    name = f"throughput-x{scale:g}-{mbps:g}mbps"
    if _written(out, name, lines, rows):
        assert out is not None
        _plot(rows, out / f"{name}.png", lines[0])


def processes(out: Path | None, scale: float, mbps: float, samples: int) -> None:
    """The same runs between real processes (``python -m aiopipe``: a server and one
    process per device over loopback websockets, each sender paced at the links' rate,
    each device's compute stretched by its slowdown), side by side."""
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, changes in THROUGHPUT_RUNS.items():
            config = _fleet_config(scale, mbps, samples_per_device=samples, **changes)
            path = Path(scratch) / f"{len(rows)}.toml"
            path.write_text(config.replace(out_dir="").to_toml())
            run_dir = Path(scratch) / f"run{len(rows)}"
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "aiopipe", "--config", str(path),
                                   "--out-dir", str(run_dir)], cwd=REPO, capture_output=True,
                                  text=True, timeout=1200, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
            epoch = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            rows[name] = {"time_s": epoch["time_s"], "samples": epoch["samples"],
                          "samples_per_s": epoch["samples"] / epoch["time_s"],
                          "wall_s": time.perf_counter() - started, "plan": epoch["plan"]}
            print(f"  {name}: {epoch['samples']} samples in {epoch['time_s']:.2f} s",
                  flush=True)
    ours = rows["asteroid (auto)"]
    lines = [f"Between processes: slowdowns {[scale * s for s in SLOWDOWNS]}, budgets "
             f"{list(BUDGETS_MB)} MiB, links of {mbps:g} Mbit/s (2 ms, paced by each "
             f"sender), vgg5, {samples} samples per device.", "",
             "| run | samples | epoch s | samples/s | Asteroid ÷ it |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['samples']} | {row['time_s']:.2f} | "
                     f"{row['samples_per_s']:.1f} | "
                     f"{ours['samples_per_s'] / row['samples_per_s']:.2f} |")
    plan = ours["plan"]
    lines.append("")
    lines.append("Asteroid's plan: " + "; ".join(
        f"device {e['device']} stage {e['stage']} units {e['units']} rows {e['rows']}"
        for e in plan))
    _written(out, f"processes-x{scale:g}-{mbps:g}mbps", lines, rows)


#: the run's keys (ProcessFleet writes asteroid's own under ``[asteroid]``)
FAULT_RUN = {"mode": "asteroid", "devices": 3, "model": "vgg5", "samples_per_device": 960,
             "batch_size": 32, "network": "wifi", "parallel_batches": 2, "epochs": 4,
             "learning_rate": 0.02, "momentum": 0.5, "test_samples": 1000,
             "heartbeat_interval": 0.5, "device_timeout": 5.0, "reconnect_grace": 2.0,
             "stage_groups": [[0, 1], [2]], "partition": [2], "chain_replication_every": 5}
#: who is killed (a member of stage 0's group, or stage 1's only device), how the plan
#: changes, and whether stages are backed up (every 5 batches) or not
SCENARIOS = {"none": ((), "lightweight", True), "member": ((1,), "lightweight", True),
             "member, heavy": ((1,), "heavy", True), "single": ((2,), "lightweight", True),
             "single, heavy": ((2,), "heavy", True),
             "member, no backups": ((1,), "lightweight", False),
             "single, no backups": ((2,), "lightweight", False)}


async def _fault_run(scenario: str, into: float, changes: dict[str, Any]) -> dict[str, Any]:
    """One fresh run between real processes, ``SCENARIOS[scenario]``: who is SIGKILLed ``into``
    seconds into epoch 2; ``FAULT_RUN`` with ``changes``."""
    sys.path.insert(0, str(REPO / "tests"))
    from real_processes import ProcessFleet

    killed, rescheduling, backups = SCENARIOS[scenario]
    run = {**FAULT_RUN, **changes, "rescheduling": rescheduling}
    if not backups:
        run["chain_replication_every"] = 0
    with tempfile.TemporaryDirectory() as tmp:
        async with ProcessFleet(Path(tmp), run) as fleet:
            server = await fleet.start_server()
            devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0")
                       for k in range(3)]
            await server.output.wait_for(r"^\s+1\s", within=600)  # epoch 2 has begun
            await asyncio.sleep(into)
            kill_at = time.monotonic()
            for k in killed:
                devices[k].send_signal(signal.SIGKILL)
            lost_at = None
            for k in killed:
                await devices[k].wait(30)
                line = await server.output.wait_for(rf"device {k} was lost", since=kill_at,
                                                    within=120)
                lost_at = line.at
            await fleet.finish(server, [d for k, d in enumerate(devices) if k not in killed],
                               within=1200)
            epochs = fleet.metrics()
            trace = json.loads((fleet.out_dir / "trace.json").read_text())
    out: dict[str, Any] = {"scenario": scenario, "accuracy": float(epochs[-1]["accuracy"]),
                           "epoch_s": [float(e["time_s"]) for e in epochs]}
    recoveries = [c for e in epochs for c in e["changes"] if c.get("kind") == "recovery"]
    if killed and recoveries:
        last = recoveries[-1]
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e.get("name") == "thread_name"}
        computed = [e["ts"] / 1e6 for e in trace["traceEvents"] if e.get("ph") == "X"
                    and names[e["tid"]].endswith("/compute") and e["cat"] in ("f", "s")
                    and e["ts"] / 1e6 >= last["resumed_s"]]
        out.update(given_up_s=lost_at - kill_at if lost_at is not None else float("nan"),
                   replan_s=last["resumed_s"] - last["noticed_s"], plan=last["after"],
                   first_forward_s=min(computed) - last["resumed_s"],
                   stopped=last["stopped"], planning_s=last["planning_s"],
                   rescheduling=last["rescheduling"], from_iteration=last["from_iteration"])
    return out


def faults(out: Path | None, into: float, only: list[str] | None = None, *,
           slowdown: float = 1.0, samples: int = 960) -> None:
    """Asteroid's recovery between real processes (``--faults``): every scenario, or
    the undisturbed run and ``only`` these; every device's compute ``slowdown`` times
    this host's, ``samples`` a device."""
    chosen = ["none", *(only or [s for s in SCENARIOS if s != "none"])]
    changes = {"device_slowdown": slowdown, "samples_per_device": samples}
    rows = [asyncio.run(_fault_run(scenario, into, changes)) for scenario in chosen]
    base = rows[0]["accuracy"]
    lines = [f"Between processes: {FAULT_RUN['devices']} devices, stages "
             f"{FAULT_RUN['stage_groups']}, wifi links (50 Mbit/s, paced by each "
             f"sender), vgg5, {FAULT_RUN['epochs']} epochs of {samples} samples per device, "
             f"compute {slowdown:g}x this host's; the kill {into:g} s "
             "into epoch 2; reconnect_grace "
             f"{FAULT_RUN['reconnect_grace']:g} s; stage backups every "
             f"{FAULT_RUN['chain_replication_every']} batches (but where it says "
             "none).", "",
             "| scenario | test accuracy | Δ from none | kill → given up s | "
             "stall noticed → replay sent s | re-planning ms | replay from batch | "
             "replay sent → first forward s | epoch times s |",
             "|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for row in rows:
        lines.append(f"| {row['scenario']} | {row['accuracy']:.3f} | "
                     f"{row['accuracy'] - base:+.3f} | {row.get('given_up_s', nan):.2f} "
                     f"| {row.get('replan_s', nan):.2f} | "
                     f"{1e3 * row.get('planning_s', nan):.2f} | "
                     f"{row.get('from_iteration', '')} | "
                     f"{row.get('first_forward_s', nan):.3f} | "
                     f"{', '.join(f'{t:.1f}' for t in row['epoch_s'])} |")
    for row in rows[1:]:
        lines.append(f"\n{row['scenario']}: {row.get('stopped', '?')}; re-planned to "
                     f"{row.get('plan')}")
    if _written(out, "faults", lines, rows):
        assert out is not None
        plot_faults(rows, out / "faults.png", f"Asteroid recovery between processes, "
                    f"compute {slowdown:g}x this host's, kill {into:g} s into epoch 2")


def backups(out: Path | None) -> None:
    """What stage backups cost training (``--backups``), in virtual time."""
    rows = {}
    base_config = RunConfig(mode="asteroid", devices=2, model="vgg5", samples_per_device=960,
                            batch_size=32,
                            parallel_batches=2, epochs=1, network="wifi", test_samples=0,
                            options={"stage_groups": [[0], [1]], "partition": [4]})
    model = build_model(base_config, num_classes=10, in_shape=(3, 32, 32))
    costs = measure_planning_costs(base_config, model, (3, 32, 32), None,
                                   sizes=planning_batch_sizes(base_config))  # one table
    for every in (0, 20, 5, 1):
        config = base_config.replace(options={"chain_replication_every": every})
        result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=costs))
        rows[every] = {"every": every, "epoch_s": result.epochs[0].time_s}
    base = rows[0]["epoch_s"]
    lines = ["vgg5, stage 0 (units 0-3) on device 0, stage 1 (unit 4) on device 1, wifi "
             "(50 Mbit/s, 2 ms), 30 batches of 32 in 2 micro-batches, one epoch, virtual "
             "time (one cost table of this host for every run).", "",
             "| backups every | epoch s | ÷ none |", "|---|---|---|"]
    for row in rows.values():
        lines.append(f"| {row['every'] or 'none'} | {row['epoch_s']:.2f} | "
                     f"{row['epoch_s'] / base:.2f} |")
    _written(out, "backups", lines, list(rows.values()))


def _written(out: Path | None, name: str, lines: list[str], rows: Any) -> bool:
    """Print ``lines``; with ``out``, write them as ``name``.md and ``rows`` as
    ``name``.json there (whether it did)."""
    text = "\n".join(lines)
    print(text)
    if out is None:
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1, default=str))
    return True


def _plot(rows: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Samples per second of each run, as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(rows)
    ax.bar(names, [rows[n]["samples_per_s"] for n in names],
           color=["tab:green", "tab:purple", "tab:pink", "tab:blue", "tab:orange",
                  "tab:grey"])
    ax.set_ylabel("samples / s (virtual time)")
    ax.set_title(title.split(", vgg5")[0], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_faults(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Each scenario's epoch times, as grouped bars (epoch 2 holds the fault)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    epochs = len(rows[0]["epoch_s"])
    width = 0.8 / epochs
    for e in range(epochs):
        ax.bar([i + e * width for i in range(len(rows))],
               [row["epoch_s"][e] for row in rows], width, label=f"epoch {e + 1}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([row["scenario"] for row in rows], fontsize=7, rotation=15)
    ax.set_ylabel("epoch time (s)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Run and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--batch", type=int, default=32, help="micro-batch size")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--throughput", action="store_true",
                        help="compare training throughput in virtual time instead")
    parser.add_argument("--processes", action="store_true",
                        help="compare training throughput between real processes instead")
    parser.add_argument("--faults", action="store_true",
                        help="kill a group's member, then a stage's only device, between "
                             "real processes, against an undisturbed run")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS)[1:],
                        help="--faults: run only this scenario (and the undisturbed run); "
                             "may be repeated")
    parser.add_argument("--into", type=float, default=0.5,
                        help="--faults: seconds into epoch 2 to kill")
    parser.add_argument("--samples", type=int,
                        help="samples per device (--processes: default 640; --faults: 960)")
    parser.add_argument("--out", type=Path, help="write the throughput table here")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the fleet's slowdowns (10: devices ten times "
                             "slower than this host at the fastest; --faults: every "
                             "device's)")
    parser.add_argument("--mbps", type=float, default=50.0,
                        help="every link's rate, both ways (default 50: wifi-like)")
    parser.add_argument("--backups", action="store_true",
                        help="what stage backups cost training, in virtual time")
    args = parser.parse_args()
    if args.backups:
        print(f"Asteroid stage backups, virtual time; load average {os.getloadavg()[0]:.2f}")
        backups(args.out)
        return
    if args.faults:
        print(f"Asteroid faults, processes; load average {os.getloadavg()[0]:.2f}")
        faults(args.out, args.into, args.scenario, slowdown=args.scale,
               samples=args.samples or 960)
        return
    if args.processes:
        print(f"Asteroid throughput, processes; load average {os.getloadavg()[0]:.2f}")
        processes(args.out, args.scale, args.mbps, args.samples or 640)
        return
    if args.throughput:
        print(f"Asteroid throughput, virtual time; load average {os.getloadavg()[0]:.2f}")
        throughput(args.out, args.scale, args.mbps)
        return
    print(f"Asteroid planner; load average {os.getloadavg()[0]:.2f}")
    print(f"quality over {args.cases} random small cases (seed {args.seed}):")
    quality(args.cases, args.seed)
    print("planning time:")
    planning_time(args.model, args.batch, args.micro_batches)


if __name__ == "__main__":
    main()
