"""Two checkouts side by side in one run: did a change lose anything?

Runs the same benches against an old and a new checkout of aiopipe, interleaved so that a
change of machine load hits both alike, and prints their figures next to each other:

- ``epochs``: `bench/epochs.py`'s runs (``python -m aiopipe`` between real processes:
  pipar, sfl and fl with its default settings), each mode ``--repeats`` times per
  checkout, alternating old/new run by run; per mode the mean epoch time of each
  checkout over its repeats, their spread (min-max) and new / old;
- ``planner``: `bench/planner_accuracy.py` per model (its three networks), old and new
  in turn (which goes first alternates by model); per case the plan each chose, its
  score, and its estimated vs measured iteration error, and the summaries.

Each checkout runs its own code: ``PYTHONPATH=<checkout>`` and its own bench script, with
this interpreter (make one checkout with ``git worktree add /tmp/old <commit>``).

    .venv/bin/python bench/checkouts.py --old /tmp/old --new . [--bench epochs,planner]
        [--repeats 2] [--models vgg5,resnet18,mobilenetv3-small] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: (label, ``python -m aiopipe`` options) of the epochs bench, at its defaults.
EPOCH_MODES = (
    ("pipar P=2 N=4", ["--mode", "pipar", "--split-point", "2", "--parallel-batches", "4"]),
    ("sfl P=2", ["--mode", "sfl", "--split-point", "2"]),
    ("fl", ["--mode", "fl"]),
)
EPOCH_COMMON = ["--model", "vgg5", "--devices", "2", "--samples-per-device", "1000",
                "--batch-size", "50", "--epochs", "3", "--network", "4g",
                "--device-slowdown", "4", "--seed", "0"]


def _env(checkout: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(checkout)
    return env


def _git(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def epoch_times(old: Path, new: Path, repeats: int, log: list[str]) -> dict[str, Any]:
    """Mean epoch time (epochs 2..) per mode and checkout, runs interleaved."""
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="aiopipe-checkouts-") as tmp:
        for rep in range(repeats):
            for label, options in EPOCH_MODES:
                order = [("old", old), ("new", new)] if rep % 2 == 0 else [("new", new),
                                                                           ("old", old)]
                for name, checkout in order:
                    out = Path(tmp) / f"{name}-{rep}-{label.split()[0]}"
                    command = [sys.executable, "-m", "aiopipe", *options, *EPOCH_COMMON,
                               "--out-dir", str(out)]
                    done = subprocess.run(command, cwd=checkout, env=_env(checkout),
                                          capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        raise SystemExit(f"{name} {label} failed:\n{done.stdout}{done.stderr}")
                    epochs = [json.loads(line) for line in
                              (out / "metrics.jsonl").read_text().splitlines()]
                    mean = statistics.mean(e["time_s"] for e in epochs[1:])
                    times.setdefault((label, name), []).append(mean)
                    line = (f"  {label:<14} {name}: {mean:.3f} s/epoch "
                            f"(load {os.getloadavg()[0]:.2f})")
                    log.append(line)
                    print(line, flush=True)
    table = {}
    for label, _ in EPOCH_MODES:
        o, n = times[(label, "old")], times[(label, "new")]
        table[label] = {"old": o, "new": n, "ratio": statistics.mean(n) / statistics.mean(o)}
    return table


def planner(old: Path, new: Path, models: list[str], out: Path, log: list[str]
            ) -> dict[str, Any]:
    """`planner_accuracy.py` per model, both checkouts in turn."""
    results: dict[str, dict[str, Any]] = {"old": {}, "new": {}}
    for i, model in enumerate(models):
        order = [("old", old), ("new", new)] if i % 2 == 0 else [("new", new), ("old", old)]
        for name, checkout in order:
            target = out / f"planner-{name}-{model}"
            command = [sys.executable, str(checkout / "bench" / "planner_accuracy.py"),
                       "--models", model, "--out", str(target)]
            started = time.perf_counter()
            done = subprocess.run(command, cwd=checkout, env=_env(checkout),
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{name} planner {model} failed:\n{done.stdout}{done.stderr}")
            data = json.loads((target / "planner_accuracy.json").read_text())
            results[name][model] = data
            line = (f"  planner {model} {name}: {time.perf_counter() - started:.0f} s, "
                    f"score min {data['summary']['score_min']:.3f}")
            log.append(line)
            print(line, flush=True)
    return results


def _planner_rows(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = [f"{'case':<28} {'old plan':<16} {'new plan':<16} {'old score':>9} "
            f"{'new score':>9} {'old err':>8} {'new err':>8}"]
    for model, data in results["new"].items():
        old_cases = {(c["model"], c["network"]): c for c in results["old"][model]["cases"]}
        for case in data["cases"]:
            before = old_cases[(case["model"], case["network"])]

            def err(c: dict[str, Any]) -> float:
                s = c["selected"]
                return (s["estimate_iteration_s"] - s["iteration_s"]) / s["iteration_s"]

            def plan(c: dict[str, Any]) -> str:
                return " ".join(f"P{p}N{n}" for p, n in c["selected"]["plan"])

            rows.append(f"{case['model'] + ' ' + case['network']:<28} {plan(before):<16} "
                        f"{plan(case):<16} {before['score']:>9.3f} {case['score']:>9.3f} "
                        f"{err(before):>+8.1%} {err(case):>+8.1%}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--old", type=Path, required=True, help="the old checkout")
    parser.add_argument("--new", type=Path, default=Path("."), help="the new checkout")
    parser.add_argument("--bench", default="epochs,planner")
    parser.add_argument("--repeats", type=int, default=2, help="epochs: runs per mode")
    parser.add_argument("--models", default="vgg5,resnet18,mobilenetv3-small")
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkouts"))
    args = parser.parse_args()
    old, new = args.old.resolve(), args.new.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    benches = args.bench.split(",")
    log: list[str] = []
    header = (f"checkouts: old {old} ({_git(old)}), new {new} ({_git(new)}); "
              f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    print(header, flush=True)
    report = [header, ""]
    if "epochs" in benches:
        table = epoch_times(old, new, args.repeats, log)
        report += ["epochs (vgg5, 2 devices x 1000, B=50, 4g, slowdown 4; mean s/epoch over "
                   "epochs 2-3, each run; new/old of the means):"]
        for label, row in table.items():
            report.append(f"  {label:<14} old {' '.join(f'{t:.3f}' for t in row['old'])}  "
                          f"new {' '.join(f'{t:.3f}' for t in row['new'])}  "
                          f"new/old {row['ratio']:.3f}")
        report.append("")
    if "planner" in benches:
        results = planner(old, new, args.models.split(","), args.out, log)
        report += ["planner accuracy (selected plan, score, iteration error of the "
                   "selected plan):", *_planner_rows(results), ""]
    report.append(f"load average at the end {os.getloadavg()[0]:.2f}")
    report += ["", "log:", *log]
    (args.out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
