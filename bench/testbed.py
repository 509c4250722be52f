"""PiPar's paper testbed, emulated (issue 27): K devices x 500 samples each, every device
slowed to the paper's device/server ratio, the server on a core of its own, links of the
paper's 4G / 4G+ / WiFi; VGG-5, ResNet-18 and MobileNetV3-Small; next to the paper's
figures (`../shared/papers/pipar.txt` §5.2).

Three steps, each its own subcommand:

    .venv/bin/python bench/testbed.py virtual --out DIR [--jobs 16]
        Every mode and plan in virtual time, charged from a committed cost table of this
        host's CPU (``--costs``): FL; SFL at every split point; PiPar "auto"; PiPar at every
        fixed plan (P in 1..Q-1, N in ``--parallel-batches``). Deterministic: the figures
        are a function of the table, so this part may run on any machine (``--jobs``
        processes at once); rows go to ``DIR/virtual.jsonl`` as they finish.
    sudo .venv/bin/python bench/testbed.py processes --out DIR
        The same fleet as real processes over tc-shaped links (bench/shaped.py with
        ``--pin``: the server on CPU 0, the K device processes on the other CPUs), for FL,
        SFL at the virtual sweep's best split, PiPar "auto" and the virtual sweep's best
        fixed plan; results under ``DIR/processes/<model>-<network>-<modes>/`` (``--modes``:
        a part of them per call; the report merges the calls).
    .venv/bin/python bench/testbed.py report --out DIR
        ``DIR/report.md`` and plots like the paper's Figs. 4 and 6 (``DIR/notes.md``, the
        figures' reading written by hand, goes first).

The devices' slowdown (``--slowdown``, default 15.5 x K) is derived from the paper's
own figures, as a lower bound: with ResNet-18 PiPar's server runs nearly the whole model
for all of its devices, so PiPar's epoch is at least the server's time for every
device's samples, and FL's epoch (each device the whole model on its own samples) at
most the devices' compute plus the model's transfer. The paper's FL/PiPar of 15.5x at the
least for ResNet-18 (§5.2.1) then needs one device to be at least 15.5 x K times slower
than the server on the same pass. The paper's server is an 8-core i7 serving 100
devices; here one core serves K: the ratio is per the server's share of each device,
which is what shapes an epoch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # report.py and shaped.py beside it (bench/ is no package)
COSTS = BENCH / "results" / "2026-11-26-s18-gpu-costs" / "costs-cpu-this-host.json"
MODELS = ("vgg5", "resnet18", "mobilenetv3-small")
NETWORKS = ("4g", "4g+", "wifi")
BATCH = 100
#: The paper's speedups of PiPar (§5.2.1, over its three networks; the per-network
#: values are only in its plots) and its server-idle reductions (§5.2.2).
PAPER = {
    "vgg5": {"fl": (1.4, 3.4), "sfl": (1.4, 2.0)},
    "resnet18": {"fl": (15.5, 30.5), "sfl": (1.4, 2.2)},
    "mobilenetv3-small": {"fl": (10.5, 34.6), "sfl": (1.2, 2.3)},
}
PAPER_IDLE = "server idle time: PiPar up to 64.1x less than FL and 2.9x less than SFL"


def log(message: str) -> None:
    """One progress line, stamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def default_slowdown(devices: int) -> float:
    """The devices' slowdown derived from the paper (module docstring): 15.5 x K."""
    return PAPER["resnet18"]["fl"][0] * devices


# -- virtual time --------------------------------------------------------------------


def units_of(model: str) -> int:
    """How many units ``model`` has (split points 1..units-1)."""
    from aiopipe.models import build, unit_count

    return unit_count(build(model, num_classes=10, in_shape=(3, 32, 32)))


def specs(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Every run of the virtual sweep."""
    for model in args.models:
        units = units_of(model)
        for network in args.networks:
            base = {"model": model, "network": network}
            yield {**base, "mode": "fl"}
            yield {**base, "mode": "pipar", "split_point": "auto", "parallel_batches": "auto"}
            for p in range(1, units):
                yield {**base, "mode": "sfl", "split_point": p}
                for n in args.parallel_batches:
                    yield {**base, "mode": "pipar", "split_point": p, "parallel_batches": n}


def run_virtual(spec: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """One virtual-time run (in a worker process); its row."""
    import torch

    from aiopipe import CostTable, RunConfig, VirtualClock, simulate

    torch.set_num_threads(1)
    tables = json.loads(Path(settings["costs"]).read_text())
    table = CostTable.from_mapping(tables[spec["model"]]["table"])
    extra = {k: v for k, v in spec.items() if k in ("split_point", "parallel_batches")}
    config = RunConfig(mode=spec["mode"], model=spec["model"], devices=settings["devices"],
                       samples_per_device=settings["samples"], batch_size=BATCH, epochs=1,
                       device_slowdown=settings["slowdown"], network=spec["network"],
                       test_samples=0, heartbeat_interval=30.0, device_timeout=1e6,
                       seed=settings["seed"], **extra)
    started = time.perf_counter()
    result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=table,
                                  progress=lambda metrics: None))
    epoch = result.epochs[-1]
    plans = sorted({(p["split_point"], p["parallel_batches"]) for p in epoch.plan or []})
    return {**spec, "epoch_s": epoch.time_s, "busy_s": dict(epoch.busy_s),
            "idle_s": dict(epoch.idle_s), "plans": plans,
            "wall_s": round(time.perf_counter() - started, 1)}


def virtual(args: argparse.Namespace) -> None:
    """Run the virtual sweep; rows into ``virtual.jsonl`` (runs already there are kept)."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "virtual.jsonl"
    done = {_key(row) for row in _rows(path)}
    todo = [s for s in specs(args) if _key(s) not in done]
    settings = {"costs": str(args.costs), "devices": args.devices, "samples": args.samples,
                "slowdown": args.slowdown, "seed": args.seed}
    (args.out / "virtual-settings.json").write_text(json.dumps(
        {**settings, "costs": str(args.costs.relative_to(REPO)) if args.costs.is_relative_to(
            REPO) else str(args.costs), "batch_size": BATCH, "python": sys.version.split()[0],
         "cpus": os.cpu_count()}, indent=1))
    log(f"virtual sweep: {len(todo)} runs ({len(done)} already done), {args.jobs} at once")
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool, open(path, "a") as out:
        futures = {pool.submit(run_virtual, spec, settings): spec for spec in todo}
        for i, future in enumerate(as_completed(futures), 1):
            spec = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # a plan that cannot run (memory, table) is a row too
                row = {**spec, "error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(row) + "\n")
            out.flush()
            if i % 20 == 0 or i == len(todo):
                log(f"  {i}/{len(todo)} runs, {time.perf_counter() - started:.0f} s")


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["model"], row["network"], row["mode"], row.get("split_point"),
            row.get("parallel_batches"))


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def best(rows: Sequence[dict[str, Any]], model: str, network: str,
         mode: str, fixed: bool = True) -> dict[str, Any] | None:
    """The quickest run of ``mode`` for one cell (fixed plans only, or "auto" only)."""
    cell = [r for r in rows if r["model"] == model and r["network"] == network
            and r["mode"] == mode and "error" not in r
            and (r.get("split_point") != "auto") == fixed]
    return min(cell, key=lambda r: r["epoch_s"]) if cell else None


# -- real processes ------------------------------------------------------------------


def processes(args: argparse.Namespace) -> None:
    """Run each cell's FL, best SFL, PiPar auto and best fixed PiPar as real processes."""
    rows = _rows(args.out / "virtual.jsonl")
    needs_sweep = any(m in args.modes for m in ("sfl", "pipar"))
    if needs_sweep and not rows:
        raise SystemExit(f"no virtual sweep in {args.out}: run `testbed.py virtual` first")
    for model in args.models:
        for network in args.networks:
            sfl, fixed = best(rows, model, network, "sfl"), best(rows, model, network, "pipar")
            if needs_sweep and (sfl is None or fixed is None):
                log(f"{model} {network}: not in the virtual sweep, skipped")
                continue
            out = args.out / "processes" / f"{model}-{network}-{args.modes.replace(',', '-')}"
            if (out / "report.md").exists():
                log(f"{model} {network}: done already ({out})")
                continue
            argv = [sys.executable, str(BENCH / "shaped.py"), "--workloads", model,
                    "--networks", network, "--fleet", "homogeneous", "--modes", args.modes,
                    "--sfl-splits", str(sfl["split_point"]) if sfl else "all",
                    "--pipar-fixed",
                    f"{fixed['split_point']},{fixed['parallel_batches']}" if fixed else "none",
                    "--devices", str(args.devices), "--samples-per-device", str(args.samples),
                    "--batch-size", str(BATCH), "--epochs", str(args.epochs),
                    "--device-slowdown", f"{args.slowdown:g}", "--seed", str(args.seed),
                    "--pin", "--no-flower", "--out", str(out)]
            log(f"{model} {network}: {' '.join(argv[1:])}")
            subprocess.run(argv, check=True, cwd=REPO)


# -- report --------------------------------------------------------------------------


def _process_runs(out: Path, model: str, network: str) -> dict[str, Any] | None:
    """The shaped.py runs of one cell (every ``processes`` call's, merged), or None."""
    runs: dict[str, Any] = {}
    for raw in sorted((out / "processes").glob(f"{model}-{network}-*/raw.json")):
        for config in json.loads(raw.read_text()).get("configurations") or []:
            runs.update(config["runs"])
    return {"config": {"runs": runs}} if runs else None


def _ratio(a: float | None, b: float | None) -> str:
    import report

    return str(report._ratio(a, b))


def _s(value: float | None) -> str:
    import report

    return str(report._fmt(value, ".1f"))


def _paper(model: str) -> str:
    """The paper's FL÷PiPar and SFL÷PiPar ranges for ``model``, as two table cells."""
    fl, sfl = PAPER[model]["fl"], PAPER[model]["sfl"]
    return f"{fl[0]}–{fl[1]}× | {sfl[0]}–{sfl[1]}×"


def _plan(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    plans = row.get("plans") or []
    if row["mode"] == "sfl":
        return f"P{row['split_point']}"
    fixed = f"P{row['split_point']}N{row['parallel_batches']}"
    return ", ".join(f"P{p}N{n}" for p, n in plans) or fixed


def virtual_table(rows: Sequence[dict[str, Any]], models: Sequence[str],
                  networks: Sequence[str]) -> tuple[list[str], dict[tuple[str, str], Any]]:
    """The virtual sweep's table (markdown lines) and its figures per cell."""
    lines = ["| model | network | FL s | SFL best s (P) | PiPar auto s (plan) | "
             "PiPar best fixed s (plan) | FL÷PiPar | SFL÷PiPar | paper FL÷PiPar | "
             "paper SFL÷PiPar | auto ÷ best fixed | server idle s FL / SFL / PiPar |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|"]
    cells = {}
    for model in models:
        for network in networks:
            fl = best(rows, model, network, "fl")
            sfl = best(rows, model, network, "sfl")
            auto = best(rows, model, network, "pipar", fixed=False)
            fixed = best(rows, model, network, "pipar")
            if not (fl and sfl and auto and fixed):
                continue
            cells[model, network] = {"fl": fl, "sfl": sfl, "pipar": auto, "fixed": fixed}
            idle = " / ".join(_s(r["idle_s"]["server"]) for r in (fl, sfl, auto))
            lines.append(
                f"| {model} | {network} | {_s(fl['epoch_s'])} | {_s(sfl['epoch_s'])} "
                f"({_plan(sfl)}) | {_s(auto['epoch_s'])} ({_plan(auto)}) | "
                f"{_s(fixed['epoch_s'])} ({_plan(fixed)}) | "
                f"{_ratio(fl['epoch_s'], auto['epoch_s'])} | "
                f"{_ratio(sfl['epoch_s'], auto['epoch_s'])} | "
                f"{_paper(model)} | {auto['epoch_s'] / fixed['epoch_s']:.2f} | {idle} |")
    return lines, cells


def _cell(mode: str, runs: dict[str, Any], times: dict[str, float | None]) -> str:
    """One mode's seconds (and plan) in the processes' table."""
    import report

    t = times.get(mode)
    if t is None:
        return "–"
    label, run = runs[mode]
    if mode == "fl":
        return f"{t:.1f}"
    plan = report._plan(run) if mode == "pipar" else label.split(" ", 1)[-1]
    return f"{t:.1f} ({plan})"


def process_table(out: Path, models: Sequence[str], networks: Sequence[str]
                  ) -> tuple[list[str], dict[tuple[str, str], Any]]:
    """The real processes' table (markdown lines) and their runs per cell."""
    import report

    lines = ["| model | network | FL s | SFL s (P) | PiPar auto s (plan) | "
             "PiPar fixed s (plan) | FL÷PiPar | SFL÷PiPar | paper FL÷PiPar | "
             "paper SFL÷PiPar | server idle s FL / SFL / PiPar | busiest resource of "
             "PiPar auto: busy s (÷ epoch) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    cells = {}
    for model in models:
        for network in networks:
            found = _process_runs(out, model, network)
            if found is None:
                continue
            runs = report.mode_runs(found["config"])
            t = {m: report.mean(run, "time_s") for m, (_, run) in runs.items()
                 if report.ok(run)}
            cells[model, network] = {m: run for m, (_, run) in runs.items()}
            idle = " / ".join(_s(report.mean(runs[m][1], "idle_s", "server"))
                              if m in runs else "–" for m in ("fl", "sfl", "pipar"))
            bound = "–"
            if "pipar" in runs and t.get("pipar"):
                busy = {r: report.mean(runs["pipar"][1], "busy_s", r) or 0.0
                        for r in report.RESOURCES}
                top = max(busy, key=lambda r: busy[r])
                bound = f"{top}: {busy[top]:.1f} ({busy[top] / t['pipar']:.2f})"
            shown = [_cell(mode, runs, t) for mode in ("fl", "sfl", "pipar", "fixed")]
            lines.append(
                f"| {model} | {network} | {' | '.join(shown)} | "
                f"{_ratio(t.get('fl'), t.get('pipar'))} | "
                f"{_ratio(t.get('sfl'), t.get('pipar'))} | {_paper(model)} | {idle} | {bound} |")
    return lines, cells


def plot(cells: dict[tuple[str, str], Any], models: Sequence[str], networks: Sequence[str],
         path: Path, title: str, figure: str) -> Path | None:
    """Grouped bars per model (one panel each): epoch seconds per mode and network (the
    paper's Fig. 4), or server idle above / device idle below the axis (its Fig. 6).
    ``cells`` maps (model, network) to rows with ``epoch_s`` / ``idle_s`` (virtual) or to
    shaped.py runs (processes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import report

    shown = [m for m in models if any((m, n) in cells for n in networks)]
    if not shown:
        return None
    modes = ("fl", "sfl", "pipar")
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.6), squeeze=False)
    for ax, model in zip(axes[0], shown, strict=True):
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs, up, down = [], [], []
            for j, network in enumerate(networks):
                run = cells.get((model, network), {}).get(mode)
                if run is None:
                    continue
                xs.append(j + (i - 1) * width)
                if "epoch_s" in run:  # a virtual row
                    up.append(run["epoch_s"] if figure == "time" else run["idle_s"]["server"])
                    down.append(run["idle_s"]["device"])
                else:
                    key = "time_s" if figure == "time" else "idle_s"
                    up.append(report.mean(run, key, None if figure == "time" else "server")
                              or 0.0)
                    down.append(report.mean(run, "idle_s", "device") or 0.0)
            color = report.COLORS[mode]
            ax.bar(xs, up, width, label=report.MODE_NAMES[mode], color=color)
            if figure == "idle":
                ax.bar(xs, [-d for d in down], width, color=color, alpha=0.45)
        ax.set_xticks(range(len(networks)), networks)
        ax.set_title(model)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylabel("epoch s" if figure == "time" else "idle s per epoch (S up, D down)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(args: argparse.Namespace) -> Path:
    """Tables and plots from what is in ``args.out``; the report's path."""
    rows = _rows(args.out / "virtual.jsonl")
    vlines, vcells = virtual_table(rows, args.models, args.networks)
    plines, pcells = process_table(args.out, args.models, args.networks)
    settings_path = args.out / "virtual-settings.json"
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    figures = []
    for cells, stem, label in ((vcells, "virtual", "virtual time"),
                               (pcells, "processes", "real processes, tc links")):
        for figure, name in (("time", "epoch time (cf. paper Fig. 4)"),
                             ("idle", "idle time (cf. paper Fig. 6)")):
            path = plot(cells, args.models, args.networks, args.out / f"{stem}-{figure}.png",
                        f"{label}: {name}", figure)
            if path is not None:
                figures.append(f"![{label}: {name}]({path.name})")
    notes = args.out / "notes.md"  # the reading of the figures, written by hand
    lines = ["# PiPar's paper testbed, emulated (issue 27)", "",
             *([notes.read_text().rstrip(), ""] if notes.exists() else []),
             f"Settings of the virtual sweep: {json.dumps(settings)}", "",
             "## Virtual time (every plan)", "",
             *vlines, "", "## Real processes over tc-shaped links", "", *plines, "",
             f"Paper: {PAPER_IDLE}.", "", *figures, ""]
    path = args.out / "report.md"
    path.write_text("\n".join(lines))
    return path


# -- command line --------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The bench's options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("step", choices=("virtual", "processes", "report"))
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--networks", default=",".join(NETWORKS))
    parser.add_argument("--devices", type=int, default=8, help="K (default 8)")
    parser.add_argument("--samples", type=int, default=500, help="per device (default 500)")
    parser.add_argument("--slowdown", type=float, help="device slowdown (default 15.5 x K)")
    parser.add_argument("--parallel-batches", default="1,2,5,10,20",
                        help="N of the fixed PiPar plans swept (virtual)")
    parser.add_argument("--costs", type=Path, default=COSTS, help="cost tables (virtual)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--epochs", type=int, default=2, help="per process run (default 2)")
    parser.add_argument("--modes", default="fl,sfl,pipar", help="process runs' modes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.networks = [n for n in args.networks.split(",") if n]
    args.parallel_batches = [int(n) for n in args.parallel_batches.split(",") if n]
    bad = [m for m in args.models if m not in MODELS] + [
        n for n in args.networks if n not in NETWORKS]
    if bad:
        parser.error(f"unknown models or networks: {bad}")
    if args.slowdown is None:
        args.slowdown = default_slowdown(args.devices)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one step."""
    args = parse(argv)
    if args.step == "virtual":  # may run where matplotlib is not: no report here
        virtual(args)
        return 0
    if args.step == "processes":
        processes(args)
    log(f"report {write_report(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
