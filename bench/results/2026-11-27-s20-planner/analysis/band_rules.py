"""Session 20's offline look at rules for choosing N across a speed band ([Note: speed
band] in aiopipe/scheduler/select.py). Run from the repository root:

    PYTHONPATH=. BAND=1.25 .venv/bin/python ANALYSIS/band_rules.py profiles OUT.json
    PYTHONPATH=. BAND=1.25 .venv/bin/python ANALYSIS/band_rules.py bench-profiles ACC.json OUT.json
    python3 ANALYSIS/band_rules.py evaluate OUT.json ACC.json

``profiles``: five fresh profiles per planner-bench case (as `planner_accuracy.py` plans),
and for every N at the planner's split point the estimated epoch at the nine band points
(server x device speed factors in {1/BAND, 1, BAND}; index 4 is the profile's own).
``bench-profiles``: the same from the tables an accuracy run recorded. ``evaluate``:
several rules applied to those estimates; each picked plan is scored against the
accuracy run's measured epochs (finalists' medians; "(sweep)": one first-epoch run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

BAND = float(os.environ.get("BAND", "1.25"))
POINTS = [(s, d) for s in (1 / BAND, 1, BAND) for d in (1 / BAND, 1, BAND)]
RULES = [("raw", 0.0), ("worst_fewest", 0.03), ("worst_fewest", 0.02), ("worst_fewest", 0.01),
         ("worst_fewest_11", 0.03), ("worst_fewest_11", 0.02), ("worst_v11", 0.03),
         ("mean", 0.0), ("mean_fewest", 0.01), ("mean_fewest", 0.02), ("mean_fewest", 0.03)]


def band_estimates(model: Any, devices: Any, split: int) -> dict[int, list[float]]:
    """Per N dividing 32: the epoch estimates at the band's points (finite ones only)."""
    from planner_accuracy import divisors

    from aiopipe.scheduler import estimate_epoch
    per_n = {}
    for n in divisors(32):
        values = []
        for server, device in POINTS:
            scaled = dataclasses.replace(model, costs=model.costs.scaled(server))
            devs = [dataclasses.replace(d, slowdown=d.slowdown * device / server)
                    for d in devices]
            values.append(estimate_epoch(scaled, devs, [(split, n)] * len(devs), 32))
        if all(v < float("inf") for v in values):
            per_n[n] = values
    return per_n


def profiles(out: Path) -> None:
    """Five fresh profiles per case."""
    from planner_accuracy import MODELS, NETWORKS, Settings, divisors, plan_case

    from aiopipe.scheduler import select_plans
    settings, found = Settings(), {}
    for model in MODELS:
        for network in NETWORKS:
            rows = []
            for _ in range(5):
                planned = plan_case(settings.config(model, network), settings)
                raw = select_plans(planned.model, list(planned.devices), 32,
                                   parallel_batches=divisors(32), speed_band=1)
                split = planned.plan[0][0]
                rows.append({"chosen": [list(x) for x in planned.plan],
                             "raw": [list(x) for x in raw], "P": split,
                             "per_n": band_estimates(planned.model, planned.devices, split)})
                print(model, network, planned.plan[0], raw[0], flush=True)
            found[f"{model} {network}"] = rows
    out.write_text(json.dumps(found, indent=1))


def bench_profiles(accuracy: Path, out: Path) -> None:
    """The accuracy run's own tables, one profile per case."""
    from planner_accuracy import Settings

    from aiopipe.runtime.plan import (
        build_model,
        declared_devices,
        device_indices,
        model_profile,
        train_dataset,
    )
    from aiopipe.scheduler import CostTable

    def infinite(x: Any) -> Any:  # the bench writes inf as null
        if isinstance(x, dict):
            return {k: infinite(v) for k, v in x.items()}
        return float("inf") if x is None else x

    settings, found = Settings(), {}
    for case in json.loads(accuracy.read_text())["cases"]:
        config = settings.config(case["model"], case["network"])
        data = train_dataset(config)
        model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
        profile = model_profile(model, data.in_shape,
                                CostTable.from_mapping(infinite(case["costs"])))
        samples = [len(device_indices(config, data, k)) for k in range(config.devices)]
        split = case["selected"]["plan"][0][0]
        found[f"{case['model']} {case['network']}"] = [{
            "P": split,
            "per_n": band_estimates(profile, declared_devices(config, samples), split)}]
    out.write_text(json.dumps(found))


def pick(per_n: dict[str, list[float]], kind: str, tie: float, margin: float = 0.10) -> str:
    """The N a rule takes."""
    ns = sorted(per_n, key=int)
    own = {n: per_n[n][4] for n in ns}
    best_own = min(own.values())
    if kind == "raw":
        return min(ns, key=lambda n: own[n])
    trials = [n for n in ns if own[n] <= best_own * (1 + margin)]
    best = [min(column) for column in zip(*[per_n[n] for n in trials], strict=True)]
    worst = {n: max(v / b for v, b in zip(per_n[n], best, strict=True)) for n in trials}
    mean = {n: statistics.mean(v / b for v, b in zip(per_n[n], best, strict=True))
            for n in trials}
    regret = mean if kind.startswith("mean") else worst
    least = min(regret.values())
    near = [n for n in trials if regret[n] <= least * (1 + tie)]
    if kind == "worst_fewest_11":
        near = [n for n in near if own[n] <= best_own * (1 + tie)] or [min(trials, key=worst.get)]
    if kind in ("worst_v11", "mean"):
        return min(near, key=lambda n: own[n])
    return min(near, key=int)


def evaluate(estimates: Path, accuracy: Path) -> None:
    """Print each rule's picks, how often, and their scores."""
    band = json.loads(estimates.read_text())
    measured = {}
    for case in json.loads(accuracy.read_text())["cases"]:
        epochs = {}
        for cand in case["candidates"]:
            runs = cand.get("reruns") or ([cand["sweep"]] if cand.get("sweep") else [])
            if runs:
                epochs[tuple(cand["plan"][0])] = (
                    statistics.median(r["epoch_s"] for r in runs), bool(cand.get("reruns")))
        measured[f"{case['model']} {case['network']}"] = (epochs, case["optimum"]["epoch_s"])
    for kind, tie in RULES:
        print(f"== {kind} tie {tie}")
        stable = 0
        for key, rows in band.items():
            picks = [(r["P"], int(pick(r["per_n"], kind, tie))) for r in rows]
            epochs, optimum = measured[key]
            scores = []
            for plan in sorted(set(picks)):
                run = epochs.get(plan)
                scores.append(f"{plan}: {optimum / run[0]:.3f}{'' if run[1] else '(sweep)'}"
                              if run else f"{plan}: ?")
            stable += len(set(picks)) == 1
            counts = [picks.count(p) for p in sorted(set(picks))]
            print(f"  {key}: {sorted(set(picks))} x{counts} scores {scores}")
        print("  stable cases", stable)


def main() -> None:
    sys.path.insert(0, "bench")
    command, *paths = sys.argv[1:]
    if command == "profiles":
        profiles(Path(paths[0]))
    elif command == "bench-profiles":
        bench_profiles(Path(paths[0]), Path(paths[1]))
    else:
        evaluate(Path(paths[0]), Path(paths[1]))


if __name__ == "__main__":
    main()
