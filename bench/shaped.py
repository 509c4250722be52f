"""FL vs SFL vs PiPar (and Flower's FedAvg) over really shaped links between real processes.

For each network, the links are shaped with tc tbf (bench/netns.py: the server in one
network namespace, each device in its own, joined by veth pairs on a bridge; uplink shaped
at the device's egress, downlink at the server's) and checked with a throughput probe.
Then, for each workload and fleet, it runs as separate processes:

    ip netns exec <srv> python -m aiopipe.server --host 10.213.0.1 --port P --no-shaping \
        --network <preset> --mode M ...          (--network still tells the planner the rates)
    ip netns exec <dev k> python -m aiopipe.device --server ws://10.213.0.1:P/ws --device-id k

in the modes fl; sfl at every split point (the best one is reported); pipar with
``--split-point auto --parallel-batches auto`` (``--replan``: re-planning between rounds
too); pipar with a fixed plan (``--pipar-fixed``,
default P=2 N=4: a readable timeline and a check on the planner); and the Flower peer
(bench/flower_peer.py, in its own virtual environment bench/.flower-venv that this script
creates) with the same model, data partition, settings and network. Fleets:
``homogeneous`` (every device slowed ``--device-slowdown`` x) and ``half-slow`` (PiPar
§5.6.1: the second half of the devices twice as slow again).

Without root or network namespaces it says so in one line and falls back to aiopipe's
sender-side shaping over loopback (the Flower peer is then skipped: it has no shaping).

Results go to ``bench/results/<YYYY-MM-DD>/``: ``raw.json``, ``report.md`` and PNG plots
(bench/report.py), plus every run's results directory and logs under ``runs/``.

The namespaces set ``net.ipv4.tcp_notsent_lowat`` (``--notsent-lowat``, default 16 KiB) so
that aiopipe's sender-side link timings stay close to wire time (see bench/netns.py).

The default (vgg5 on synthetic-cifar10, 4 devices x 500 samples, 4g and wifi, both
fleets, 3 epochs; 34 runs) took 22.5 minutes on 2 cores; ``--full`` adds resnet18,
mobilenetv3-small and vgg16 (hours).

    sudo .venv/bin/python bench/shaped.py [--networks 4g,wifi] [--fleet both]
        [--workloads vgg5] [--full] [--epochs 3] [--no-flower] [--no-netns] [--out DIR]
        [--repeat N] [--baseline CHECKOUT]

``--repeat N`` runs every configuration N times, its modes interleaved (fl, Flower, ...,
fl, Flower, ...), so that both arms see the same drift of a shared machine's load;
``--baseline`` names another checkout of aiopipe (a git worktree of the commit before a
change) whose fl runs between this checkout's fl and Flower, as "fl baseline".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import netns  # noqa: E402  (bench/ is not a package)
import report  # noqa: E402

WORKLOADS = {
    "vgg5": "synthetic-cifar10",
    "resnet18": "synthetic-cifar10",
    "mobilenetv3-small": "synthetic-cifar10",
    "vgg16": "synthetic-cifar100",
}
FLEETS = ("homogeneous", "half-slow")
FLOWER_VENV = BENCH / ".flower-venv"
FLOWER_PACKAGES = ["flwr", "torch==2.13.0", "aiohttp", "msgpack", "orjson", "safetensors"]
PORT = 8765
_PROXY_VARS = (
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "grpc_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
)


def log(message: str) -> None:
    """One progress line, stamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def child_env(**extra: str) -> dict[str, str]:
    """Environment of every child: no proxies, one thread per numeric library."""
    env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        FLWR_TELEMETRY_ENABLED="0",
        **extra,
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def with_code(env: dict[str, str], code: Path) -> dict[str, str]:
    """``env`` importing aiopipe from the checkout ``code`` (``--baseline``'s, or this one)."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    return {**env, "PYTHONPATH": os.pathsep.join([str(code), *rest])}


class Processes:
    """The child processes of one run; `kill_all` ends the ones still running (by pid)."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[bytes]] = []

    def start(
        self, argv: Sequence[str], log_path: Path, env: dict[str, str], cwd: Path = REPO
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``cwd`` with stdout and stderr into ``log_path``."""
        with open(log_path, "wb") as out:
            child = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
            )
        self.children.append(child)
        return child

    def kill_all(self) -> None:
        """SIGKILL every child still running and reap it."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)


def _wait_for_text(path: Path, text: str, child: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if child.poll() is not None:
            raise RuntimeError(f"exited with code {child.returncode} before {text!r}")
        time.sleep(0.2)
    raise RuntimeError(f"no {text!r} within {timeout:g} s")


def _tail(path: Path, lines: int = 6) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _credentials(devices: int) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Environments of the server and of each device: a fresh secret, one token per device.

    The token travels in the environment (AIOPIPE_TOKEN_SECRET for the server,
    AIOPIPE_TOKEN for device k), never on a command line.
    """
    try:
        from aiopipe.auth import generate_secret, mint_token
    except ImportError:  # aiopipe before per-device tokens: one shared bearer token
        token = secrets.token_urlsafe(24)
        return child_env(AIOPIPE_TOKEN=token), [child_env(AIOPIPE_TOKEN=token)] * devices
    secret = generate_secret()
    tokens = [mint_token(secret.encode(), k) for k in range(devices)]
    return child_env(AIOPIPE_TOKEN_SECRET=secret), [child_env(AIOPIPE_TOKEN=t) for t in tokens]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Bench:
    """Runs one configuration after another and collects their figures."""

    def __init__(
        self, args: argparse.Namespace, out: Path, topology: netns.Topology | None
    ) -> None:
        self.args = args
        self.out = out
        self.topology = topology
        self.port = PORT
        self.flower_python: Path | None = None
        self.flower_note = ""

    # -- aiopipe ---------------------------------------------------------------------

    def options(
        self, workload: str, network: str, fleet: str, mode: str, extra: Sequence[str]
    ) -> list[str]:
        """Command-line options of one aiopipe server run."""
        a = self.args
        slow = [a.device_slowdown] * a.devices
        if fleet == "half-slow":
            slow = [s * (2.0 if k >= a.devices // 2 else 1.0) for k, s in enumerate(slow)]
        options = [
            "--mode",
            mode,
            "--model",
            workload,
            "--dataset",
            WORKLOADS[workload],
            "--devices",
            str(a.devices),
            "--samples-per-device",
            str(a.samples_per_device),
            "--batch-size",
            str(a.batch_size),
            "--epochs",
            str(a.epochs),
            "--network",
            network,
            "--device-slowdown",
            ",".join(f"{s:g}" for s in slow),
            "--seed",
            str(a.seed),
            *extra,
        ]
        if self.topology is not None:
            options.append("--no-shaping")  # tc shapes the links
        return options

    def run_aiopipe(self, run_dir: Path, options: list[str], code: Path = REPO) -> dict[str, Any]:
        """One aiopipe run (server + devices) of the checkout ``code``; its figures, or an
        ``error``."""
        run_dir.mkdir(parents=True, exist_ok=True)
        server_env, device_envs = _credentials(self.args.devices)
        server_env = with_code(server_env, code)
        device_envs = [with_code(env, code) for env in device_envs]
        self.port += 1
        top = self.topology
        host = top.server_ip if top else "127.0.0.1"
        port = self.port if top else _free_port()
        py = sys.executable
        server = [
            py,
            "-m",
            "aiopipe.server",
            "--host",
            host,
            "--port",
            str(port),
            "--join-timeout",
            "120",
            *options,
            "--out-dir",
            str(run_dir),
        ]
        url = f"ws://{host}:{port}/ws"
        devices = [
            [py, "-m", "aiopipe.device", "--server", url, "--device-id", str(k)]
            for k in range(self.args.devices)
        ]
        if self.args.pin:
            server, devices = pinned(server), [pinned(d, server=False) for d in devices]
        if top is not None:
            server = top.in_server(server)
            devices = [top.in_device(k, d) for k, d in enumerate(devices)]
        record = {"server_command": shlex.join(server), "device_command": shlex.join(devices[0])}
        procs = Processes()
        started = time.perf_counter()
        try:
            srv = procs.start(server, run_dir / "server.log", server_env, code)
            _wait_for_text(run_dir / "server.log", "waiting for", srv, 180)
            devs = [
                procs.start(d, run_dir / f"device{k}.log", device_envs[k], code)
                for k, d in enumerate(devices)
            ]
            try:
                code = srv.wait(timeout=self.args.run_timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"server did not finish within {self.args.run_timeout} s"
                ) from None
            if code != 0:
                raise RuntimeError(
                    f"server exited with code {code}: {_tail(run_dir / 'server.log', 3)}"
                )
            for k, d in enumerate(devs):
                try:
                    if d.wait(timeout=30) != 0:
                        raise RuntimeError(
                            f"device {k} exited with code {d.returncode}: "
                            f"{_tail(run_dir / f'device{k}.log', 3)}"
                        )
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"device {k} still running 30 s after the server") from None
        except RuntimeError as exc:
            return {**record, "error": str(exc), "wall_s": time.perf_counter() - started}
        finally:
            procs.kill_all()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        (run_dir / "model.safetensors").unlink(missing_ok=True)
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)  # GBs for deep models
        return {
            **record,
            "epochs": [json.loads(line) for line in lines if line.strip()],
            "wall_s": time.perf_counter() - started,
        }

    # -- Flower ----------------------------------------------------------------------

    def prepare_flower(self) -> None:
        """Create bench/.flower-venv with flwr (once); on failure say why and go on."""
        python = FLOWER_VENV / "bin" / "python"
        check = [
            str(python),
            "-c",
            "import flwr, torch, aiohttp, msgpack, orjson, safetensors; print(flwr.__version__)",
        ]
        try:
            if not python.exists():
                log(
                    f"creating {FLOWER_VENV.relative_to(REPO)} (python -m venv; "
                    f"pip install {' '.join(FLOWER_PACKAGES)})"
                )
                subprocess.run(
                    [sys.executable, "-m", "venv", str(FLOWER_VENV)],
                    check=True,
                    timeout=300,
                    capture_output=True,
                )
            if (
                subprocess.run(check, capture_output=True, timeout=120, env=child_env()).returncode
                != 0
            ):
                done = subprocess.run(
                    [str(python), "-m", "pip", "install", "-q", *FLOWER_PACKAGES],
                    capture_output=True,
                    text=True,
                    timeout=1800,
                )
                if done.returncode != 0:
                    lines = [
                        x
                        for x in done.stderr.splitlines()
                        if x.strip() and not x.startswith("WARNING: Location")
                    ]
                    raise RuntimeError(f"pip install failed: {' | '.join(lines[-3:])}")
            done = subprocess.run(
                check, capture_output=True, text=True, timeout=120, env=child_env()
            )
            if done.returncode != 0:
                raise RuntimeError(f"flwr does not import: {done.stderr.strip()[-300:]}")
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self.flower_note = f"Flower peer not run: {exc}"
            log(self.flower_note)
            return
        self.flower_python = python
        log(f"Flower peer: flwr {done.stdout.strip()} in {FLOWER_VENV.relative_to(REPO)}")

    def run_flower(self, run_dir: Path, config_path: Path) -> dict[str, Any]:
        """Flower FedAvg with the aiopipe FL run's config.toml; its rounds, or an ``error``."""
        top = self.topology
        if top is None or self.flower_python is None:
            return {"error": self.flower_note or "no shaped network for Flower"}
        run_dir.mkdir(parents=True, exist_ok=True)
        self.port += 1
        address = f"{top.server_ip}:{self.port}"
        peer = [str(self.flower_python), str(BENCH / "flower_peer.py")]
        server = top.in_server(
            [
                *peer,
                "server",
                "--address",
                address,
                "--config",
                str(config_path),
                "--out",
                str(run_dir / "flower.json"),
                "--round-timeout",
                str(self.args.run_timeout),
            ]
        )
        clients = [
            top.in_device(
                k,
                [
                    *peer,
                    "client",
                    "--server",
                    address,
                    "--config",
                    str(config_path),
                    "--device-id",
                    str(k),
                ],
            )
            for k in range(self.args.devices)
        ]
        record = {"server_command": shlex.join(server), "device_command": shlex.join(clients[0])}
        procs = Processes()
        env = child_env()
        started = time.perf_counter()
        try:
            srv = procs.start(server, run_dir / "server.log", env)
            _wait_for_text(run_dir / "server.log", "[INIT]", srv, 180)
            cls = [procs.start(c, run_dir / f"client{k}.log", env) for k, c in enumerate(clients)]
            try:
                code = srv.wait(timeout=self.args.run_timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"Flower server did not finish within {self.args.run_timeout} s"
                ) from None
            if code != 0 or not (run_dir / "flower.json").exists():
                raise RuntimeError(
                    f"Flower server exited with code {code}: {_tail(run_dir / 'server.log', 3)}"
                )
            for c in cls:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.wait(timeout=30)
        except RuntimeError as exc:
            return {**record, "error": str(exc), "wall_s": time.perf_counter() - started}
        finally:
            procs.kill_all()
        data = json.loads((run_dir / "flower.json").read_text())
        return {
            **record,
            "epochs": data["rounds"],
            "flwr": data["flwr"],
            "wall_s": time.perf_counter() - started,
        }

    # -- one configuration -------------------------------------------------------------

    def configuration(
        self, workload: str, network: str, fleet: str, repeat: int = 0
    ) -> dict[str, Any]:
        """Every mode of one (workload, network, fleet), its ``repeat``-th time (0: first)."""
        from aiopipe.data import open_dataset
        from aiopipe.models import build, unit_count

        data = open_dataset(WORKLOADS[workload], split="test", size=1)
        units = unit_count(build(workload, num_classes=data.num_classes, in_shape=data.in_shape))
        base = self.out / "runs" / workload / f"{network}-{fleet}"
        if repeat:
            base = base.with_name(f"{base.name}-r{repeat + 1}")
        runs: dict[str, Any] = {}

        def run(label: str, mode: str, extra: Sequence[str] = (), code: Path = REPO) -> None:
            options = self.options(workload, network, fleet, mode, extra)
            result = self.run_aiopipe(base / _dirname(label), options, code)
            runs[label] = result
            _say(label, result)

        splits = (
            range(1, units)
            if self.args.sfl_splits == "all"
            else [int(p) for p in self.args.sfl_splits.split(",") if 0 < int(p) < units]
        )
        if "fl" in self.args.modes:
            run("fl", "fl")
            if self.args.baseline is not None:  # the code before a change, between the two
                run("fl baseline", "fl", code=self.args.baseline)
            if self.flower_python is not None:
                result = self.run_flower(base / "flower", base / "fl" / "config.toml")
                runs["flower"] = result
                _say("flower", result)
        if "auto" in self.args.modes:  # mode auto's choice, beside fl and Flower
            run("auto", "auto")
        if "sfl" in self.args.modes:
            for p in splits:
                run(f"sfl P={p}", "sfl", ["--split-point", str(p)])
        if "pipar" in self.args.modes:
            auto = ["--split-point", "auto", "--parallel-batches", "auto"]
            run("pipar", "pipar", [*auto, "--replan"] if self.args.replan else auto)
            for p, n in self.args.pipar_fixed:  # hand-picked plans beside the planner's
                if 0 < p < units:
                    run(
                        f"pipar P={p} N={n}",
                        "pipar",
                        ["--split-point", str(p), "--parallel-batches", str(n)],
                    )
        for label in runs:  # traces are kept for fl and pipar only (size)
            trace = base / _dirname(label) / "trace.json"
            if label.startswith(("pipar", "fl")) and trace.exists():
                runs[label]["trace"] = str(trace.relative_to(self.out))
            elif label != "flower":
                trace.unlink(missing_ok=True)
                (base / _dirname(label) / "timeline.png").unlink(missing_ok=True)
        return {
            "workload": workload,
            "dataset": WORKLOADS[workload],
            "network": network,
            "fleet": fleet,
            "repeat": repeat + 1,
            "units": units,
            "runs": runs,
            "options": self.options(workload, network, fleet, "MODE", []),
        }


def _dirname(label: str) -> str:
    return label.replace(" ", "-").replace("=", "")


def _say(label: str, result: dict[str, Any]) -> None:
    if "error" in result:
        log(f"  {label:<10} FAILED: {result['error']}")
        return
    epochs = result["epochs"]
    measured = epochs[1:] or epochs
    mean = sum(e["time_s"] for e in measured) / len(measured)
    plan = ""
    if epochs and epochs[-1].get("plan"):
        plan = " plan " + ",".join(
            f"P{p['split_point']}N{p['parallel_batches']}" for p in epochs[-1]["plan"]
        )
    # the devices' training seconds (aiopipe: compute busy; Flower: the fit loop), mean
    trained = [e.get("busy_s", {}).get("device", e.get("train_s")) for e in measured]
    train = (
        f"  train {sum(trained) / len(trained):6.2f} s" if trained and None not in trained else ""
    )
    log(
        f"  {label:<10} epoch {mean:7.2f} s{train}  acc {epochs[-1]['accuracy']:.3f}  "
        f"(wall {result['wall_s']:.0f} s){plan}"
    )


def machine() -> dict[str, Any]:
    """Where and with what the bench ran."""
    import aiohttp
    import torch

    import aiopipe

    mem = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        "0",
    )
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    dirty = subprocess.run(
        # tracked files only: the bench's own results are untracked until committed
        ["git", "-C", str(REPO), "status", "--porcelain", "-uno"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(int(mem) / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "aiohttp": aiohttp.__version__,
        "aiopipe": aiopipe.__version__,
        "git": git + (" (uncommitted changes)" if dirty else ""),
    }


def pinned(command: Sequence[str], *, server: bool = True) -> list[str]:
    """``command`` under ``taskset``: the server on CPU 0, a device on every other CPU
    (``--pin``: the devices' compute and event loops never take the server's core)."""
    cores = os.cpu_count() or 1
    if cores < 2:
        raise RuntimeError("--pin needs at least 2 CPUs (the server's and the devices')")
    return ["taskset", "-c", "0" if server else f"1-{cores - 1}", *command]


def _pairs(text: str) -> list[tuple[int, int]]:
    if text == "none":
        return []
    try:
        return [
            (int(p), int(n))
            for p, n in (pair.split(",") for pair in text.split(";") if pair.strip())
        ]
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected P,N[;P,N...] or "none", got {text!r}') from None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The bench's options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument(
        "--workloads", default="vgg5", help=f"comma list of {', '.join(WORKLOADS)} (default vgg5)"
    )
    parser.add_argument(
        "--full", action="store_true", help="every workload and network (4g, 4g+, wifi): hours"
    )
    parser.add_argument("--networks", default="4g,wifi", help="comma list of 4g, 4g+, wifi")
    parser.add_argument("--fleet", choices=[*FLEETS, "both"], default="both")
    parser.add_argument("--modes", default="fl,sfl,pipar",
                        help="comma list of fl, sfl, pipar, auto (mode auto's choice)")
    parser.add_argument(
        "--sfl-splits", default="all", help='SFL split points to try: "all" or a comma list'
    )
    parser.add_argument(
        "--pipar-fixed",
        type=_pairs,
        default=[(2, 4)],
        metavar="P,N[;P,N...]",
        help='also run PiPar with these fixed plans (default 2,4; "none" to skip)',
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="taskset: the server on CPU 0, the devices on the other CPUs",
    )
    parser.add_argument(
        "--replan", action="store_true", help="PiPar auto re-plans between rounds (--replan)"
    )
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--samples-per-device", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--device-slowdown",
        type=float,
        default=4.0,
        help="compute slowdown of every device (half-slow: x2 for half)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every configuration this many times, the modes interleaved "
        "(fl, flower, ..., fl, flower, ...: both arms see the same drift of the load)",
    )
    parser.add_argument("--probe-seconds", type=float, default=2.0)
    parser.add_argument(
        "--run-timeout", type=int, default=1200, help="seconds one run may take (default 1200)"
    )
    parser.add_argument(
        "--notsent-lowat",
        type=int,
        default=16384,
        help="net.ipv4.tcp_notsent_lowat in the namespaces, bytes (0: kernel "
        "default); keeps send times close to wire times (default 16384)",
    )
    parser.add_argument(
        "--no-flower", dest="flower", action="store_false", help="skip the Flower peer"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of aiopipe (e.g. a git worktree of the commit before a "
        'change): its fl runs too, as "fl baseline", between this checkout\'s fl and Flower',
    )
    parser.add_argument(
        "--no-netns",
        action="store_true",
        help="do not use namespaces: sender-side shaping over loopback",
    )
    parser.add_argument(
        "--out", type=Path, help="results directory (default bench/results/<YYYY-MM-DD>)"
    )
    args = parser.parse_args(argv)
    if args.full:
        args.workloads, args.networks = ",".join(WORKLOADS), "4g,4g+,wifi"
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "aiopipe" / "__init__.py").is_file():
            parser.error(f"--baseline: no aiopipe checkout at {args.baseline}")
    for name, allowed in (
        ("workloads", WORKLOADS),
        ("networks", netns.NETWORKS),
        ("modes", ("fl", "sfl", "pipar", "auto")),
    ):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"--{name}: unknown {bad or 'empty'}; choose from {', '.join(allowed)}")
        setattr(args, name, values)
    if args.devices < 1 or args.epochs < 1 or args.device_slowdown < 1 or args.repeat < 1:
        parser.error("--devices, --epochs and --repeat must be >= 1, --device-slowdown >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; write raw.json, report.md and the plots."""
    args = parse(argv)
    # absolute: a --baseline checkout's runs start in that checkout
    out = (args.out or BENCH / "results" / time.strftime("%Y-%m-%d")).resolve()
    if out.exists() and any(out.iterdir()) and args.out is None:
        out = out.with_name(f"{out.name}-{time.strftime('%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    python = Path(sys.executable)
    shown = str(python.relative_to(REPO)) if python.is_relative_to(REPO) else str(python)
    command = shlex.join([shown, "bench/shaped.py", *(sys.argv[1:] if argv is None else argv)])
    fleets = list(FLEETS) if args.fleet == "both" else [args.fleet]
    raw: dict[str, Any] = {
        "command": command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine(),
        "load_before": os.getloadavg(),
        "settings": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("out",)
        },
        "fleets": fleets,
        "networks": {},
        "configurations": [],
        "flower_note": "",
    }
    log(f"shaped bench -> {out}")
    reason = None if args.no_netns else netns.unavailable_reason()
    if args.no_netns:
        reason = "--no-netns given"
    if reason is not None:
        print(
            f"shaped: network namespaces unavailable ({reason}); falling back to aiopipe's "
            f"sender-side shaping over loopback (no tc, no probe, no Flower peer)",
            flush=True,
        )
    raw["shaping"] = (
        "tc tbf on veth pairs between network namespaces"
        if reason is None
        else f"aiopipe sender-side shaping over loopback ({reason})"
    )
    started = time.perf_counter()
    try:
        if reason is None:
            lowat = args.notsent_lowat or None
            with netns.open_topology(args.devices, notsent_lowat=lowat) as topology:
                bench = Bench(args, out, topology)
                if args.flower and "fl" in args.modes:
                    bench.prepare_flower()
                _sweep(bench, raw, fleets, lambda net: _shape_and_probe(topology, net, args))
        else:
            bench = Bench(args, out, None)
            bench.flower_note = "Flower peer not run: no network namespaces " + f"({reason})"
            _sweep(
                bench,
                raw,
                fleets,
                lambda net: dict(
                    zip(("up_mbps", "down_mbps"), netns.NETWORKS[net], strict=True), probe=[]
                ),
            )
        raw["flower_note"] = bench.flower_note
    finally:
        raw["wall_s"] = time.perf_counter() - started
        raw["load_after"] = os.getloadavg()
        (out / "raw.json").write_text(json.dumps(raw, indent=1))
    path = report.write_report(out)
    log(f"done in {raw['wall_s'] / 60:.1f} min; report {path}")
    return 0


def _shape_and_probe(
    topology: netns.Topology, network: str, args: argparse.Namespace
) -> dict[str, Any]:
    up, down = netns.NETWORKS[network]
    netns.shape(topology, up, down)
    results = netns.probe(topology, up_mbps=up, down_mbps=down, seconds=args.probe_seconds)
    for direction in ("up", "down", "up (both)", "down (both)"):
        rates = [r.mbps for r in results if r.direction == direction]
        log(
            f"probe {network} {direction:<11} tbf {up if 'up' in direction else down:g} "
            f"Mbit/s: measured {' '.join(f'{x:.1f}' for x in rates)}"
        )
    return {
        "up_mbps": up,
        "down_mbps": down,
        "qdiscs": netns.qdiscs(topology),
        "probe": [
            {
                "device": r.device,
                "direction": r.direction,
                "mbps": r.mbps,
                "tbf_mbps": r.target_mbps,
            }
            for r in results
        ],
    }


def _sweep(
    bench: Bench, raw: dict[str, Any], fleets: list[str], prepare: Callable[[str], dict[str, Any]]
) -> None:
    args = bench.args
    for network in args.networks:
        raw["networks"][network] = prepare(network)
        for workload in args.workloads:
            for fleet in fleets:
                for repeat in range(args.repeat):
                    log(f"{workload} | {network} | {fleet} | run {repeat + 1}/{args.repeat}")
                    raw["configurations"].append(
                        bench.configuration(workload, network, fleet, repeat)
                    )
                    (bench.out / "raw.json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    sys.exit(main())
