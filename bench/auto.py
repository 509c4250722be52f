"""Does ``mode = "auto"`` pick the fastest system? Every candidate between real processes
over tc-shaped links (issue 46, part 1's check).

For each workload, network and fleet it runs, the way bench/shaped.py does (the server in
one network namespace, each device in its own, tc tbf on each direction; the same
``Bench.run_aiopipe``):

    ip netns exec <srv> python -m aiopipe.server --no-shaping --network <preset> --mode M ...
    ip netns exec <dev k> python -m aiopipe.device --server ws://10.213.0.1:P/ws --device-id k

with M = ``auto`` (first: its log's "auto chose ..." line and table give each
candidate's predicted epoch and plan), ``fl``, ``sfl --split-point auto`` and ``pipar
--split-point auto --parallel-batches auto``. The measured epoch of a run is the mean of
its epochs after the first (the first carries the warm-up); for auto, whose trial
rounds ([Note: re-choosing the system]) switch systems, the epochs after the first one
of the system it settled on (its run has ``--auto-epochs``, 9 by default: a first round,
up to two trials, up to three close-call rounds, the switch back, and two measured). Every
process of the bench shares one cost cache (``AIOPIPE_COST_CACHE``,
``<out>/cost-cache-<tag>``, kept): the auto run measures the profiles and the forced
sfl and pipar runs plan from the same tables, so their plans are the ones auto
predicted.

Each invocation adds ``raw-<tag>.json``; ``--report`` (also done at the end of each run)
writes ``<out>/tables.md`` from every ``raw-*.json`` in ``<out>``: per configuration each
candidate's predicted and measured epoch, auto's pick, the fastest measured candidate and
auto's measured epoch over the fastest one's.

    sudo .venv/bin/python bench/auto.py [--workloads vgg5,mobilenetv3-small]
        [--networks 4g,wifi] [--fleet both] [--epochs 4] [--auto-epochs 9] [--repeats 1]
        [--tag NAME] [--out DIR]
    .venv/bin/python bench/auto.py --report --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import netns  # noqa: E402  (bench/ is not a package)
import shaped  # noqa: E402

CANDIDATES = ("fl", "sfl", "pipar")
#: shaped.py's tc presets, and "lan": the veths unshaped (the planner's "lan" rates).
NETWORKS = (*netns.NETWORKS, "lan")
#: Each arm's server options beyond the shared ones; auto runs first.
ARMS = {
    "auto": ["--mode", "auto"],
    "fl": ["--mode", "fl"],
    "sfl": ["--mode", "sfl", "--split-point", "auto"],
    "pipar": ["--mode", "pipar", "--split-point", "auto", "--parallel-batches", "auto"],
}
#: The coordinator's one line on its choice (aiopipe.scheduler.auto.summary).
CHOICE_LINE = re.compile(r"auto chose (\w+) \((.*?)\): predicted ([\d.]+) s per epoch, "
                         r"bound by (.+?); (.*)$", re.MULTILINE)
#: Its second look ([Note: re-choosing the system]): the system it tries for a round,
#: and the one it runs on (kept, or gone back to).
TRIED = re.compile(r"auto tries (\w+)")  # (each trial)
AGAIN = re.compile(r"auto runs (\w+) one more round")  # (a close call's rounds)
SETTLED = re.compile(r"auto (?:keeps|goes back to) (\w+)")
#: A row of the table under it (aiopipe.scheduler.auto.explain).
TABLE_ROW = re.compile(r"^(->|  )(fl|sfl|pipar) +(?:([\d.]+)  (.*?\([\d.]+\)) +(.*?)"
                       r"|- +does not fit: (.*?))\s*$", re.MULTILINE)


def predictions(log_text: str) -> dict[str, Any]:
    """The auto run's choice (the system it ran on after its second look; ``first``:
    its first choice; ``tried``: those it tried for a round each, or None; ``again``:
    those a close call ran one more round, or None) and each
    candidate's predicted epoch, bound and plan (the first choice's table), read from
    its server log; ``{}`` when the log has no choice."""
    line = CHOICE_LINE.search(log_text)
    if line is None:
        return {}
    rows: dict[str, dict[str, Any]] = {}
    for row in TABLE_ROW.finditer(log_text, line.end()):
        mark, mode, epoch, bound, plan, refusal = row.groups()
        if mode in rows:
            break  # a second table (a later log) is not this choice's
        rows[mode] = ({"epoch_s": float(epoch), "bound": bound, "plan": plan}
                      if epoch is not None else {"epoch_s": None, "refusal": refusal})
        rows[mode]["chosen"] = mark == "->"
    tried = [m.group(1) for m in TRIED.finditer(log_text, line.end())]
    again = [m.group(1) for m in AGAIN.finditer(log_text, line.end())]
    settled = [m.group(1) for m in SETTLED.finditer(log_text, line.end())]
    return {"chosen": settled[-1] if settled else line.group(1), "first": line.group(1),
            "tried": ", ".join(tried) or None, "again": ", ".join(again) or None,
            "line": line.group(0).strip(),
            "candidates": rows}


def measured_epoch(run: dict[str, Any]) -> float | None:
    """The run's mean epoch after its system's first (the only one if it ran one): for
    mode auto, whose system may change between rounds ([Note: re-choosing the system]),
    the epochs after the first one of the system it settled on, as a forced run's are
    after its first, else (no epoch left) the epochs after its last switch; None if it
    failed or no epoch is left."""
    epochs = run.get("epochs") or []
    changed = [i for i, e in enumerate(epochs) if e.get("changes")]
    if not changed:
        settled = epochs[1:] or epochs
    else:
        settled = epochs[changed[-1] + 2:] or epochs[changed[-1] + 1:]
    return sum(e["time_s"] for e in settled) / len(settled) if settled else None


def plan_of(run: dict[str, Any]) -> str:
    """The plan of the run's last epoch as "P2N4 x2, P4N1" (shaped's metrics)."""
    epochs = run.get("epochs") or []
    plans = [(p["split_point"], p["parallel_batches"]) for p in
             (epochs[-1].get("plan") or [] if epochs else [])]
    words: list[str] = []
    for plan in plans:
        word = f"P{plan[0]}N{plan[1]}"
        if words and words[-1].split(" x")[0] == word:
            count = int(words[-1].split(" x")[1]) if " x" in words[-1] else 1
            words[-1] = f"{word} x{count + 1}"
        else:
            words.append(word)
    return ", ".join(words)


def verdict(config: dict[str, Any]) -> dict[str, Any]:
    """One configuration's figures: per candidate predicted and measured epoch; auto's
    pick, the fastest measured candidate, and auto's measured epoch over it."""
    runs, predicted = config["runs"], config.get("predicted") or {}
    rows = {}
    for mode in CANDIDATES:
        guess = (predicted.get("candidates") or {}).get(mode, {})
        run = runs.get(mode, {})
        rows[mode] = {"predicted_s": guess.get("epoch_s"), "predicted_plan": guess.get("plan", ""),
                      "bound": guess.get("bound", ""), "measured_s": measured_epoch(run),
                      "plan": plan_of(run), "error": run.get("error", "")}
    measured = {m: r["measured_s"] for m, r in rows.items() if r["measured_s"] is not None}
    fastest = min(measured, key=lambda m: measured[m]) if measured else None
    auto_s = measured_epoch(runs.get("auto", {}))
    ratio = auto_s / measured[fastest] if auto_s is not None and fastest else None
    chosen = predicted.get("chosen")
    # the pick's forced run over the fastest: the choice's cost without the noise between
    # auto's own run and the forced run of the same system
    pick = measured[chosen] / measured[fastest] if fastest and chosen in measured else None
    tried, again = predicted.get("tried"), predicted.get("again")
    picked = f"{predicted.get('first')}, tried {tried}" if tried else None
    if picked and again:
        picked += f", again {again}"
    return {"rows": rows, "chosen": chosen, "fastest": fastest,
            "picked": f"{picked}: {chosen}" if picked else chosen,
            "auto_s": auto_s, "auto_plan": plan_of(runs.get("auto", {})),
            "auto_error": runs.get("auto", {}).get("error", ""), "ratio": ratio,
            "pick_ratio": pick,
            "picked_fastest": chosen == fastest if fastest else None}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(config: dict[str, Any]) -> str:
    """One configuration as a markdown section."""
    v = verdict(config)
    head = (f"### {config['workload']} | {config['network']} | {config['fleet']}\n\n"
            "| candidate | predicted s | predicted plan (bound) | measured s | plan run | "
            "measured / predicted |\n|---|---|---|---|---|---|\n")
    lines = []
    for mode, r in v["rows"].items():
        mark = " (auto's pick)" if mode == v["chosen"] else ""
        mark += " (fastest measured)" if mode == v["fastest"] else ""
        over = (f"{r['measured_s'] / r['predicted_s']:.2f}"
                if r["measured_s"] is not None and r["predicted_s"] else "-")
        measured = _s(r["measured_s"]) if not r["error"] else f"failed: {r['error'][:80]}"
        lines.append(f"| {mode}{mark} | {_s(r['predicted_s'])} | {r['predicted_plan']} "
                     f"({r['bound']}) | {measured} | {r['plan']} | {over} |")
    auto = _s(v["auto_s"]) if not v["auto_error"] else f"failed: {v['auto_error'][:80]}"
    lines.append(f"| auto (ran {v['picked'] or '?'}) | - | - | {auto} | {v['auto_plan']} | - |")
    hit = {True: "yes", False: "**no**", None: "?"}[v["picked_fastest"]]
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
    within = "" if v["ratio"] is None else (" (within 5%)" if v["ratio"] <= 1.05
                                            else " (**over 5%**)")
    pick = "-" if v["pick_ratio"] is None else f"{v['pick_ratio']:.3f}"
    return (head + "\n".join(lines) + f"\n\nauto picked {v['picked']}, fastest measured "
            f"{v['fastest']}: picked the fastest: {hit}; auto measured / fastest measured "
            f"= {ratio}{within}; the pick's forced run / fastest = {pick}\n")


def summary(configs: Sequence[dict[str, Any]]) -> str:
    """Every configuration in one table."""
    lines = ["| workload | network | fleet | fl s (pred / meas) | sfl s | pipar s | auto "
             "picked | fastest | auto s | auto / fastest | pick's run / fastest |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        v = verdict(c)
        cells = [f"{_s(r['predicted_s'])} / {_s(r['measured_s'])}" for r in v["rows"].values()]
        ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
        lines.append(f"| {c['workload']} | {c['network']} | {c['fleet']} | "
                     f"{' | '.join(cells)} | {v['picked']} | {v['fastest']} | "
                     f"{_s(v['auto_s'])} | {ratio} | "
                     f"{'-' if v['pick_ratio'] is None else format(v['pick_ratio'], '.3f')} |")
    return "\n".join(lines) + "\n"


def pooled(configs: Sequence[dict[str, Any]]) -> str:
    """Configurations run more than once, pooled: each candidate's mean measured epoch over
    the rounds, auto's picks, auto's mean over the fastest mean, and each round's pick's
    mean forced epoch over the fastest mean; "" if none repeats."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in configs:
        groups.setdefault((c["workload"], c["network"], c["fleet"]), []).append(c)
    lines = ["| workload | network | fleet | rounds | fl s | sfl s | pipar s | auto picked | "
             "fastest (mean) | auto s | auto / fastest | pick's runs / fastest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, group in groups.items():
        if len(group) < 2:
            continue
        verdicts = [verdict(c) for c in group]
        means = {}
        for mode in CANDIDATES:
            values = [v["rows"][mode]["measured_s"] for v in verdicts]
            means[mode] = (sum(values) / len(values)
                           if all(x is not None for x in values) else None)
        autos = [v["auto_s"] for v in verdicts]
        auto = sum(autos) / len(autos) if all(x is not None for x in autos) else None
        known = {m: x for m, x in means.items() if x is not None}
        fastest = min(known, key=lambda m: known[m]) if known else None
        ratio = "-" if auto is None or fastest is None else f"{auto / known[fastest]:.3f}"
        # each turn's pick, judged by the pooled forced runs of the system it picked
        forced = ", ".join("-" if fastest is None or v["chosen"] not in known
                           else f"{known[v['chosen']] / known[fastest]:.3f}"
                           for v in verdicts)
        lines.append(f"| {' | '.join(key)} | {len(group)} | "
                     f"{' | '.join(_s(means[m]) for m in CANDIDATES)} | "
                     f"{', '.join(str(v['picked']) for v in verdicts)} | {fastest} | "
                     f"{_s(auto)} | {ratio} | {forced} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def write_report(out: Path) -> Path:
    """``<out>/tables.md`` from every ``raw-*.json`` in ``out``."""
    configs: list[dict[str, Any]] = []
    loads = []
    for path in sorted(out.glob("raw-*.json")):
        raw = json.loads(path.read_text())
        configs.extend(raw["configurations"])
        loads.append(f"- `{path.name}`: `{raw['command']}`; started {raw['started']}; "
                     f"uptime before: {raw.get('uptime_before', '?')}; after: "
                     f"{raw.get('uptime_after', '?')}; {raw.get('wall_s', 0) / 60:.1f} min")
    repeated = pooled(configs)
    text = ("## Invocations\n\n" + "\n".join(loads) + "\n\n## Summary\n\n" + summary(configs)
            + (f"\n## Over rounds\n\n{repeated}" if repeated else "")
            + "\n## Per configuration\n\n" + "\n".join(table(c) for c in configs))
    path = out / "tables.md"
    path.write_text(text)
    return path


def _uptime() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def configuration(bench: shaped.Bench, workload: str, network: str, fleet: str,
                  arms: Sequence[str], turn: int = 0) -> dict[str, Any]:
    """Every arm of one (workload, network, fleet), once (``turn``: which time)."""
    base = bench.out / "runs" / bench.args.tag / workload / f"{network}-{fleet}"
    if turn:
        base = base.with_name(f"{base.name}-{turn + 1}")
    runs: dict[str, Any] = {}
    predicted: dict[str, Any] = {}
    for arm in arms:
        options = bench.options(workload, network, fleet, "MODE", [])
        at = options.index("MODE")
        options[at - 1:at + 1] = ARMS[arm]
        if arm == "auto":  # its trials take a round each before it settles
            options[options.index("--epochs") + 1] = str(bench.args.auto_epochs)
        load = _uptime()
        result = {**bench.run_aiopipe(base / arm, options), "load_before": load,
                  "load_after": _uptime()}
        for name in ("trace.json", "timeline.png"):
            (base / arm / name).unlink(missing_ok=True)
        runs[arm] = result
        if arm == "auto":
            predicted = predictions((base / arm / "server.log").read_text(errors="replace"))
            shaped.log(f"  {predicted.get('line', 'no choice in the log')}")
        shaped.log(f"  {arm:<6} epoch {_s(measured_epoch(result))} s  {plan_of(result)}"
                   f"{'  FAILED: ' + result['error'] if 'error' in result else ''}")
    return {"workload": workload, "network": network, "fleet": fleet, "runs": runs,
            "predicted": predicted, "load_after": _uptime()}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The bench's options (shaped.Bench reads the run settings from them)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--workloads", default="vgg5,mobilenetv3-small")
    parser.add_argument("--networks", default="4g,wifi",
                        help="comma list of 4g, 4g+, wifi, lan (unshaped)")
    parser.add_argument("--fleet", choices=[*shaped.FLEETS, "both"], default="both")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma list of auto, fl, sfl, "
                        "pipar (default all, auto first)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--samples-per-device", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=4,
                        help="epochs per forced run (measured after the first)")
    parser.add_argument("--auto-epochs", type=int, default=9,
                        help="epochs of the auto run: it may try each other candidate for "
                             "a round (epochs 2 and 3), run close ones one more round "
                             "each (up to 3 more) and is measured after its last switch")
    parser.add_argument("--device-slowdown", type=float, default=4.0,
                        help="compute slowdown of every device (half-slow: x2 for half)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each configuration's arms this many times in turn "
                             "(auto, fl, sfl, pipar, auto, ...); the report pools them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-seconds", type=float, default=2.0)
    parser.add_argument("--run-timeout", type=int, default=600)
    parser.add_argument("--notsent-lowat", type=int, default=16384)
    parser.add_argument("--no-netns", action="store_true",
                        help="no namespaces: sender-side shaping over loopback")
    parser.add_argument("--tag", default="", help="this invocation's raw-<tag>.json "
                        "(default the time)")
    parser.add_argument("--report", action="store_true", help="only write tables.md")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.pin = False
    for name, allowed in (("workloads", shaped.WORKLOADS), ("networks", NETWORKS),
                          ("arms", ARMS)):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"--{name}: unknown {bad or 'empty'}; choose from {', '.join(allowed)}")
        setattr(args, name, values)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the arms of every configuration; write raw-<tag>.json and tables.md."""
    args = parse(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        shaped.log(f"report {write_report(out)}")
        return 0
    fleets = list(shaped.FLEETS) if args.fleet == "both" else [args.fleet]
    tag = args.tag = args.tag or time.strftime("%H%M%S")
    # every child's (shaped.child_env); kept: the tables the predictions came from
    os.environ["AIOPIPE_COST_CACHE"] = str(out / f"cost-cache-{tag}")
    raw: dict[str, Any] = {
        "command": shlex.join(["bench/auto.py", *(sys.argv[1:] if argv is None else argv)]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": shaped.machine(),
        "uptime_before": _uptime(), "settings": {k: str(v) for k, v in vars(args).items()},
        "networks": {}, "configurations": []}
    reason = "--no-netns given" if args.no_netns else netns.unavailable_reason()
    started = time.perf_counter()
    try:
        if reason is not None:
            shaped.log(f"no namespaces ({reason}): aiopipe's sender-side shaping on loopback")
            _sweep(shaped.Bench(args, out, None), raw, fleets, lambda net: {"shaping": reason})
        else:
            lowat = args.notsent_lowat or None
            with netns.open_topology(args.devices, notsent_lowat=lowat) as topology:
                _sweep(shaped.Bench(args, out, topology), raw, fleets,
                       lambda net: _shape(topology, net, args))
    finally:
        raw["wall_s"] = time.perf_counter() - started
        raw["uptime_after"] = _uptime()
        (out / f"raw-{tag}.json").write_text(json.dumps(raw, indent=1))
    shaped.log(f"done in {raw['wall_s'] / 60:.1f} min; report {write_report(out)}")
    return 0


def _shape(topology: netns.Topology, network: str, args: argparse.Namespace
           ) -> dict[str, Any]:
    """Shape the links as ``network`` (shaped.py's presets; "lan": unshaped veths)."""
    if network == "lan":
        netns.shape(topology, None, None)
        return {"shaping": "none: unshaped veth pairs"}
    return shaped._shape_and_probe(topology, network, args)


def _sweep(bench: shaped.Bench, raw: dict[str, Any], fleets: list[str],
           prepare: Any) -> None:
    args = bench.args
    for network in args.networks:
        raw["networks"][network] = prepare(network)
        for workload in args.workloads:
            for fleet in fleets:
                for turn in range(args.repeats):
                    shaped.log(f"{workload} | {network} | {fleet}  (turn {turn + 1} of "
                               f"{args.repeats}; load {_uptime()})")
                    raw["configurations"].append(
                        configuration(bench, workload, network, fleet, args.arms, turn))


if __name__ == "__main__":
    sys.exit(main())
