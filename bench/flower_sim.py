"""aiopipe's FL simulation against Flower's simulation engine (``flwr.simulation.run_simulation``,
Ray backend): seconds per round, total wall time and peak memory for the same training on
this machine (issue 48).

Per K in ``--devices`` (default 100, 1000), the arms run interleaved, aiopipe, Flower,
aiopipe, Flower (``--repeats`` pairs), each in a fresh process of its own started in a new
session, so that memory is per arm:

- ``aiopipe``: ``aiopipe.simulate(config, clock=VirtualClock(), cost_table=uniform)`` in
  the repository's venv, the way ``bench/scale.py --mode fl`` runs its population mode:
  every forward and backward pass is really computed (one process, one torch thread), and
  the run's *virtual* time is charged from the uniform cost table; what is measured here is
  the wall time that work takes, not the virtual time.
- ``flower``: ``run_simulation(ServerApp, ClientApp, num_supernodes=K)`` in
  ``bench/.flower-sim-venv`` (flwr[simulation] 1.42.0 with Ray, torch 2.13.0+cpu), with
  the message-API ``FedAvg``, ``fraction_evaluate=0`` and a central ``evaluate_fn``;
  Ray gets ``--flower-actors`` CPUs and each ClientApp one CPU, so by default one
  ClientApp trains at a time, as aiopipe's one compute thread does.

The same work on both sides (the config is ``bench/scale.py``'s ``config_of`` for both):
vgg5 on synthetic-cifar10, the model's initial weights from aiopipe's seeded
``build_model``, each device's shard from ``device_indices`` (``--samples-per-device``,
IID), ``--rounds`` rounds of one local epoch each over the shard in ``epoch_order(shard,
epoch=round - 1, seed=0)``, batches of ``--batch-size`` (N = 1), SGD with the config's
learning rate and momentum and a fresh optimizer every round (aiopipe:
``local_optimizer = "fresh"``), FedAvg weighted by samples, and after every round the
global model's accuracy on the same 100 test samples on the server. The devices that
train in round r are the same on both sides: ``sampled_devices(0, r - 1, 0, range(K),
n)`` (aiopipe's draw; n = ``--fraction`` x K). Flower's nodes of a simulation are
stateless (a ClientApp is built per message), so the strategy sends each drawn device's
id in its train message and the node trains that device's shard: which of Flower's
nodes carries it does not change the work.

Figures, one row per arm run:

- ``s/round``: mean wall seconds of rounds 2..R, from the end of round 1 to the end of
  round R over R - 1 (a round ends after its aggregation and the central evaluation:
  aiopipe's ``progress`` callback, Flower's ``evaluate_fn``); round 1 (warm-up: Ray's
  actor start, lazy imports, the first dataset build) is ``round1 s``;
- ``run s``: the ``simulate`` / ``run_simulation`` call (Flower's includes starting and
  stopping Ray); ``total s``: the arm's process from start to exit, as the parent sees
  it (imports included);
- ``peak PSS MiB``: the largest sum, over the arm's processes (the child, every process
  in its session and every descendant; Flower's are its driver, Ray's GCS, raylet,
  workers and helpers), of ``Pss`` in ``/proc/PID/smaps_rollup``, sampled every
  ``--interval`` s; ``procs``: how many processes that sum covered. PSS splits shared
  pages among the processes that map them, so the sum counts a page once however many
  of the arm's processes map it; Ray's object store in /dev/shm counts only where
  mapped;
- ``cpu s``: user + system CPU seconds of the arm's processes, each as last sampled
  (so up to ``--interval`` s short per process); ``load1``: the 1-minute load average
  as the arm started;
- ``acc``: the final test accuracy, and after the table the largest gaps between the
  arms' per-round training loss and test accuracy, a check that both sides trained
  alike (not equal to the bit: float sums differ in order).

Not measured: accuracy over time, network emulation (aiopipe charges the network in
virtual time; Flower's simulation has none), anything of a real deployment. The load
(``uptime``) is printed before and after.

    .venv/bin/python bench/flower_sim.py [--devices 100,1000] [--rounds 10]
        [--fraction 0.1] [--samples-per-device 40] [--batch-size 20] [--repeats 2]
        [--flower-actors 1] [--interval 0.5] [--timeout 1800] [--json OUT.json]

Create the Flower venv once (the pins of constraints.txt that flwr[simulation] 1.42.0
does not accept left out: protobuf, typer, rich, packaging, ray)::

    python3.11 -m venv bench/.flower-sim-venv
    grep -v -E '^(protobuf|typer|rich|packaging|ray)==' constraints.txt > /tmp/c.txt
    bench/.flower-sim-venv/bin/pip install "flwr[simulation]==1.42.0" torch==2.13.0 \\
        aiohttp msgpack orjson safetensors -c /tmp/c.txt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
FLOWER_VENV = BENCH / ".flower-sim-venv"
MARK = "FLSIM-RESULT "
ARMS = ("aiopipe", "flower")
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "HTTP_PROXY",
               "HTTPS_PROXY", "ALL_PROXY")


# -- pure parts (tested without Flower) ------------------------------------------------


def parse_stat(text: str) -> tuple[int, int, int, int]:
    """(pid, ppid, session id, start time in ticks) of a ``/proc/PID/stat`` line (the
    command may hold spaces and parentheses: the fields follow the last ``)``)."""
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    return int(head.split("(", 1)[0]), int(fields[1]), int(fields[3]), int(fields[19])


def cpu_ticks(stat: str) -> int:
    """User + system CPU time of a ``/proc/PID/stat`` line, in clock ticks."""
    fields = stat.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def pss_kib(smaps_rollup: str) -> int:
    """The ``Pss:`` line of a ``/proc/PID/smaps_rollup``, in KiB (0 without one)."""
    for line in smaps_rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


Stats = Mapping[int, tuple[int, int, int]]  # pid: (ppid, session id, start time)


def tree(stats: Stats, root: int, known: Iterable[tuple[int, int]] = ()) -> set[int]:
    """The processes of an arm among ``stats``: ``root``, every process in its session
    (the arm starts as a session leader, so the session id is ``root``), the already
    ``known`` ones ((pid, start time): not a reused pid) still alive, and every
    descendant of these."""
    found = {p for p, (_, sid, _) in stats.items() if sid == root or p == root}
    found |= {p for p, start in known if p in stats and stats[p][2] == start}
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def round_seconds(ends: Sequence[float]) -> tuple[float, float]:
    """(round 1's seconds, the mean seconds of rounds 2..R) from the rounds' end times
    (seconds since the run started); NaN where there are not enough rounds."""
    nan = float("nan")
    if not ends:
        return nan, nan
    mean = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else nan
    return ends[0], mean


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows (one per arm run) as a text table."""
    head = (f"{'K':>5} {'arm':<8} {'rep':>3} {'s/round':>8} {'round1 s':>8} {'run s':>7} "
            f"{'total s':>8} {'cpu s':>6} {'peak PSS MiB':>12} {'procs':>5} "
            f"{'samples/rnd':>11} {'acc':>6} {'load1':>5}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        samples = r.get("samples") or [0]
        lines.append(
            f"{r['devices']:>5} {r['arm']:<8} {r.get('repeat', 0):>3} "
            f"{r.get('round_s', float('nan')):>8.2f} {r.get('round1_s', float('nan')):>8.2f} "
            f"{r.get('run_s', float('nan')):>7.1f} {r.get('total_s', float('nan')):>8.1f} "
            f"{r.get('cpu_s', float('nan')):>6.1f} "
            f"{r.get('peak_pss_kib', 0) / 1024:>12.0f} {r.get('peak_procs', 0):>5} "
            f"{max(samples):>11} {r.get('accuracy', float('nan')):>6.3f} "
            f"{r.get('load1', float('nan')):>5.2f}  {r.get('error', '')}"
        )
    return "\n".join(lines)


def summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per K, each arm's means over its runs and Flower over aiopipe."""
    out = [f"{'K':>5} {'arm':<8} {'s/round':>8} {'total s':>8} {'peak PSS MiB':>12}"]
    by: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault((r["devices"], r["arm"]), []).append(r)
    means: dict[tuple[int, str], tuple[float, float, float]] = {}
    for (k, arm), runs in sorted(by.items()):
        n = len(runs)
        m = (sum(r["round_s"] for r in runs) / n, sum(r["total_s"] for r in runs) / n,
             sum(r["peak_pss_kib"] for r in runs) / n / 1024)
        means[(k, arm)] = m
        out.append(f"{k:>5} {arm:<8} {m[0]:>8.2f} {m[1]:>8.1f} {m[2]:>12.0f}")
    for k in sorted({k for k, _ in means}):
        a, f = means.get((k, "aiopipe")), means.get((k, "flower"))
        if a and f:
            out.append(f"{k:>5} {'fl/aio':<8} {f[0] / a[0]:>7.2f}x {f[1] / a[1]:>7.2f}x "
                       f"{f[2] / a[2]:>11.2f}x")
    return "\n".join(out)


def agreement(rows: Sequence[Mapping[str, Any]], devices: int) -> str:
    """How far apart the arms' per-round training loss and test accuracy are for K =
    ``devices`` (the largest difference over rounds and runs)."""
    runs = [r for r in rows if r["devices"] == devices and not r.get("error")]
    out = []
    for key in ("losses", "accuracies"):
        a = [r[key] for r in runs if r["arm"] == "aiopipe"]
        f = [r[key] for r in runs if r["arm"] == "flower"]
        if a and f:
            gap = max(abs(x - y) for ra in a for rf in f for x, y in zip(ra, rf, strict=False))
            out.append(f"max |aiopipe - flower| {key} {gap:.2g}")
    return "; ".join(out) or "no pair to compare"


# -- the run's config, shared by both arms ---------------------------------------------


def scale_args(ns: argparse.Namespace, devices: int) -> argparse.Namespace:
    """The namespace ``bench/scale.py``'s ``config_of`` and ``cost_table`` read."""
    return argparse.Namespace(
        mode="fl", local_optimizer="fresh", samples_per_device=ns.samples_per_device,
        batch_size=ns.batch_size, parallel_batches=1, split_point=2, epochs=ns.rounds,
        test_samples=100, network="4g", costs="uniform",
        devices_per_round=max(1, round(ns.fraction * devices)))


def run_config(ns: argparse.Namespace, devices: int) -> Any:
    """The `aiopipe.RunConfig` of both arms (bench/scale.py's)."""
    sys.path.insert(0, str(BENCH))
    import scale

    return scale.config_of(scale_args(ns, devices), devices)


# -- the aiopipe arm -------------------------------------------------------------------


def child_aiopipe(ns: argparse.Namespace) -> dict[str, Any]:
    """One aiopipe.simulate run on the virtual clock; its figures."""
    import asyncio

    import torch

    import aiopipe
    from aiopipe.clock import VirtualClock

    sys.path.insert(0, str(BENCH))
    import scale

    torch.set_num_threads(1)
    config = run_config(ns, ns.child_devices)
    costs = scale.cost_table(scale_args(ns, ns.child_devices))
    ends: list[float] = []
    accuracy: list[float] = []
    samples: list[int] = []
    sampled: list[list[int]] = []
    losses: list[float] = []

    def progress(epoch: Any) -> None:
        ends.append(time.perf_counter() - started)
        accuracy.append(epoch.accuracy)
        losses.append(epoch.loss)
        samples.append(epoch.samples)
        sampled.append([d for r in epoch.sampled for d in r])

    started = time.perf_counter()
    asyncio.run(aiopipe.simulate(config, clock=VirtualClock(), cost_table=costs,
                                 progress=progress))
    return {"run_s": time.perf_counter() - started, "ends": ends, "accuracies": accuracy,
            "samples": samples, "sampled": sampled, "losses": losses, "versions": {
                "aiopipe": aiopipe.__version__, "torch": torch.__version__}}


# -- the Flower arm --------------------------------------------------------------------

_CACHE: dict[str, Any] = {}


def _flower_setup(params: Mapping[str, Any]) -> dict[str, Any]:
    """This process's model, training set and config for ``params`` (built once per
    process: Ray's actor keeps them between ClientApp calls, as a Flower app caches its
    dataset)."""
    key = json.dumps(dict(params), sort_keys=True)
    if _CACHE.get("key") != key:
        import torch

        from aiopipe.runtime.plan import build_model, train_dataset

        torch.set_num_threads(1)
        ns = argparse.Namespace(**{k: params[k] for k in (
            "samples_per_device", "batch_size", "rounds", "fraction")})
        config = run_config(ns, int(params["devices"]))
        train = train_dataset(config)
        model = build_model(config, num_classes=train.num_classes, in_shape=train.in_shape)
        _CACHE.update(key=key, config=config, train=train, model=model)
    return _CACHE


def flower_train(msg: Any, context: Any) -> Any:
    """The ClientApp's train: one local epoch of the device the message names."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from torch import nn

    from aiopipe.data import epoch_order
    from aiopipe.runtime.plan import device_indices

    cfg = msg.content["config"]
    setup = _flower_setup(json.loads(str(cfg["params"])))
    config, train, model = setup["config"], setup["train"], setup["model"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                                momentum=config.momentum)  # fresh every round
    device = int(cfg["device"])
    order = epoch_order(device_indices(config, train, device),
                        epoch=int(cfg["server-round"]) - 1, seed=config.seed)
    batch, samples, loss_sum = config.batch_size, 0, 0.0
    for it in range(len(order) // batch):
        x, y = train.batch(order[it * batch:(it + 1) * batch])
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        samples += len(y)
        loss_sum += float(loss.detach()) * len(y)
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"num-examples": samples, "device": device,
                                 "loss": loss_sum / max(1, samples)}),
    })
    return Message(content=content, reply_to=msg)


def flower_client_app() -> Any:
    """The ClientApp (this module's `flower_train`, found by Ray's workers by import)."""
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.train()(flower_train)
    return app


def flower_server_app(ns: argparse.Namespace, figures: dict[str, Any]) -> Any:
    """The ServerApp: FedAvg over aiopipe's draw of devices, central evaluation after
    each round (its end time noted in ``figures``)."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from aiopipe.data import open_dataset
    from aiopipe.runtime.evaluation import test_accuracy
    from aiopipe.runtime.factories import make_loss, make_metric
    from aiopipe.runtime.sampling import sampled_devices

    devices = ns.child_devices
    params = {"devices": devices, "samples_per_device": ns.samples_per_device,
              "batch_size": ns.batch_size, "rounds": ns.rounds, "fraction": ns.fraction}
    setup = _flower_setup(params)
    config, model = setup["config"], setup["model"]
    test = open_dataset(config.dataset, split="test", size=config.test_samples,
                        seed=config.seed)
    loss, metric = make_loss(config), make_metric(config)
    initial = ArrayRecord({k: v.clone() for k, v in model.state_dict().items()})
    n = config.round_size(devices)

    class Drawn(FedAvg):  # type: ignore[misc]
        """FedAvg training aiopipe's draw of devices each round."""

        def configure_train(self, server_round: int, arrays: ArrayRecord,
                            config_record: ConfigRecord, grid: Grid) -> Iterable[Message]:
            nodes = sorted(grid.get_node_ids())
            draw = sampled_devices(config.seed, server_round - 1, 0, range(devices), n)
            figures["sampled"].append(draw)
            messages = []
            for node, device in zip(nodes, draw, strict=False):
                record = ConfigRecord({"server-round": server_round, "device": device,
                                       "params": json.dumps(params)})
                messages.append(Message(
                    content=RecordDict({"arrays": arrays, "config": record}),
                    message_type="train", dst_node_id=node))
            return messages

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            accuracy = test_accuracy(model, test, loss, metric)
        model.train()
        if server_round > 0:
            figures["ends"].append(time.perf_counter() - figures["started"])
            figures["accuracies"].append(accuracy)
        return MetricRecord({"accuracy": accuracy})

    def aggregate(records: list[RecordDict], key: str) -> MetricRecord:
        figures["samples"].append(sum(int(r["metrics"]["num-examples"]) for r in records))
        figures["losses"].append(  # the mean training loss per sample, as aiopipe's
            sum(float(r["metrics"]["loss"]) * int(r["metrics"]["num-examples"])
                for r in records) / max(1, figures["samples"][-1]))
        return MetricRecord({"samples": figures["samples"][-1]})

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = Drawn(fraction_train=n / devices, fraction_evaluate=0.0,
                         min_available_nodes=devices, train_metrics_aggr_fn=aggregate)
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=ns.rounds,
                       evaluate_fn=evaluate)

    return app


def child_flower(ns: argparse.Namespace) -> dict[str, Any]:
    """One Flower run_simulation; its figures."""
    import flower_sim  # this file by its module name, so Ray's workers import it
    import flwr
    import ray
    import torch
    from flwr.simulation import run_simulation

    torch.set_num_threads(1)
    figures: dict[str, Any] = {"ends": [], "accuracies": [], "samples": [], "sampled": [],
                               "losses": []}
    server = flower_sim.flower_server_app(ns, figures)
    client = flower_sim.flower_client_app()
    backend = {"init_args": {"num_cpus": ns.flower_actors},
               "client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    figures["started"] = started = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=ns.child_devices,
                   backend_config=backend)  # type: ignore[arg-type]
    figures["run_s"] = time.perf_counter() - started
    figures["versions"] = {"flwr": flwr.__version__, "ray": ray.__version__,
                           "torch": torch.__version__}
    return figures


# -- the parent ------------------------------------------------------------------------


def _proc_stats() -> dict[int, tuple[int, int, int]]:
    stats: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                pid, ppid, sid, start = parse_stat(Path(entry.path, "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            stats[pid] = (ppid, sid, start)
    return stats


def _pss(pid: int) -> int:
    try:
        return pss_kib(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except OSError:
        return 0


class Sampler(threading.Thread):
    """Samples the PSS of an arm's processes every ``interval`` s; keeps the max sum."""

    def __init__(self, root: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.known: set[tuple[int, int]] = set()
        self.peak_kib, self.peak_procs, self.samples = 0, 0, 0
        self.ticks: dict[tuple[int, int], int] = {}  # the last CPU ticks seen per process
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            stats = _proc_stats()
            pids = tree(stats, self.root, self.known)
            self.known |= {(p, stats[p][2]) for p in pids}
            for p in pids:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    self.ticks[(p, stats[p][2])] = cpu_ticks(Path(f"/proc/{p}/stat").read_text())
            total = sum(_pss(p) for p in pids)
            self.samples += 1
            if total > self.peak_kib:
                self.peak_kib, self.peak_procs = total, len(pids)
            self.done.wait(self.interval)

    def leftovers(self) -> set[int]:
        """Processes still alive in the arm's session (Ray's, if it left any)."""
        return {p for p, (_, sid, _) in _proc_stats().items() if sid == self.root} - {
            os.getpid()}


def child_env() -> dict[str, str]:
    """The arms' environment: no proxies, one thread per numeric library, the
    repository and bench/ importable (Ray's workers too)."""
    env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), str(BENCH), env.get("PYTHONPATH")]))
    return env


def run_arm(ns: argparse.Namespace, arm: str, devices: int, repeat: int,
            log_dir: Path | None) -> dict[str, Any]:
    """One arm in a fresh process (its own session); its row."""
    python = sys.executable if arm == "aiopipe" else str(FLOWER_VENV / "bin" / "python")
    cmd = [python, str(Path(__file__).resolve()), "--child", arm, "--child-devices",
           str(devices), "--rounds", str(ns.rounds), "--fraction", str(ns.fraction),
           "--samples-per-device", str(ns.samples_per_device), "--batch-size",
           str(ns.batch_size), "--flower-actors", str(ns.flower_actors)]
    row: dict[str, Any] = {"devices": devices, "arm": arm, "repeat": repeat,
                           "load1": os.getloadavg()[0]}
    started = time.perf_counter()
    stderr = (open(log_dir / f"{arm}-k{devices}-r{repeat}.log", "w")  # noqa: SIM115
              if log_dir else subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=child_env(), start_new_session=True, cwd=REPO)
    sampler = Sampler(proc.pid, ns.interval)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        row["error"] = f"timed out after {ns.timeout} s"
    row["total_s"] = time.perf_counter() - started
    sampler.done.set()
    sampler.join()
    for pid in sampler.leftovers():  # only processes this arm started
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if not isinstance(stderr, int):
        stderr.close()
    row.update(peak_pss_kib=sampler.peak_kib, peak_procs=sampler.peak_procs,
               pss_samples=sampler.samples, returncode=proc.returncode,
               # CPU of the arm's processes as last sampled (up to --interval s short)
               cpu_s=sum(sampler.ticks.values()) / os.sysconf("SC_CLK_TCK"))
    lines = [x for x in out.splitlines() if x.startswith(MARK)]
    if not lines:
        row.setdefault("error", f"no result (exit {proc.returncode})")
        return row
    figures = json.loads(lines[-1][len(MARK):])
    row["round1_s"], row["round_s"] = round_seconds(figures["ends"])
    row["accuracy"] = figures["accuracies"][-1] if figures["accuracies"] else float("nan")
    row.update({k: figures[k] for k in ("run_s", "ends", "accuracies", "samples",
                                         "sampled", "losses", "versions")})
    if len(figures["ends"]) != ns.rounds:
        row.setdefault("error", f"{len(figures['ends'])} of {ns.rounds} rounds")
    return row


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--devices", default="100,1000", help="comma-separated Ks")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.1,
                        help="devices sampled per round, a fraction of K")
    parser.add_argument("--samples-per-device", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved pairs per K")
    parser.add_argument("--flower-actors", type=int, default=1,
                        help="Ray's CPUs, one ClientApp each (default 1: as aiopipe's one "
                             "compute thread)")
    parser.add_argument("--arms", default="aiopipe,flower")
    parser.add_argument("--interval", type=float, default=0.5, help="PSS sampling period")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per arm")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--logs", type=Path, help="keep each arm's stderr in this folder")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--child-devices", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        figures = child_aiopipe(ns) if ns.child == "aiopipe" else child_flower(ns)
        figures = {k: v for k, v in figures.items() if k != "started"}
        print(MARK + json.dumps(figures), flush=True)
        return 0
    arms = [a for a in ns.arms.split(",") if a]
    if ns.logs:
        ns.logs.mkdir(parents=True, exist_ok=True)
    print(f"load before: {uptime()}", flush=True)
    rows: list[dict[str, Any]] = []
    for devices in (int(k) for k in ns.devices.split(",") if k.strip()):
        for repeat in range(ns.repeats):
            for arm in arms:
                row = run_arm(ns, arm, devices, repeat, ns.logs)
                rows.append(row)
                print(f"# {arm} K={devices} rep {repeat}: total {row['total_s']:.1f} s, "
                      f"s/round {row.get('round_s', float('nan')):.2f}, peak PSS "
                      f"{row['peak_pss_kib'] / 1024:.0f} MiB {row.get('error', '')}",
                      flush=True)
    after = uptime()
    for devices in sorted({r["devices"] for r in rows}):
        drawn = {r["arm"]: r.get("sampled") for r in rows if r["devices"] == devices}
        same = len({json.dumps(v) for v in drawn.values()}) == 1
        print(f"K={devices}: same devices trained in every round on both sides: {same}; "
              f"{agreement(rows, devices)}")
    print(table(rows))
    print()
    print(summary(rows))
    print(f"load after: {after}")
    if ns.json:
        ns.json.write_text(json.dumps({"rows": rows, "load_after": after}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
