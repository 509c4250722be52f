"""Really shaped links between real processes: network namespaces, veth pairs, tc tbf.

Theory of operation. `open_topology` builds, as root, a star of network namespaces of its
own (all names start with ``aiopipe-<pid>-``):

    aiopipe-<pid>-srv        bridge br0 10.213.0.1/24, one port v<k> per device
      ├── v0 ══ eth0  aiopipe-<pid>-d0   10.213.0.10
      ├── v1 ══ eth0  aiopipe-<pid>-d1   10.213.0.11
      └── ...

Each direction is shaped on its sending side with a token bucket (``tc qdisc ... tbf``,
netem is not available on these machines): the device's ``eth0`` egress at the uplink
rate, the server's ``v<k>`` egress at device k's downlink rate. The queue is kept short
(``latency 50ms``) so that the ACKs of a download never wait long behind upload data
(see NETWORK-EMULATION.md). The 10.213.0.0/24 addresses exist only inside these
namespaces: nothing created here can reach any other network.

`probe` measures each direction with a tiny TCP sender and receiver (this file, run with
``ip netns exec``; bounded in time) and reports Mbit/s of payload.

Cleanup is guaranteed three ways: the context manager deletes what it created (after
killing, by pid, any process still inside those namespaces), an ``atexit`` hook deletes
whatever a crash left behind, and SIGTERM/SIGHUP are turned into `SystemExit` so that
``with`` blocks unwind. Namespaces this process did not create are never touched.

When namespaces cannot be used (not root, no ``ip``, or ``ip netns add`` fails),
`unavailable_reason` says why in one line; callers then fall back to aiopipe's own
sender-side shaping over loopback.

    sudo .venv/bin/python bench/netns.py check [--devices 4] [--network 4g] [--seconds 2]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType

__all__ = [
    "NETWORKS",
    "ProbeResult",
    "Topology",
    "open_topology",
    "probe",
    "shape",
    "unavailable_reason",
]

#: PiPar's presets (pipar.txt §5.1): (uplink, downlink) Mbit/s.
NETWORKS = {"4g": (10.0, 25.0), "4g+": (20.0, 40.0), "wifi": (50.0, 50.0)}

SUBNET = "10.213.0"
SERVER_IP = f"{SUBNET}.1"
COMMAND_TIMEOUT = 20.0  # seconds for one ip/tc command
PROBE_PORT = 5201

_created: list[str] = []  # namespaces this process created and has not deleted yet


@dataclass(frozen=True, slots=True)
class Topology:
    """A server namespace and one namespace per device, joined by veth pairs on a bridge."""

    prefix: str
    server_ns: str
    device_ns: tuple[str, ...]
    server_ip: str = SERVER_IP

    @property
    def devices(self) -> int:
        """Number of device namespaces."""
        return len(self.device_ns)

    def device_ip(self, k: int) -> str:
        """Address of device ``k`` (inside its namespace)."""
        return f"{SUBNET}.{10 + k}"

    def in_server(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the server's namespace."""
        return ["ip", "netns", "exec", self.server_ns, *command]

    def in_device(self, k: int, command: Sequence[str]) -> list[str]:
        """``command`` run inside device ``k``'s namespace."""
        return ["ip", "netns", "exec", self.device_ns[k], *command]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Measured TCP payload rate of one direction of one device's link."""

    device: int
    direction: str  # "up", "down", "up (both)", "down (both)"
    mbps: float
    target_mbps: float


def _run(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one short system command (bounded in time).

    Raises:
        OSError: the command failed (with its stderr) or did not finish in time.
    """
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise OSError(f"{' '.join(command)}: no answer within {COMMAND_TIMEOUT:g} s") from None
    if check and done.returncode != 0:
        raise OSError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, in one line; None when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed"
    name = f"aiopipe-{os.getpid()}-check"
    try:
        _run(["ip", "netns", "add", name])
    except OSError as exc:
        return f"ip netns add failed ({exc})"
    try:
        _run(["ip", "netns", "exec", name, "tc", "qdisc", "show"])
    except OSError as exc:
        return f"tc does not work in a namespace ({exc})"
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return None


def _add_namespace(name: str, notsent_lowat: int | None) -> None:
    _run(["ip", "netns", "add", name])
    _created.append(name)
    _run(["ip", "-n", name, "link", "set", "lo", "up"])
    if notsent_lowat is not None:  # [Note: send-time visibility]
        _run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "sysctl",
                "-q",
                "-w",
                f"net.ipv4.tcp_notsent_lowat={notsent_lowat}",
            ]
        )


def _kill_inside(name: str) -> None:
    """SIGKILL, by pid, every process still inside our namespace ``name``."""
    done = _run(["ip", "netns", "pids", name], check=False)
    for word in done.stdout.split():
        if word.isdigit() and int(word) != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(word), signal.SIGKILL)


def _delete(names: Sequence[str]) -> list[str]:
    """Delete our namespaces ``names`` (devices first); the ones that failed."""
    failed = []
    for name in reversed(names):
        if name not in _created:
            continue  # never delete a namespace we did not create
        _kill_inside(name)
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            _created.remove(name)
        else:
            failed.append(name)
    return failed


def _cleanup_all() -> None:
    failed = _delete(list(_created))
    if failed:
        print(
            f"netns: could not delete {', '.join(failed)}; run: ip netns del NAME", file=sys.stderr
        )


atexit.register(_cleanup_all)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def open_topology(
    devices: int,
    *,
    up_mbps: float | None = None,
    down_mbps: float | None = None,
    notsent_lowat: int | None = 16384,
) -> Iterator[Topology]:
    """Build the namespaces, bridge and veth pairs; shape them if rates are given.

    ``notsent_lowat`` sets ``net.ipv4.tcp_notsent_lowat`` in every namespace (None: the
    kernel default) so that a sender's write completes close to when its bytes are on
    the wire. [Note: send-time visibility] Under tc shaping the sender's kernel buffer
    (autotuned to megabytes) would otherwise swallow a whole activation or model at once,
    and aiopipe's link tracks would show only the time of a memory copy.

    Everything is deleted on exit, also on an exception, SIGTERM or SIGHUP.

    Raises:
        OSError: a namespace, link or qdisc could not be created (what exists is deleted).
        ValueError: ``devices`` is not in 1..200.
    """
    if not 1 <= devices <= 200:
        raise ValueError(f"devices must be in 1..200, got {devices}")
    prefix = f"aiopipe-{os.getpid()}-"
    topology = Topology(prefix, prefix + "srv", tuple(f"{prefix}d{k}" for k in range(devices)))
    names = [topology.server_ns, *topology.device_ns]
    previous = {}
    if hasattr(signal, "SIGHUP"):
        with contextlib.suppress(ValueError):  # not the main thread: leave handlers be
            for signum in (signal.SIGTERM, signal.SIGHUP):
                previous[signum] = signal.signal(signum, _raise_exit)
    try:
        srv = topology.server_ns
        _add_namespace(srv, notsent_lowat)
        _run(["ip", "-n", srv, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", srv, "addr", "add", f"{topology.server_ip}/24", "dev", "br0"])
        _run(["ip", "-n", srv, "link", "set", "br0", "up"])
        for k, ns in enumerate(topology.device_ns):
            _add_namespace(ns, notsent_lowat)
            _run(
                [
                    "ip",
                    "-n",
                    srv,
                    "link",
                    "add",
                    f"v{k}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                ]
            )
            _run(["ip", "-n", srv, "link", "set", f"v{k}", "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{topology.device_ip(k)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        if up_mbps is not None and down_mbps is not None:
            shape(topology, up_mbps, down_mbps)
        yield topology
    finally:
        failed = _delete(names)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if failed:
            print(f"netns: could not delete {', '.join(failed)}", file=sys.stderr)


def tbf_burst_bytes(rate_mbps: float) -> int:
    """The token bucket's burst at ``rate_mbps``: at least one 1514-byte frame and 2 ms of
    traffic at the rate (bytes that leave at once after a quiet spell)."""
    return max(4096, int(rate_mbps * 1e6 / 8 * 0.002))


def _tbf(rate_mbps: float) -> list[str]:
    return ["tbf", "rate", f"{rate_mbps:g}mbit", "burst", str(tbf_burst_bytes(rate_mbps)),
            "latency", "50ms"]


def _tc(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", "netns", "exec", namespace, "tc", *args], check=check)


def shape(topology: Topology, up_mbps: float | None, down_mbps: float | None) -> None:
    """(Re)shape every link: device egress at ``up_mbps``, server egress at ``down_mbps``.

    None for a direction removes its shaping (an unshaped veth).

    Raises:
        OSError: tc failed.
    """
    for k, ns in enumerate(topology.device_ns):
        for where, dev, rate in ((ns, "eth0", up_mbps), (topology.server_ns, f"v{k}", down_mbps)):
            if rate is None:
                _tc(where, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _tc(where, "qdisc", "replace", "dev", dev, "root", *_tbf(rate))


def qdiscs(topology: Topology) -> str:
    """``tc qdisc show`` of every shaped interface (for the report)."""
    lines = []
    for k, ns in enumerate(topology.device_ns):
        for where, dev in ((ns, "eth0"), (topology.server_ns, f"v{k}")):
            out = _tc(where, "qdisc", "show", "dev", dev, check=False).stdout.strip()
            lines.append(f"{where} {dev}: {out}")
    return "\n".join(lines)


# -- throughput probe --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Flow:
    """One probe flow: a receiver and a sender, each inside a namespace."""

    device: int
    direction: str
    target_mbps: float
    receiver_ns: str
    receiver_ip: str
    sender_ns: str
    port: int


def probe(
    topology: Topology, *, up_mbps: float, down_mbps: float, seconds: float = 2.0, both: bool = True
) -> list[ProbeResult]:
    """Measure every device's uplink, then downlink (all devices at once), then, with
    ``both``, both directions at the same time.

    Raises:
        OSError: a probe process failed or did not report within its time limit.
    """
    results: list[ProbeResult] = []
    phases = [("up",), ("down",)] + ([("up", "down")] if both else [])
    for phase in phases:
        flows = []
        for k, ns in enumerate(topology.device_ns):
            for direction in phase:
                label = direction if len(phase) == 1 else f"{direction} (both)"
                port = PROBE_PORT + 2 * k + (direction == "down")
                if direction == "up":
                    flow = _Flow(
                        k, label, up_mbps, topology.server_ns, topology.server_ip, ns, port
                    )
                else:
                    flow = _Flow(
                        k, label, down_mbps, ns, topology.device_ip(k), topology.server_ns, port
                    )
                flows.append(flow)
        results += _probe_flows(flows, seconds)
    return results


def _probe_flows(flows: list[_Flow], seconds: float) -> list[ProbeResult]:
    me = [sys.executable, os.path.abspath(__file__)]
    limit = seconds + 15.0
    receivers: list[subprocess.Popen[str]] = []
    senders: list[subprocess.Popen[str]] = []
    try:
        for f in flows:
            receivers.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        f.receiver_ns,
                        *me,
                        "recv",
                        f.receiver_ip,
                        str(f.port),
                        str(limit),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for r in receivers:  # each prints "ready" once listening
            if not _ready(r, COMMAND_TIMEOUT):
                raise OSError(f"probe receiver did not start: {_stderr(r)}")
        for f in flows:
            senders.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        f.sender_ns,
                        *me,
                        "send",
                        f.receiver_ip,
                        str(f.port),
                        str(seconds),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        for f, r in zip(flows, receivers, strict=True):
            try:
                out, err = r.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                raise OSError(f"probe of device {f.device} {f.direction} timed out") from None
            if r.returncode != 0:
                raise OSError(f"probe of device {f.device} {f.direction} failed: {err.strip()}")
            results.append(
                ProbeResult(f.device, f.direction, json.loads(out)["mbps"], f.target_mbps)
            )
        for s in senders:
            s.wait(timeout=limit)
        return results
    finally:
        for p in receivers + senders:
            if p.poll() is None:
                p.kill()
                p.wait()
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()


def _ready(p: subprocess.Popen[str], timeout: float) -> bool:
    """Whether ``p`` printed "ready" within ``timeout`` seconds."""
    if p.stdout is None:
        return False
    readable, _, _ = select.select([p.stdout], [], [], timeout)
    return bool(readable) and p.stdout.readline().strip() == "ready"


def _stderr(p: subprocess.Popen[str]) -> str:
    p.kill()
    _, err = p.communicate()
    return (err or "").strip() or f"exit code {p.returncode}"


def _receive(host: str, port: int, limit: float) -> None:
    """Accept one connection, read to EOF, print {"bytes", "seconds", "mbps"}."""
    with socket.create_server((host, port)) as server:
        server.settimeout(limit)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(limit)
            total, first, last = 0, 0.0, 0.0
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                last = time.monotonic()
                if total == 0:
                    first = last
                total += len(chunk)
    span = max(last - first, 1e-9)
    print(json.dumps({"bytes": total, "seconds": span, "mbps": total * 8 / span / 1e6}))


def _send(host: str, port: int, seconds: float) -> None:
    """Connect (retrying for 5 s) and send zeros for ``seconds``."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = bytes(1 << 16)
    with conn:
        conn.settimeout(seconds + 10.0)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)


def _check(devices: int, network: str, seconds: float) -> int:
    reason = unavailable_reason()
    if reason is not None:
        print(f"netns: namespaces unavailable ({reason})")
        return 1
    up, down = NETWORKS[network]
    with open_topology(devices, up_mbps=up, down_mbps=down) as topology:
        print(qdiscs(topology))
        for r in probe(topology, up_mbps=up, down_mbps=down, seconds=seconds):
            print(
                f"device {r.device} {r.direction:<12} {r.mbps:6.2f} Mbit/s (tbf {r.target_mbps:g})",
                flush=True,
            )
    print(f"netns: cleaned up; left: {_created or 'nothing'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``check``: build, shape, probe and delete a topology; ``recv``/``send``: probe ends."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="build a shaped topology, probe it, delete it")
    check.add_argument("--devices", type=int, default=4)
    check.add_argument("--network", choices=sorted(NETWORKS), default="4g")
    check.add_argument("--seconds", type=float, default=2.0)
    recv = sub.add_parser("recv")
    recv.add_argument("host")
    recv.add_argument("port", type=int)
    recv.add_argument("limit", type=float)
    send = sub.add_parser("send")
    send.add_argument("host")
    send.add_argument("port", type=int)
    send.add_argument("seconds", type=float)
    args = parser.parse_args(argv)
    if args.command == "recv":
        _receive(args.host, args.port, args.limit)
        return 0
    if args.command == "send":
        _send(args.host, args.port, args.seconds)
        return 0
    return _check(args.devices, args.network, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
