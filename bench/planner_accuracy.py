"""How good is the planner on this machine? Estimator error and selection score (PiPar §5.4).

For each case (model x network; 2 devices with ``device_slowdown`` 4 by default) this
bench does what the runtime's "auto" does, then checks it against real runs:

1. plan: build the model and data as the server does, measure the cost table
   (`measure_costs` at every micro-batch size B/N the planner may use, with the devices'
   batch loading; torch threads as the runs use) in a fresh process, as a starting
   server measures it, and let `resolve_auto` choose (P_k, N_k). The search time S is
   the profiling plus the selection seconds.
2. sweep (the exhaustive search): every candidate (P, N), the same for both devices, P in
   1..Q-1 and N among the divisors of B (the planner's own candidates), runs one epoch
   for real; candidates whose micro-batch the model cannot train at (batch norm at
   B' = 1: an infinite cost in the table) are left out, as the planner leaves them out.
   A run that takes longer than ``--prune`` (3) x the quickest sweep run's wall time
   + 2 s is stopped: it cannot be the optimum (its epoch would be slower than that
   run's by far). The sweep goes in the order of the estimated epoch so that the bound
   is tight early; the order is all the estimate decides.
3. re-planning: from the trace of the planner's choice's sweep run, the plans a
   ``replan=True`` run would switch to after its first round, decided as the server
   decides (device speeds, link bandwidths and server speed measured from the round,
   a fresh selection taken when it is estimated better by more than
   ``replan_threshold``; aiopipe/runtime/systems/star/replan.py).
4. finalists: the planner's choice, the re-planned plans and the sweep's best
   ``--finalists`` candidates run ``--repeats`` more times each, round-robin (so a
   change of machine load hits them alike), two epochs each; T of each is the median of
   these runs' second epochs. T_opt is the least of them.

Every run is `aiopipe.simulate` on the real `SystemClock` over memory links shaped like the
network preset: real compute (a device's compute stays busy ``slowdown`` times as long as
its work took), nothing charged from a cost table. ``replan`` is off so the plan stays put.

Definitions (the figures in the tables):

- T, the epoch time: `EpochMetrics.time_s` of a run's second epoch (the model halves'
  download, ``samples_per_device / B`` iterations, the upload and the aggregation).
  The first epoch of a run also holds the devices' one-off set-up (building the model
  and data while the first round starts), so the sweep's one-epoch runs, which only
  nominate the finalists, are slower by about that much. Compared with
  `estimate_epoch`.
- iteration time: per device, (end of its last iteration's step - start of its second
  iteration's first forward) / (iterations - 1); the fleet's is the slowest device's.
  The first iteration is left out: the devices start it at different times (each after
  its own model download). Compared with `estimate_steady_iteration`, the estimator's
  figure for the same thing: iterations back to back, one step to the next, after the
  start's transient. (Until session 7 this bench compared it with
  `estimate_iteration`, one iteration that every device starts at 0 so that all collide
  on the server at once: a different quantity, 14-34% above the measured figure
  whenever the devices' server passes collide.)
- error: (estimate - measured) / measured. The headline is the median of |error| of the
  iteration time over the cases; the sweep adds the same figures for every candidate.
- score (PiPar Eq. 28): T_opt / T_selected; the re-planned score is T_opt / T of the
  re-planned plans (what a ``replan=True`` run trains with from its second round on).
- search cost ([search cost]): S / T, the planner's search time S (profiling and
  selection) over the selected plan's epoch T. This bench's epochs are short (by default
  128 samples per device, 4 iterations), so S/T says little about a real run; PiPar's 27%
  (Table 7) is over an epoch of CIFAR-10's 50,000 training samples. "S/T ref" divides S
  by ``reference_samples`` / devices / B iterations of the selected plan's measured
  steady iteration: a lower bound of such an epoch (it leaves out the model's download,
  upload and aggregation), so the fraction is an upper bound.

The bench shares 2 cores with whatever else runs; the load average before and after is
written next to the figures. The default (9 cases) takes about 40 minutes on 2 cores.

Run: ``.venv/bin/python bench/planner_accuracy.py [--quick] [--out DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from aiopipe import RunConfig, simulate
from aiopipe.clock import SystemClock
from aiopipe.metrics.results import RunResult
from aiopipe.metrics.trace import Slice
from aiopipe.runtime.compute import warm_up_torch
from aiopipe.runtime.plan import (
    build_model,
    declared_devices,
    device_indices,
    measure_planning_costs,
    model_profile,
    train_dataset,
)
from aiopipe.runtime.systems.base import planning_batch_sizes
from aiopipe.runtime.systems.star.planning import choose_plans, device_plans, resolve_auto
from aiopipe.runtime.systems.star.replan import live_profiles, reselect
from aiopipe.scheduler import (
    CostTable,
    DeviceProfile,
    ModelProfile,
    estimate_epoch,
    estimate_steady_iteration,
)

MODELS = ("vgg5", "resnet18", "mobilenetv3-small")
NETWORKS = ("4g", "4g+", "wifi")
RESULTS = Path(__file__).resolve().parent / "results" / "2026-11-21"
#: Seconds a pruned sweep run gets beyond ``prune`` x the quickest run's wall time.
PRUNE_SLACK_S = 2.0

Plan = tuple[tuple[int, int], ...]  # (P_k, N_k) per device


@dataclass(frozen=True, slots=True)
class Settings:
    """What every case shares."""

    devices: int = 2
    slowdown: float = 4.0
    batch_size: int = 32
    samples_per_device: int = 128
    dataset: str = "synthetic-cifar10"
    repeats: int = 5
    finalists: int = 5
    profile_repeats: int = 5
    profile_warmup: int = 2
    prune: float = 3.0
    seed: int = 0
    #: samples in a reference epoch (CIFAR-10's training set, the epoch PiPar's Table 7
    #: divides its search time by), shared evenly by the devices
    reference_samples: int = 50_000

    def reference_iterations(self) -> int:
        """Iterations per device in an epoch of ``reference_samples``."""
        return math.ceil(self.reference_samples / self.devices / self.batch_size)

    def config(self, model: str, network: str) -> RunConfig:
        """The case's run config, "auto" plan."""
        return RunConfig(
            mode="pipar", model=model, dataset=self.dataset, devices=self.devices,
            samples_per_device=self.samples_per_device, batch_size=self.batch_size, epochs=1,
            split_point="auto", parallel_batches="auto", network=network,
            device_slowdown=self.slowdown, test_samples=20, seed=self.seed,
            torch_threads=1, options={"replan": False},
        )


@dataclass(frozen=True, slots=True)
class Planned:
    """The planner's side of a case: the profile it measured and what it chose."""

    config: RunConfig  # "auto" resolved
    costs: CostTable
    model: ModelProfile
    devices: tuple[DeviceProfile, ...]
    plan: Plan
    profile_s: float
    select_s: float

    @property
    def search_s(self) -> float:
        """Profiling plus selection seconds (S in PiPar Table 7)."""
        return self.profile_s + self.select_s

    def estimate(self, plan: Plan) -> tuple[float, float]:
        """Estimated (iteration, epoch) seconds of ``plan``."""
        b = self.config.batch_size
        return (estimate_steady_iteration(self.model, self.devices, plan, b),
                estimate_epoch(self.model, self.devices, plan, b))


@dataclass(frozen=True, slots=True)
class Run:
    """One real run of one plan."""

    epoch_s: float
    iteration_s: float
    wall_s: float
    #: the iteration estimated from the first epoch's trace (as the re-planner measures
    #: devices, links and the server: aiopipe/runtime/systems/star/replan.py); None for one epoch
    live_estimate_iteration_s: float | None = None
    #: the plans ``replan=True`` would run from the second round on, decided from the
    #: first epoch's trace as the server decides (None when not asked for)
    replanned: Plan | None = None


@dataclass(slots=True)
class Candidate:
    """A plan, its estimates and its real runs."""

    plan: Plan
    estimate_iteration_s: float
    estimate_epoch_s: float
    sweep: Run | None = None
    failed: str = ""  # why the sweep's run failed (the candidate is then left out)
    pruned_s: float = 0.0  # the sweep's run was stopped after this many seconds
    reruns: list[Run] = field(default_factory=list)

    @property
    def epoch_s(self) -> float:
        """T: the median epoch of the re-runs (the sweep's run when there are none)."""
        runs = self.reruns or ([self.sweep] if self.sweep else [])
        return statistics.median(r.epoch_s for r in runs)

    @property
    def iteration_s(self) -> float:
        """Median iteration time of the re-runs (the sweep's run when there are none)."""
        runs = self.reruns or ([self.sweep] if self.sweep else [])
        return statistics.median(r.iteration_s for r in runs)

    @property
    def live_estimate_iteration_s(self) -> float | None:
        """Median of the re-runs' estimates from live measurements (None without)."""
        live = [r.live_estimate_iteration_s for r in self.reruns
                if r.live_estimate_iteration_s is not None]
        return statistics.median(live) if live else None


# -- planning ---------------------------------------------------------------------------


def stability(models: Sequence[str], networks: Sequence[str], settings: Settings,
              times: int, out: Path | None) -> None:
    """Issue 27's planner stability: each case profiled and planned ``times`` times in
    a row, as separate runs would (a fresh cost table each time, each measured in a new
    process as a starting server measures it); the plans chosen and
    how often, and each chosen plan's estimated epoch under every profile (how near the
    tie the noise had to move)."""
    lines = [f"Planner stability: {times} profiles per case, {settings.devices} devices "
             f"x {settings.slowdown:g}, B = {settings.batch_size} (load "
             f"{os.getloadavg()[0]:.2f} at the start)", "",
             "| model | network | plans chosen (times) | spread of the chosen plans' "
             "estimates within each profile |", "|---|---|---|---|"]
    rows = []
    for model in models:
        for network in networks:
            config = settings.config(model, network)
            planned = [plan_case(config, settings) for _ in range(times)]
            chosen = collections.Counter(format_plan(p.plan) for p in planned)
            plans = sorted({p.plan for p in planned})
            spreads = []
            for p in planned:  # within one profile: how far apart the chosen plans are
                estimates = [p.estimate(plan)[1] for plan in plans]
                spreads.append(max(estimates) / min(estimates) - 1)
            row = {"model": model, "network": network, "chosen": dict(chosen),
                   "spread": max(spreads)}
            rows.append(row)
            lines.append(f"| {model} | {network} | "
                         f"{', '.join(f'{k} ×{v}' for k, v in chosen.most_common())} | "
                         f"{100 * row['spread']:.1f}% |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "planner_stability.md").write_text(text + "\n")
        (out / "planner_stability.json").write_text(json.dumps(rows, indent=1))


def divisors(n: int) -> list[int]:
    """The N candidates for "auto" (plan.py: every micro-batch has B/N samples)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def profile_case(config: RunConfig, settings: Settings) -> tuple[CostTable, float]:
    """The case's cost table measured in this process as a server starting an "auto" run
    measures it (fresh: `plan_case` calls this in a new process); the table and the
    profiling seconds."""
    torch.set_num_threads(config.torch_threads)
    warm_up_torch()  # as the server does before it profiles
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    started = time.perf_counter()
    costs = measure_planning_costs(config, model, dataset.in_shape, dataset,
                                   sizes=planning_batch_sizes(config),
                                   repeats=settings.profile_repeats,
                                   warmup=settings.profile_warmup)
    return costs, time.perf_counter() - started


def profile_in_a_fresh_process(config: RunConfig, settings: Settings
                               ) -> tuple[CostTable, float]:
    """`profile_case` in a new Python process, as each run's server profiles: what this
    process ran before (sweeps, earlier profiles) leaves its heap, caches and threads
    behind, and a profile measured after it is another machine's (session 21: vgg5's
    server passes at 1-2 samples 10-20% slower in a process's later profiles than in its
    first)."""
    done = subprocess.run(
        [sys.executable, __file__, "--profile-case", json.dumps(config.to_mapping()),
         "--profile-settings", json.dumps(asdict(settings))],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]),
                          os.environ.get("PYTHONPATH")]))})
    if done.returncode != 0:
        raise RuntimeError(f"profiling in a fresh process failed: {done.stderr[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return CostTable.from_mapping(answer["costs"]), float(answer["profile_s"])


def plan_case(config: RunConfig, settings: Settings) -> Planned:
    """Profile (in a fresh process) and plan as the server does for "auto" (see the
    module docs, step 1)."""
    costs, profile_s = profile_in_a_fresh_process(config, settings)
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    samples = [len(device_indices(config, dataset, k)) for k in range(config.devices)]
    profiled = time.perf_counter()
    resolved = resolve_auto(config, model, dataset.in_shape, samples, costs)
    selected = time.perf_counter()
    profile = model_profile(model, dataset.in_shape, costs)
    devices = tuple(declared_devices(config, samples))
    plan = tuple((int(resolved.device_split_point(k)), int(resolved.device_parallel_batches(k)))
                 for k in range(config.devices))
    # the same profile must give the same choice, or the estimates below are not the
    # planner's
    again = choose_plans(config, profile, list(devices))
    if tuple(again) != plan:
        raise RuntimeError(f"bench profile selects {again}, resolve_auto chose {plan}")
    return Planned(resolved, costs, profile, devices, plan, profile_s, selected - profiled)


def candidates(planned: Planned) -> list[Plan]:
    """Every homogeneous (P, N) the sweep runs: P in 1..Q-1, N | B, B/N trainable."""
    costs, batch = planned.costs, planned.config.batch_size
    out: list[Plan] = []
    for n in divisors(batch):
        micro = batch // n
        if not all(math.isfinite(costs.forward[u].get(micro, math.inf))
                   for u in range(costs.units)):
            continue
        out.extend(tuple([(p, n)] * planned.config.devices) for p in range(1, costs.units))
    return sorted(out)


# -- measuring --------------------------------------------------------------------------


def steady_iteration_s(trace: Sequence[Slice], devices: int, epoch: int) -> float:
    """The slowest device's mean iteration after its first (see the module docs), in the
    trace's epoch ``epoch`` (the trace's index, from 0; its message counts from 1).

    Raises:
        ValueError: a device ran fewer than 2 iterations in ``epoch``.
    """
    per_device = []
    for k in range(devices):
        mine = [s for s in trace
                if s.track == f"device{k}/compute" and s.epoch == epoch and s.iteration >= 0]
        iterations = sorted({s.iteration for s in mine})
        if len(iterations) < 2:
            raise ValueError(f"device {k} ran {len(iterations)} iterations in epoch {epoch + 1}; "
                             "the iteration time needs 2 or more")
        start = min(s.start for s in mine if s.iteration == iterations[1])
        end = max(s.end for s in mine if s.iteration == iterations[-1])
        per_device.append((end - start) / (len(iterations) - 1))
    return max(per_device)


class Pruned(Exception):
    """A sweep run stopped at its time limit: slower than the best by far."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"stopped after {limit_s:.1f} s")
        self.limit_s = limit_s


def run_plan(config: RunConfig, plan: Plan, *, epochs: int = 1,
             limit_s: float | None = None, planned: Planned | None = None) -> Run:
    """One real run of ``plan`` on the system clock: the figures of its last epoch.

    With ``planned``, the run also says what the re-planner would switch to after the
    first round (`replanned`) and, with two or more epochs, estimates its iteration from
    the first epoch's trace (`live_estimate`).

    Raises:
        Pruned: the run took longer than ``limit_s`` seconds (it is cancelled).
    """
    fixed = config.replace(split_point=tuple(p for p, _ in plan),
                           parallel_batches=tuple(n for _, n in plan), epochs=epochs)

    async def bounded() -> RunResult:
        return await asyncio.wait_for(simulate(fixed, clock=SystemClock()), limit_s)

    started = time.perf_counter()
    try:
        result = asyncio.run(bounded())
    except TimeoutError:
        raise Pruned(time.perf_counter() - started) from None
    wall = time.perf_counter() - started
    epoch = result.final
    live, replanned = None, None
    if planned is not None:
        model, devices = first_round_profiles(planned, fixed, result.trace)
        replanned = replan_choice(planned, model, devices, plan)
        if epochs > 1:
            live = estimate_steady_iteration(model, devices, plan, fixed.batch_size)
    # the trace indexes epochs from 0; `EpochMetrics.epoch` counts them from 1
    return Run(epoch.time_s, steady_iteration_s(result.trace, fixed.devices, epoch.epoch - 1),
               wall, live, replanned)


def first_round_profiles(planned: Planned, fixed: RunConfig, trace: Sequence[Slice]
                         ) -> tuple[ModelProfile, list[DeviceProfile]]:
    """The profiles the re-planner measures from epoch 0's trace (aggregation every
    epoch: one round per epoch)."""
    samples = [d.samples for d in planned.devices]
    plans = device_plans(fixed, planned.model.costs.units, samples)
    served = [p.iterations_per_epoch * p.parallel_batches for p in plans]
    return live_profiles([s for s in trace if s.epoch == 0], plans, served, planned.model,
                         list(planned.devices))


def replan_choice(planned: Planned, model: ModelProfile, devices: Sequence[DeviceProfile],
                  current: Plan) -> Plan:
    """The plans a ``replan=True`` run switches to after its first round, given the
    profiles that round showed: a fresh selection when its estimated epoch beats the
    current plans' by more than ``replan_threshold`` (`reselect`, as the server
    decides), else ``current``."""
    auto = planned.config.replace(split_point="auto", parallel_batches="auto")
    chosen, _, _ = reselect(auto, model, devices, current)
    return tuple(chosen)


def evaluate_case(model: str, network: str, settings: Settings, *, exhaustive: bool = True,
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    """Plan one case, sweep its candidates, re-run the finalists; the raw record."""
    config = settings.config(model, network)
    load_before = os.getloadavg()[0]
    planned = plan_case(config, settings)
    say(f"  planned {format_plan(planned.plan)} in {planned.search_s:.2f} s "
        f"(profile {planned.profile_s:.2f} s, select {planned.select_s * 1e3:.0f} ms)")
    pool = {plan: Candidate(plan, *planned.estimate(plan))
            for plan in (candidates(planned) if exhaustive else [])}
    sweep_started = time.perf_counter()
    quickest = math.inf  # wall seconds of the quickest sweep run so far
    # the most promising first (by the estimate), so that the pruning bound is tight
    # early; the estimate only orders the sweep, every candidate runs
    for cand in sorted(pool.values(), key=lambda c: (c.estimate_epoch_s, c.plan)):
        limit = (settings.prune * quickest + PRUNE_SLACK_S
                 if settings.prune and math.isfinite(quickest) else None)
        try:
            # the planner's choice also shows what the re-planner does after its first round
            cand.sweep = run_plan(planned.config, cand.plan, limit_s=limit,
                                  planned=planned if cand.plan == planned.plan else None)
        except Pruned as stop:
            cand.pruned_s = stop.limit_s
        except Exception as exc:  # one broken candidate must not end the sweep
            cand.failed = f"{type(exc).__name__}: {exc}"
        if cand.sweep:
            quickest = min(quickest, cand.sweep.wall_s)
        say(f"    {format_plan(cand.plan)}: est {cand.estimate_epoch_s:.2f} s, "
            + (f"T {cand.sweep.epoch_s:.2f} s" if cand.sweep else
               f"stopped after {cand.pruned_s:.1f} s" if cand.pruned_s else
               f"failed: {cand.failed}"))
    sweep_s = time.perf_counter() - sweep_started
    selected = pool.get(planned.plan) or Candidate(planned.plan, *planned.estimate(planned.plan))
    pool[planned.plan] = selected
    replanned = None
    if selected.sweep and selected.sweep.replanned:
        target = selected.sweep.replanned
        replanned = pool.get(target) or Candidate(target, *planned.estimate(target))
        pool[target] = replanned
    ranked = sorted((c for c in pool.values() if c.sweep), key=lambda c: c.sweep.epoch_s
                    if c.sweep else math.inf)
    finalists = _unique([selected, *([replanned] if replanned else []),
                         *ranked[:settings.finalists]])
    for _ in range(settings.repeats):
        for cand in finalists:
            cand.reruns.append(run_plan(planned.config, cand.plan, epochs=2, planned=planned))
    best = min(finalists, key=lambda c: c.epoch_s)
    record = {
        "model": model, "network": network,
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "selected": _candidate_record(selected),
        "search_s": planned.search_s, "profile_s": planned.profile_s,
        "select_s": planned.select_s,
        "optimum": _candidate_record(best),
        "exhaustive_s": sum(c.sweep.wall_s if c.sweep else c.pruned_s for c in pool.values()),
        "sweep_wall_s": sweep_s,
        "score": best.epoch_s / selected.epoch_s,
        # [search cost]: over this bench's short epoch, and over a reference epoch
        "search_fraction": planned.search_s / selected.epoch_s,
        "search_fraction_reference": planned.search_s / (
            settings.reference_iterations() * selected.iteration_s),
        # what replan=True runs from the second round on, and its score
        "replanned": _candidate_record(replanned) if replanned else None,
        "score_replanned": best.epoch_s / replanned.epoch_s if replanned else None,
        "candidates": [_candidate_record(c) for c in sorted(pool.values(), key=lambda c: c.plan)],
        "costs": planned.costs.to_mapping(),
    }
    say(f"  selected {format_plan(selected.plan)}: T {selected.epoch_s:.3f} s "
        f"(est {selected.estimate_epoch_s:.3f}), iteration {selected.iteration_s:.3f} s "
        f"(est {selected.estimate_iteration_s:.3f}); best {format_plan(best.plan)} "
        f"T {best.epoch_s:.3f} s; score {record['score']:.3f}"
        + (f"; re-planned after round 1 to {format_plan(replanned.plan)}: score "
           f"{record['score_replanned']:.3f}" if replanned else ""))
    return record


def _unique(items: Sequence[Candidate]) -> list[Candidate]:
    out: list[Candidate] = []
    for c in items:
        if all(c is not o for o in out):
            out.append(c)
    return out


def _candidate_record(c: Candidate) -> dict[str, Any]:
    return {
        "plan": [list(p) for p in c.plan],
        "estimate_iteration_s": c.estimate_iteration_s,
        "estimate_epoch_s": c.estimate_epoch_s,
        "epoch_s": c.epoch_s if (c.sweep or c.reruns) else None,
        "iteration_s": c.iteration_s if (c.sweep or c.reruns) else None,
        "live_estimate_iteration_s": c.live_estimate_iteration_s,
        "epoch_range_s": ([min(r.epoch_s for r in c.reruns), max(r.epoch_s for r in c.reruns)]
                          if c.reruns else None),
        "sweep": asdict(c.sweep) if c.sweep else None,
        "failed": c.failed,
        "pruned_s": c.pruned_s,
        "reruns": [asdict(r) for r in c.reruns],
    }


# -- reporting --------------------------------------------------------------------------


def format_plan(plan: Sequence[Sequence[int]]) -> str:
    """``P=2 N=8`` for a homogeneous plan, else per device."""
    if all(tuple(p) == tuple(plan[0]) for p in plan):
        return f"P={plan[0][0]} N={plan[0][1]}"
    return " ".join(f"d{k}:P{p}N{n}" for k, (p, n) in enumerate(plan))


def error(estimate: float, measured: float) -> float:
    """(estimate - measured) / measured."""
    return (estimate - measured) / measured


def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Headline figures: estimator errors and scores."""
    iteration = [error(r["selected"]["estimate_iteration_s"], r["selected"]["iteration_s"])
                 for r in records]
    epoch = [error(r["selected"]["estimate_epoch_s"], r["selected"]["epoch_s"])
             for r in records]
    sweep_iteration = [error(c["estimate_iteration_s"], c["sweep"]["iteration_s"])
                       for r in records for c in r["candidates"] if c["sweep"]]
    sweep_epoch = [error(c["estimate_epoch_s"], c["sweep"]["epoch_s"])
                   for r in records for c in r["candidates"] if c["sweep"]]
    scores = [r["score"] for r in records]
    replanned = [r["score_replanned"] for r in records if r.get("score_replanned") is not None]
    live = [error(r["selected"]["live_estimate_iteration_s"], r["selected"]["iteration_s"])
            for r in records if r["selected"].get("live_estimate_iteration_s") is not None]

    def med_abs(values: Sequence[float]) -> float | None:
        return statistics.median(abs(v) for v in values) if values else None

    return {
        "median_abs_error_iteration": med_abs(iteration),
        "median_error_iteration": statistics.median(iteration),
        "median_abs_error_epoch": med_abs(epoch),
        "median_error_epoch": statistics.median(epoch),
        "median_abs_error_iteration_live": med_abs(live),
        "median_error_iteration_live": statistics.median(live) if live else None,
        "sweep_runs": len(sweep_iteration),
        "sweep_stopped": sum(1 for r in records for c in r["candidates"] if c["pruned_s"]),
        "sweep_median_abs_error_iteration": med_abs(sweep_iteration),
        "sweep_median_error_iteration": statistics.median(sweep_iteration)
        if sweep_iteration else None,
        "sweep_median_abs_error_epoch": med_abs(sweep_epoch),
        "score_mean": statistics.mean(scores),
        "score_min": min(scores),
        "score_replanned_mean": statistics.mean(replanned) if replanned else None,
        "score_replanned_min": min(replanned) if replanned else None,
        "search_fraction_mean": statistics.mean(r["search_fraction"] for r in records),
        "search_fraction_reference_mean": statistics.mean(
            r["search_fraction_reference"] for r in records),
        "search_fraction_reference_max": max(r["search_fraction_reference"] for r in records),
    }


def markdown(records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report: Table 7 style selection table, the estimator table, the settings."""
    s = summary(records)
    lines = [
        f"# Planner accuracy on this machine — {meta['date']}",
        "",
        f"Command: `{meta['command']}`; {meta['cases']} cases; bench wall time "
        f"{meta['wall_s'] / 60:.1f} min; load average (1 min) before {meta['load_before']:.2f}, "
        f"after {meta['load_after']:.2f} on {meta['cpus']} cores (shared with other work: "
        "single runs are noisy).",
        "",
        f"Settings: {meta['settings']['devices']} devices, device slowdown "
        f"{meta['settings']['slowdown']:g}, B = {meta['settings']['batch_size']}, "
        f"{meta['settings']['samples_per_device']} samples per device "
        f"({meta['settings']['samples_per_device'] // meta['settings']['batch_size']} "
        f"iterations per epoch), {meta['settings']['dataset']}, one torch thread, memory links "
        "on the system clock (real compute), replanning off. Exhaustive candidates: P in "
        "1..Q-1 x N among the divisors of B whose micro-batch the model can train at, the "
        "same (P, N) for every device; each ran one epoch (runs slower than "
        f"{meta['settings']['prune']:g} x the quickest run + 2 s were stopped: not the "
        "optimum), then the planner's choice and the "
        f"sweep's best {meta['settings']['finalists']} ran {meta['settings']['repeats']} more "
        "times each, two epochs per run (T = median of the second epochs).",
        "",
        "## Selection (PiPar Table 7, Eq. 28)",
        "",
        "S = search time: profiling + selection for the planner; the sweep's summed run "
        "wall time for the exhaustive search (stopped runs count until they were "
        "stopped). S/T: search time over one epoch of the selected plan. S/T ref: over "
        f"an epoch of {meta['settings']['reference_samples']:,} samples shared by the "
        "devices (CIFAR-10's training set, the epoch of PiPar's Table 7), taken as that "
        "many iterations of the selected plan's measured steady iteration (an epoch's "
        "lower bound, so the fraction is an upper bound).",
        "",
        "T runs: the fastest and slowest of the re-runs' epochs. Re-planned: the plan a "
        "`replan=True` run switches to after its first round (decided, as the server "
        "does, from the planner's choice's sweep run), and its score.",
        "",
        "| model | network | P | N | T (s) | T runs (s) | S (s) | S/T | S/T ref | P_opt "
        "| N_opt | T_opt (s) | T_opt runs (s) | S_opt (s) | score | re-planned | score |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: "
        "| ---: | ---: | ---: | --- | ---: |",
    ]
    for r in records:
        sel, opt, again = r["selected"], r["optimum"], r.get("replanned")
        p, n = _columns(sel["plan"])
        po, no = _columns(opt["plan"])
        lines.append(
            f"| {r['model']} | {r['network']} | {p} | {n} | {sel['epoch_s']:.2f} | "
            f"{_range(sel)} | {r['search_s']:.1f} | {r['search_fraction']:.2f} | "
            f"{r['search_fraction_reference']:.4f} | "
            f"{po} | {no} | {opt['epoch_s']:.2f} | {_range(opt)} | "
            f"{r['exhaustive_s']:.0f} | {r['score']:.3f} | "
            + (f"{'kept' if again['plan'] == sel['plan'] else format_plan(again['plan'])} | "
               f"{r['score_replanned']:.3f} |" if again else "n/a | n/a |")
        )
    lines += [
        "",
        f"Score: mean **{s['score_mean']:.3f}**, min **{s['score_min']:.3f}** "
        "(target: mean >= 0.98, min >= 0.95)."
        + (f" After re-planning from the first round: mean "
           f"**{s['score_replanned_mean']:.3f}**, min **{s['score_replanned_min']:.3f}**."
           if s["score_replanned_mean"] is not None else ""),
        "",
        f"Search cost: S/T mean {s['search_fraction_mean']:.2f} over this bench's epochs; "
        f"over a reference epoch mean **{s['search_fraction_reference_mean']:.4f}**, max "
        f"{s['search_fraction_reference_max']:.4f} (PiPar Table 7: mean 0.27).",
        "",
        "## Estimator accuracy (the planner's choice)",
        "",
        "Iteration: steady-state iteration time from the trace (iterations after the "
        "first), estimated by `estimate_steady_iteration` (iterations back to back); "
        "epoch: the epoch time. error = (estimate - measured) / measured; "
        "measured = median over the re-runs' second epochs.",
        "",
        "Live: the iteration estimated from each re-run's first epoch, with the device "
        "speeds, link bandwidths and server speed the re-planner measures from a round's "
        "trace (aiopipe/runtime/systems/star/replan.py), against the same runs' second epochs.",
        "",
        "| model | network | plan | iteration est (s) | iteration measured (s) | error "
        "| live est (s) | error | epoch est (s) | epoch measured (s) | error |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        sel = r["selected"]
        lines.append(
            f"| {r['model']} | {r['network']} | {format_plan(sel['plan'])} | "
            f"{sel['estimate_iteration_s']:.3f} | {sel['iteration_s']:.3f} | "
            f"{error(sel['estimate_iteration_s'], sel['iteration_s']):+.1%} | "
            f"{_live_cells(sel)} | {sel['estimate_epoch_s']:.3f} | {sel['epoch_s']:.3f} | "
            f"{error(sel['estimate_epoch_s'], sel['epoch_s']):+.1%} |"
        )
    lines += [
        "",
        f"Median |error|: iteration **{s['median_abs_error_iteration']:.1%}** (signed median "
        f"{s['median_error_iteration']:+.1%}), epoch **{s['median_abs_error_epoch']:.1%}** "
        f"(signed {s['median_error_epoch']:+.1%}); target <= 10%. From live "
        "measurements (after one round): median |error| iteration "
        + (f"**{s['median_abs_error_iteration_live']:.1%}** (signed "
           f"{s['median_error_iteration_live']:+.1%})."
           if s["median_abs_error_iteration_live"] is not None else "n/a."),
    ]
    failed = [f"{r['model']}/{r['network']} {format_plan(c['plan'])}: {c['failed']}"
              for r in records for c in r["candidates"] if c["failed"]]
    if failed:
        lines += ["", f"Sweep runs that failed ({len(failed)}; left out):", "",
                  *(f"- {f}" for f in failed)]
    if s["sweep_runs"]:
        lines += [
            "",
            f"Over every finished sweep run ({s['sweep_runs']} plans, one single-epoch run "
            f"each, so epochs include the set-up; {s['sweep_stopped']} stopped runs left "
            "out): median |error| "
            f"iteration {s['sweep_median_abs_error_iteration']:.1%} (signed "
            f"{s['sweep_median_error_iteration']:+.1%}), epoch "
            f"{s['sweep_median_abs_error_epoch']:.1%}.",
        ]
    lines += ["", "## Machine", "", meta["machine"], ""]
    return "\n".join(lines)


def _range(candidate: dict[str, Any]) -> str:
    runs = candidate.get("epoch_range_s")
    return f"{runs[0]:.2f}-{runs[1]:.2f}" if runs else "n/a"


def _live_cells(selected: dict[str, Any]) -> str:
    live = selected.get("live_estimate_iteration_s")
    if live is None:
        return "n/a | n/a"
    return f"{live:.3f} | {error(live, selected['iteration_s']):+.1%}"


def finite(value: Any) -> Any:
    """``value`` with infinite floats (untrainable batch sizes in cost tables) as None,
    so that the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _columns(plan: Sequence[Sequence[int]]) -> tuple[str, str]:
    ps = {p for p, _ in plan}
    ns = {n for _, n in plan}
    return ("/".join(str(p) for p, _ in plan) if len(ps) > 1 else str(plan[0][0]),
            "/".join(str(n) for _, n in plan) if len(ns) > 1 else str(plan[0][1]))


def machine() -> str:
    """CPU, memory and versions, one line."""
    try:
        head = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=False, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        head = "?"
    return (f"{os.cpu_count()} cores ({_cpu_model()}), "
            f"python {platform.python_version()}, torch {torch.__version__}, git {head}")


def _cpu_model() -> str:
    """The CPU's model name (runs on different hosts differ by a third in speed)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    defaults = Settings()
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one case (vgg5 on wifi), 2 re-runs, 2 finalists")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--networks", default=",".join(NETWORKS))
    parser.add_argument("--devices", type=int, default=defaults.devices)
    parser.add_argument("--slowdown", type=float, default=defaults.slowdown)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--samples-per-device", type=int, default=defaults.samples_per_device)
    parser.add_argument("--repeats", type=int, default=defaults.repeats,
                        help="re-runs of each finalist")
    parser.add_argument("--finalists", type=int, default=defaults.finalists,
                        help="best sweep candidates re-run next to the planner's choice")
    parser.add_argument("--prune", type=float, default=defaults.prune,
                        help="stop sweep runs slower than this x the quickest (0: never)")
    parser.add_argument("--reference-samples", type=int, default=defaults.reference_samples,
                        help="samples of the reference epoch that S/T ref divides by")
    parser.add_argument("--no-exhaustive", action="store_true",
                        help="estimator accuracy only: run the planner's choice, no sweep")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory for planner_accuracy.md and .json")
    parser.add_argument("--stability", type=int, default=0, metavar="TIMES",
                        help="only profile and plan each case TIMES times: which plans "
                             "are chosen, how often (issue 27)")
    parser.add_argument("--profile-case", help=argparse.SUPPRESS)  # a fresh process's
    parser.add_argument("--profile-settings", help=argparse.SUPPRESS)  # profile_case
    args = parser.parse_args()
    if args.profile_case:
        costs, seconds = profile_case(RunConfig.from_mapping(json.loads(args.profile_case)),
                                      Settings(**json.loads(args.profile_settings)))
        print(json.dumps({"costs": costs.to_mapping(), "profile_s": seconds}))
        return
    models, networks = args.models.split(","), args.networks.split(",")
    if args.stability:
        stability(models, networks, Settings(devices=args.devices, slowdown=args.slowdown,
                                             batch_size=args.batch_size,
                                             samples_per_device=args.samples_per_device),
                  args.stability, args.out)
        return
    repeats, finalists = args.repeats, args.finalists
    if args.quick:
        models, networks, repeats, finalists = ["vgg5"], ["wifi"], 2, 2
    settings = Settings(devices=args.devices, slowdown=args.slowdown,
                        batch_size=args.batch_size, samples_per_device=args.samples_per_device,
                        repeats=repeats, finalists=finalists, prune=args.prune,
                        reference_samples=args.reference_samples)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    records = []
    for model in models:
        for network in networks:
            print(f"{model} on {network} (load {os.getloadavg()[0]:.2f})", flush=True)
            records.append(evaluate_case(model, network, settings,
                                         exhaustive=not args.no_exhaustive,
                                         say=lambda line: print(line, flush=True)))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join([".venv/bin/python bench/planner_accuracy.py", *sys.argv[1:]]),
        "cases": len(records),
        "wall_s": time.perf_counter() - started,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "settings": asdict(settings),
        "machine": machine(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_accuracy.md").write_text(markdown(records, meta))
    (args.out / "planner_accuracy.json").write_text(json.dumps(
        finite({"meta": meta, "summary": summary(records), "cases": records}), indent=1))
    print(markdown(records, meta))


if __name__ == "__main__":
    main()
