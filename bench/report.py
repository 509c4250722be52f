"""The report of bench/shaped.py: ``report.md`` with the tables and PNG plots, from
``raw.json`` in a results directory.

    .venv/bin/python bench/report.py bench/results/<YYYY-MM-DD>   # (re)write the report
    .venv/bin/python bench/report.py --summary bench/results/*/   # one table over runs

Figures per run are means over the epochs after the first (the first carries process
warm-up and the first model transfer), or the only epoch when a run has one. Busy/idle
seconds are per epoch, per resource (device, uplink and downlink: means over devices).

Link figures under tc shaping. aiopipe times a transfer at the sender, from the moment
it is queued until the socket took the last byte. With tc shaping the kernel buffers
what the wire has not carried yet, so a small message "finishes" before it is on the
wire (the harness keeps that buffer small with ``tcp_notsent_lowat``, see
bench/netns.py). The report therefore also gives each link's *wire* time estimated as
bytes carried / the probed rate of that link, and the idle plot uses that estimate for
the links when the links were shaped by tc.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESOURCES = ("device", "uplink", "server", "downlink")
MODES = ("fl", "flower", "sfl", "pipar", "fixed")
MODE_NAMES = {
    "fl": "FL (aiopipe)",
    "flower": "FL (Flower)",
    "sfl": "SFL (best P)",
    "pipar": "PiPar (auto)",
    "fixed": "PiPar (fixed)",
}
COLORS = {
    "fl": "#4C72B0",
    "flower": "#8C8C8C",
    "sfl": "#DD8452",
    "pipar": "#55A868",
    "fixed": "#8172B2",
}

Run = dict[str, Any]


def measured(run: Run) -> list[dict[str, Any]]:
    """The epochs a run's figures average over."""
    epochs: list[dict[str, Any]] = run.get("epochs") or []
    return epochs[1:] or epochs


def mean(run: Run, key: str, resource: str | None = None) -> float | None:
    """Mean of ``key`` (or ``key[resource]``) over the measured epochs; None if absent."""
    values = [
        e[key][resource] if resource else e[key]
        for e in measured(run)
        if key in e and e[key] is not None
    ]
    return sum(values) / len(values) if values else None


def ok(run: Run | None) -> bool:
    """Whether a run finished with figures."""
    return run is not None and "error" not in run and bool(run.get("epochs"))


def mode_runs(config: dict[str, Any]) -> dict[str, tuple[str, Run]]:
    """One run per mode: fl, flower, the best sfl, pipar (auto), the fixed-plan pipar."""
    runs = config["runs"]
    out = {m: (m, runs[m]) for m in ("fl", "flower", "pipar") if m in runs}
    sfl = [(label, r) for label, r in runs.items() if label.startswith("sfl") and ok(r)]
    if sfl:
        out["sfl"] = min(sfl, key=lambda item: _epoch(item[1]))
    fixed = [(label, r) for label, r in runs.items() if label.startswith("pipar P=") and ok(r)]
    if fixed:  # the best of the fixed plans run
        out["fixed"] = min(fixed, key=lambda item: _epoch(item[1]))
    return out


def fixed_plans(setting: Any) -> str:
    """The ``--pipar-fixed`` setting as text: one [P, N] (earlier raw.json), a list of
    them, or none."""
    if not setting:
        return "none"
    pairs = [setting] if isinstance(setting[0], int) else setting
    return "; ".join(f"P={p} N={n}" for p, n in pairs)


def _label(mode: str, label: str) -> str:
    if mode == "sfl":
        return f"SFL ({label.split()[-1]})"
    if mode == "fixed":
        return f"PiPar ({label.removeprefix('pipar ')})"
    return MODE_NAMES[mode]


def _plan(run: Run) -> str:
    epochs = run.get("epochs") or []
    plans = epochs[-1].get("plan") if epochs else None
    if not plans:
        return ""
    pairs = sorted({(p["split_point"], p["parallel_batches"]) for p in plans})
    if len(pairs) == 1:
        return f"P={pairs[0][0]} N={pairs[0][1]}"
    return " ".join(f"d{p['device']}:P{p['split_point']}N{p['parallel_batches']}" for p in plans)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def probed(raw: dict[str, Any], network: str, direction: str) -> float | None:
    """Mean probed Mbit/s of one direction ("up"/"down", each on its own) of a network."""
    rates = [
        p["mbps"]
        for p in raw["networks"].get(network, {}).get("probe", [])
        if p["direction"] == direction
    ]
    return sum(rates) / len(rates) if rates else None


def wire_s(raw: dict[str, Any], config: dict[str, Any], run: Run, direction: str) -> float | None:
    """Estimated seconds per epoch each device's link carried bytes: bytes / probed rate."""
    rate = probed(raw, config["network"], direction)
    carried = mean(run, "bytes_up" if direction == "up" else "bytes_down")
    if rate is None or carried is None:
        return None
    devices: int = raw["settings"]["devices"]
    return carried / devices * 8 / (rate * 1e6)


# -- tables -----------------------------------------------------------------------------


def _probe_table(raw: dict[str, Any]) -> list[str]:
    rows = [
        "| network | direction | tbf rate Mbit/s | measured Mbit/s per device | mean |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for network, info in raw["networks"].items():
        for direction in ("up", "down", "up (both)", "down (both)"):
            rates = [p["mbps"] for p in info.get("probe", []) if p["direction"] == direction]
            if not rates:
                continue
            target = info["up_mbps"] if direction.startswith("up") else info["down_mbps"]
            rows.append(
                f"| {network} | {direction} | {target:g} | "
                f"{', '.join(f'{r:.1f}' for r in rates)} | {sum(rates) / len(rates):.1f} |"
            )
    return rows


def _epoch_table(configs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| network | fleet | FL | Flower FL | SFL best | PiPar auto (plan) | PiPar fixed | "
        "FL÷PiPar | SFL÷PiPar | Flower÷FL |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in configs:
        m = mode_runs(c)
        t = {k: mean(r, "time_s") if ok(r) else None for k, (_, r) in m.items()}
        fixed = (
            f"{_fmt(t.get('fixed'))} ({m['fixed'][0].removeprefix('pipar ')})"
            if "fixed" in m
            else "–"
        )
        times, ratios = _headline(m, t)
        rows.append(f"| {c['network']} | {c['fleet']} | {times} | {fixed} | {ratios} |")
    return rows


def _headline(runs: dict[str, tuple[str, Run]],
              t: dict[str, float | None]) -> tuple[str, str]:
    """Table cells from a mode's (label, run) and epoch time: "FL | Flower | SFL best (P)
    | PiPar auto (plan)" and "FL÷PiPar | SFL÷PiPar | Flower÷FL"."""
    sfl = f"{_fmt(t.get('sfl'))} ({runs['sfl'][0].split()[-1]})" if "sfl" in runs else "–"
    pipar = f"{_fmt(t.get('pipar'))} ({_plan(runs['pipar'][1])})" if "pipar" in runs else "–"
    return (
        f"{_fmt(t.get('fl'))} | {_fmt(t.get('flower'))} | {sfl} | {pipar}",
        f"{_ratio(t.get('fl'), t.get('pipar'))} | {_ratio(t.get('sfl'), t.get('pipar'))} | "
        f"{_ratio(t.get('flower'), t.get('fl'))}",
    )


def _accuracy_table(configs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| network | fleet | FL | Flower FL | SFL best | PiPar auto | PiPar fixed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in configs:
        m = mode_runs(c)
        acc = {k: r["epochs"][-1].get("accuracy") if ok(r) else None for k, (_, r) in m.items()}
        cells = " | ".join(_fmt(acc.get(k), ".3f") for k in MODES)
        rows.append(f"| {c['network']} | {c['fleet']} | {cells} |")
    return rows


def _idle_table(raw: dict[str, Any], configs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| network | fleet | mode | epoch s | "
        + " | ".join(f"{r} busy / idle s" for r in RESOURCES)
        + " | up / down wire s (est.) | MB up | MB down | wall s |",
        "| --- | --- | --- | ---: | "
        + " | ".join("---:" for _ in RESOURCES)
        + " | ---: | ---: | ---: | ---: |",
    ]
    for c in configs:
        for mode, (label, run) in mode_runs(c).items():
            if mode == "flower" or not ok(run):
                continue
            cells = " | ".join(
                f"{_fmt(mean(run, 'busy_s', r))} / {_fmt(mean(run, 'idle_s', r))}"
                for r in RESOURCES
            )
            wire = f"{_fmt(wire_s(raw, c, run, 'up'))} / {_fmt(wire_s(raw, c, run, 'down'))}"
            up, down = mean(run, "bytes_up") or 0.0, mean(run, "bytes_down") or 0.0
            rows.append(
                f"| {c['network']} | {c['fleet']} | {label} | {_fmt(mean(run, 'time_s'))} | "
                f"{cells} | {wire} | {up / 1e6:.1f} | {down / 1e6:.1f} | {run['wall_s']:.0f} |"
            )
    return rows


def _sfl_table(configs: list[dict[str, Any]]) -> list[str]:
    splits = sorted(
        {label for c in configs for label in c["runs"] if label.startswith("sfl")},
        key=lambda s: int(s.split("=")[-1]),
    )
    if not splits:
        return []
    rows = [
        "| network | fleet | " + " | ".join(splits) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in splits) + " |",
    ]
    for c in configs:
        cells = []
        for label in splits:
            run = c["runs"].get(label)
            cells.append(_fmt(mean(run, "time_s")) if ok(run) else ("failed" if run else "–"))
        rows.append(f"| {c['network']} | {c['fleet']} | " + " | ".join(cells) + " |")
    return rows


def _failures(raw: dict[str, Any]) -> list[str]:
    return [
        f"- {c['workload']} {c['network']} {c['fleet']} {label}: {run['error']}"
        for c in raw["configurations"]
        for label, run in c["runs"].items()
        if "error" in run
    ]


# -- plots ------------------------------------------------------------------------------


def plot_epoch_times(raw: dict[str, Any], path: Path) -> Path | None:
    """Bars: epoch time per mode, grouped by network; one panel per (workload, fleet)."""
    order = list(raw["settings"]["workloads"])
    panels = sorted(
        {(c["workload"], c["fleet"]) for c in raw["configurations"]},
        key=lambda p: (order.index(p[0]), list(raw["fleets"]).index(p[1])),
    )
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.4), squeeze=False)
    width = 0.8 / len(MODES)
    for ax, (workload, fleet) in zip(axes[0], panels, strict=True):
        configs = [
            c for c in raw["configurations"] if c["workload"] == workload and c["fleet"] == fleet
        ]
        for i, mode in enumerate(MODES):
            xs, ys = [], []
            for j, c in enumerate(configs):
                pair = mode_runs(c).get(mode)
                value = mean(pair[1], "time_s") if pair and ok(pair[1]) else None
                if value is not None:
                    xs.append(j + (i - (len(MODES) - 1) / 2) * width)
                    ys.append(value)
            if xs:
                bars = ax.bar(xs, ys, width, label=MODE_NAMES[mode], color=COLORS[mode])
                ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(configs)), [c["network"] for c in configs])
        ax.set_title(f"{workload}, {fleet} fleet")
        ax.set_ylabel("epoch time (s)")
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    fig.suptitle("Epoch time over tc-shaped links (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_idle_times(raw: dict[str, Any], path: Path) -> Path | None:
    """Bars: idle seconds per epoch per resource and mode; one panel per configuration."""
    configs = raw["configurations"]
    if not configs:
        return None
    modes = ("fl", "sfl", "pipar", "fixed")
    shaped_by_tc = any(info.get("probe") for info in raw["networks"].values())
    cols = min(2 if len(configs) <= 4 else 3, len(configs))
    rows = (len(configs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.9 * rows), squeeze=False)
    width = 0.8 / len(modes)
    for ax, c in zip(axes.flat, configs, strict=False):
        m = mode_runs(c)
        for i, mode in enumerate(modes):
            if mode not in m or not ok(m[mode][1]):
                continue
            run = m[mode][1]
            time_s = mean(run, "time_s") or 0.0
            ys = []
            for r in RESOURCES:
                wire = wire_s(raw, c, run, r[:-4]) if r in ("uplink", "downlink") else None
                if shaped_by_tc and wire is not None:
                    ys.append(max(0.0, time_s - wire))
                else:
                    ys.append(mean(run, "idle_s", r) or 0.0)
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(RESOURCES))]
            ax.bar(xs, ys, width, label=MODE_NAMES[mode], color=COLORS[mode])
        names = [f"{r}*" if shaped_by_tc and r.endswith("link") else r for r in RESOURCES]
        ax.set_xticks(range(len(RESOURCES)), names)
        ax.set_ylabel("idle s per epoch")
        plans = ", ".join(_label(mode, m[mode][0]) for mode in ("sfl", "fixed") if mode in m)
        ax.set_title(f"{c['workload']}, {c['network']}, {c['fleet']}\n{plans}", fontsize=9)
    for ax in list(axes.flat)[len(configs) :]:
        ax.axis("off")
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8
    )
    note = " *: epoch − bytes/probed rate" if shaped_by_tc else ""
    fig.suptitle(
        "Idle time per resource per epoch (device and links: mean over devices; lower is "
        f"better){note}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(
    out: Path, raw: dict[str, Any], path: Path, *, mode: str, iterations: tuple[int, int]
) -> str | None:
    """PiPar Fig. 2 from a real run: a window of a pipar run's trace.json; its caption."""
    from aiopipe.metrics.timeline import draw_timeline
    from aiopipe.timeline import load_trace, select_window

    for c in raw["configurations"]:
        pair = mode_runs(c).get(mode)
        if pair is None or not ok(pair[1]) or "trace" not in pair[1]:
            continue
        run = pair[1]
        epoch = len(run["epochs"]) - 1
        window = select_window(load_trace(out / run["trace"]), epoch=epoch, iterations=iterations)
        if not any(e.get("ph") == "X" for e in window["traceEvents"]):
            continue
        first, last = iterations[0] + 1, iterations[1] + 1
        span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
        title = (
            f"PiPar {c['workload']}, {c['network']}, {c['fleet']} fleet, {_plan(run)}: "
            f"epoch {epoch + 1}, {span}"
        )
        draw_timeline(window, path, title=title)
        return f"{title} (from `{run['trace']}`)"
    return None


# -- report ---------------------------------------------------------------------------


def write_report(out: Path) -> Path:
    """Write ``report.md`` and the PNGs in ``out`` from ``out/raw.json``; the report's path.

    Raises:
        OSError: raw.json cannot be read or the report cannot be written.
    """
    raw = json.loads((out / "raw.json").read_text())
    s, m = raw["settings"], raw["machine"]
    pngs: list[tuple[str, str]] = []
    if plot_epoch_times(raw, out / "epoch_time.png"):
        pngs.append(("epoch_time.png", "Epoch time per mode and network."))
    if plot_idle_times(raw, out / "idle_time.png"):
        pngs.append(("idle_time.png", "Idle time per resource."))
    for name, mode, window in (
        ("timeline.png", "fixed", (0, 1)),
        ("timeline_auto.png", "pipar", (0, 0)),
    ):
        caption = plot_timeline(out, raw, out / name, mode=mode, iterations=window)
        if caption:
            pngs.append((name, caption))
    shaped_by_tc = any(info.get("probe") for info in raw["networks"].values())
    measured_note = f"epochs 2..{s['epochs']}" if s["epochs"] > 1 else "the one epoch"
    flwr = next(
        (r["flwr"] for c in raw["configurations"] for k, r in c["runs"].items() if "flwr" in r),
        None,
    )
    lines = [
        f"# aiopipe over really shaped links — {raw['started']}",
        "",
        f"Server and every device run as separate processes; links: **{raw['shaping']}**.",
        "",
        "## What was run",
        "",
        f"- command: `{raw['command']}` (as root; from the repository root)",
        f"- workloads: {', '.join(s['workloads'])}; networks: {', '.join(s['networks'])}; "
        f"fleets: {', '.join(raw['fleets'])}",
        f"- {s['devices']} devices × {s['samples_per_device']} samples (IID), batch size "
        f"{s['batch_size']}, {s['epochs']} epochs, seed {s['seed']}; one torch thread per "
        "process",
        f"- device slowdown: homogeneous fleet {s['device_slowdown']:g}× on every device; "
        f"half-slow fleet (PiPar §5.6.1) {s['device_slowdown']:g}× on the first half of the "
        f"devices and {2 * s['device_slowdown']:g}× on the second half. A device with "
        "slowdown s takes s× the CPU time of each compute item (the rest a wait, not "
        "extra CPU: contention for shared cores is not multiplied). The server is not "
        "slowed.",
        f"- modes: FL (FedAvg, whole model on the devices); SFL at split points "
        f"{s['sfl_splits']} (the best is reported, all are listed); PiPar with "
        "`--split-point auto --parallel-batches auto` (the planner's choice); PiPar with a "
        f"fixed plans ({fixed_plans(s['pipar_fixed'])}"
        "); Flower FedAvg as a peer of FL",
        f"- figures: means over {measured_note} (the first epoch holds warm-up and the first "
        "model transfer); accuracy: test accuracy after the last epoch",
        f"- wall time of the whole bench: {raw.get('wall_s', 0) / 60:.1f} min; load average "
        f"before {raw['load_before'][0]:.2f}, after {raw.get('load_after', [0])[0]:.2f} "
        "(the 2 cores are shared with other work: single runs are noisy)",
        "",
        "## Machine and versions",
        "",
        f"- {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB memory, Linux {m['kernel']}",
        f"- python {m['python']}, torch {m['torch']}, aiohttp {m['aiohttp']}, aiopipe "
        f"{m['aiopipe']} (git {m['git']})" + (f", flwr {flwr}" if flwr else ""),
        "",
        "## Shaping check (throughput probe, TCP payload)",
        "",
    ]
    if shaped_by_tc:
        lines += [
            "tbf on each side's egress (`burst max(4 KiB, 2 ms of traffic), latency 50ms`); "
            f"`net.ipv4.tcp_notsent_lowat={s.get('notsent_lowat')}` in the namespaces. "
            "Each link probed per direction (all devices at once), then both directions "
            "at the same time.",
            "",
            *_probe_table(raw),
            "",
        ]
    else:
        lines += ["No probe: the links were not shaped by tc (see above).", ""]
    for workload in s["workloads"]:
        configs = [c for c in raw["configurations"] if c["workload"] == workload]
        if not configs:
            continue
        lines += [
            f"## {workload} on {configs[0]['dataset']} ({configs[0]['units']} units)",
            "",
            "### Epoch time (s) and speedups",
            "",
            "FL÷PiPar and SFL÷PiPar: how many times faster PiPar (auto) is per epoch; "
            "Flower÷FL: Flower's round time over aiopipe FL's epoch time.",
            "",
            *_epoch_table(configs),
            "",
            f"### Test accuracy after {s['epochs']} epochs",
            "",
            *_accuracy_table(configs),
            "",
            "### Busy / idle seconds per epoch per resource",
            "",
            "Busy/idle as aiopipe reports them (links: timed at the sender), and each "
            "link's wire time estimated as bytes per device / probed rate.",
            "",
            *_idle_table(raw, configs),
            "",
        ]
        sfl = _sfl_table(configs)
        if sfl:
            lines += ["### SFL epoch time (s) at every split point", "", *sfl, ""]
    lines += ["## Flower peer", ""]
    if raw.get("flower_note"):
        lines += [raw["flower_note"], ""]
    else:
        lines += [
            "Flower (`flwr`, legacy `start_server` / `start_client` gRPC API) FedAvg in its "
            "own virtual environment `bench/.flower-venv` (created by the harness), server "
            "and clients in the same namespaces over the same shaped links as aiopipe. It "
            "reads the aiopipe FL run's config.toml and uses aiopipe's model builder, "
            "partition and shuffle: the same seeded initial model, device shards, per-epoch "
            "order, SGD (learning rate, momentum), batch size, test set and slowdown "
            "emulation. A round is one epoch; its time runs from the moment every client is "
            "sampled to the end of aggregation (download, training, upload, FedAvg), as "
            "aiopipe's epoch time does; the evaluation is outside both.",
            "",
        ]
    lines += ["## Plots", ""]
    for name, caption in pngs:
        lines += [f"![{name}]({name})", "", caption, ""]
    lines += [
        "Draw any trace yourself: `python -m aiopipe.timeline TRACE.json -o OUT.png "
        "[--epoch E] [--iterations A:B]`.",
        "",
        "## How to read these figures",
        "",
        "- Every process (server, 4 devices) computes for real on the same "
        f"{m['cores']} cores, one torch thread each. A slowed device takes its slowdown "
        "times the CPU time of each compute item, so waiting for a core is not multiplied; "
        "but processes that compute at the same time still wait for the cores, the server "
        "most of all, so stages take longer here than the planner's cost table (measured "
        "alone on the server) predicts. The server is one process with one thread for "
        "every device's replica, as in aiopipe's design.",
        "- Link figures: aiopipe times a transfer at the sender (queued → socket took the "
        "last byte). Under tc the kernel holds what the wire has not carried yet, so the "
        "sender-side busy time of a small message is near zero even when the wire is busy "
        "(`tcp_notsent_lowat` keeps that buffer small, not empty). The `wire s (est.)` "
        "column and the starred bars in the idle plot use bytes / probed rate instead.",
        "- Each figure is a single run on a machine shared with other work (see the load "
        "averages): differences of ~10-20% between two runs are within the noise.",
        "",
        "## Failures",
        "",
        *(_failures(raw) or ["None."]),
        "",
        "## Raw data",
        "",
        "`raw.json` holds every run's per-epoch metrics, the exact server and device "
        "commands, the tc qdiscs and the probe figures; `runs/<workload>/<network>-<fleet>/"
        "<mode>/` holds each run's config.toml, metrics.jsonl and logs (and trace.json for "
        "PiPar).",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


# -- the summary over several results directories ---------------------------------------

SUMMARY_MODES = ("fl", "flower", "sfl", "pipar")
WORKLOAD_ORDER = ("vgg5", "resnet18", "mobilenetv3-small", "vgg16")
NETWORK_ORDER = ("4g", "4g+", "wifi")
FLEET_ORDER = ("homogeneous", "half-slow")


def summary_cells(raws: Sequence[tuple[str, dict[str, Any]]]) -> dict[tuple[str, ...], Any]:
    """Per (workload, network, fleet, mode): the run of the newest directory that has a
    finished one, as (directory, label, run); for sfl, the quickest of the split points,
    each split point's newest run (directories may try different split points).
    Directories run with ``--replan`` are left out: the summary is of the defaults."""
    cells: dict[tuple[str, ...], Any] = {}
    for (*key, label), cell in _latest_runs(raws).items():
        mode = "sfl" if label.startswith("sfl") else label
        best = cells.get((*key, mode))
        if best is None or _epoch(cell[2]) < _epoch(best[2]):
            cells[(*key, mode)] = cell
    return cells


def sfl_splits(raws: Sequence[tuple[str, dict[str, Any]]]) -> dict[tuple[str, ...], list[int]]:
    """Per (workload, network, fleet): the SFL split points with a finished run."""
    tried: dict[tuple[str, ...], list[int]] = {}
    for *key, label in sorted(_latest_runs(raws)):
        if label.startswith("sfl P="):
            tried.setdefault(tuple(key), []).append(int(label.removeprefix("sfl P=")))
    return {key: sorted(points) for key, points in tried.items()}


def _latest_runs(raws: Sequence[tuple[str, dict[str, Any]]]) -> dict[tuple[str, ...], Any]:
    """Per (workload, network, fleet, run label) of a summary mode or an SFL split: the
    newest finished run, as (directory, label, run); ``--replan`` directories left out."""
    latest: dict[tuple[str, ...], Any] = {}
    for name, raw in sorted(raws, key=lambda item: item[1]["started"]):
        if raw["settings"].get("replan"):
            continue
        for c in raw["configurations"]:
            for label, run in c["runs"].items():
                if ok(run) and (label in SUMMARY_MODES or label.startswith("sfl")):
                    latest[(c["workload"], c["network"], c["fleet"], label)] = (name, label, run)
    return latest


def _epoch(run: Run) -> float:
    """The run's mean epoch seconds; infinite without figures (it never wins)."""
    t = mean(run, "time_s")
    return float("inf") if t is None else t


def _order(key: tuple[str, ...]) -> tuple[int, int, int, str]:
    workload, network, fleet = key
    w = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
    n = NETWORK_ORDER.index(network) if network in NETWORK_ORDER else len(NETWORK_ORDER)
    return w, n, FLEET_ORDER.index(fleet) if fleet in FLEET_ORDER else len(FLEET_ORDER), fleet


def write_summary(dirs: Sequence[Path], path: Path) -> Path:
    """Write one markdown table of the headline figures of several results directories
    (the newest finished run per cell, [`summary_cells`]) to ``path``; its path.

    Raises:
        OSError: a raw.json cannot be read or the summary cannot be written.
    """
    raws = [(d.name, json.loads((d / "raw.json").read_text())) for d in dirs]
    cells, tried = summary_cells(raws), sfl_splits(raws)
    rows = [
        "| workload | network | fleet | FL | Flower FL | SFL best | PiPar auto (plan) | "
        "FL÷PiPar | SFL÷PiPar | Flower÷FL | server idle s FL / SFL / PiPar | SFL P tried | "
        "sources |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    used: dict[str, int] = {}
    for key in sorted({k[:3] for k in cells}, key=_order):
        found = {m: cells[(*key, m)] for m in SUMMARY_MODES if (*key, m) in cells}
        runs = {m: (label, run) for m, (_, label, run) in found.items()}
        t = {m: mean(run, "time_s") for m, (_, run) in runs.items()}
        idle = [
            _fmt(mean(runs[m][1], "idle_s", "server")) if m in runs else "–"
            for m in ("fl", "sfl", "pipar")
        ]
        sources = sorted({used.setdefault(name, len(used) + 1) for name, _, _ in found.values()})
        times, ratios = _headline(runs, t)
        rows.append(
            f"| {' | '.join(key)} | {times} | {ratios} | {' / '.join(idle)} | "
            f"{','.join(map(str, tried.get(key, []))) or '–'} | "
            f"{', '.join(f'[{i}]' for i in sources)} |"
        )
    by_name = dict(raws)
    notes = [
        f"[{i}] `{name}/`: `{by_name[name]['command']}` ({by_name[name]['started']}, git "
        f"{by_name[name]['machine']['git']}, {by_name[name]['machine'].get('cpu', 'CPU ?')})"
        for name, i in sorted(used.items(), key=lambda item: item[1])
    ]
    lines = [
        "# aiopipe over really shaped links — summary",
        "",
        "Epoch seconds, means over the epochs after the first (see each directory's "
        "report.md for the settings, idle times, accuracy and plots). Each cell is the "
        "newest finished run of that workload, network, fleet and mode among the "
        "directories below, left out: runs with `--replan`; SFL best is the quickest "
        "split point (the newest run of each) of those listed under SFL P tried. A row "
        "may mix runs from "
        "different directories (its sources), even from different hosts (their CPUs are "
        "listed with the sources: the same plan ran up to a third faster on one than on "
        "another); runs are single and the machine is shared, so differences of a few "
        "per cent are noise.",
        "",
        *rows,
        "",
        "Sources:",
        "",
        *(f"- {note}" for note in notes),
        "",
        f"Written by `python bench/report.py --summary {' '.join(str(d) for d in dirs)}`.",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


USAGE = (
    "usage: python bench/report.py RESULTS_DIR\n"
    "       python bench/report.py --summary RESULTS_DIR... [--out FILE]"
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/report.py RESULTS_DIR``: rewrite the report from raw.json;
    ``--summary DIR... [--out FILE]``: one table over several directories (default
    bench/results/SUMMARY.md)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--summary"]:
        out = Path(__file__).parent / "results" / "SUMMARY.md"
        if "--out" in args:
            at = args.index("--out")
            if at + 1 >= len(args):
                print(USAGE, file=sys.stderr)
                return 2
            out = Path(args[at + 1])
            del args[at:at + 2]
        dirs = []
        for arg in args[1:]:
            if (Path(arg) / "raw.json").is_file():
                dirs.append(Path(arg))
            else:
                print(f"skipped {arg}: no raw.json (not a bench/shaped.py results directory)",
                      file=sys.stderr)
        if not dirs:
            print(USAGE, file=sys.stderr)
            return 2
        print(write_summary(dirs, out))
        return 0
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    print(write_report(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
