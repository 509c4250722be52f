"""Harness for faults between real processes (tests/test_stall_processes.py and
bench/recovery.py): ``python -m aiopipe.server`` and ``python -m aiopipe.device`` as child
processes whose output is read line by line, each line stamped with the
``time.monotonic()`` at which it arrived, and a TCP proxy to put between a device and the
server.

The proxy forwards bytes both ways between each client connection and a target address.
On request it *stalls*: it stops moving bytes in both directions on every connection, old
and new, and keeps every socket open, so that to both ends the network looks silent
rather than broken (no FIN, no RST; what the kernel buffers is held, and delivered once
the proxy resumes). It can also *drop* its connections: reset both sockets of each, as a
NAT box that forgot them would.

Safe to run side by side (pytest-xdist): servers and devices' peer ports bind port 0
(the server's port is read from its first line, a device's peer port from /proc:
`listening_port`), and every run writes into its test's own directory. Cheap: the
processes draw no pictures (`NO_PICTURES`) unless asked to, and a node started again
after a fault can be started warm (`ProcessFleet.start_warm`), so that a run need not
train on for the seconds a new process spends importing torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from forked import forked, use_zygote

from aiopipe.config import RunConfig
from aiopipe.forkserver import ForkedProcess
from aiopipe.runtime.systems.registry import option_owners, options_of

__all__ = ["NO_PICTURES", "REPO", "Line", "Output", "Process", "ProcessFleet", "TcpProxy",
           "check_pipeline_figures", "child_env", "listening_port"]

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 16
#: On a process's PYTHONPATH: matplotlib cannot be imported there, so a run draws no
#: ``timeline.png`` or ``overview.png`` (seconds of a loaded machine's time per run, for
#: pictures these tests do not look at; tests/test_cli.py checks a real run's)
NO_PICTURES = REPO / "tests" / "no_pictures"


def child_env(extra: Mapping[str, str] | None = None, *, pictures: bool = False
              ) -> dict[str, str]:
    """The environment of a ``python -m aiopipe...`` child process: this one's, with
    ``extra`` added, the repository importable (a PYTHONPATH in ``extra`` goes first),
    unbuffered output, and matplotlib out of reach unless ``pictures``."""
    extra = dict(extra or {})
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        extra.get("PYTHONPATH"), str(REPO), None if pictures else str(NO_PICTURES),
        os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def listening_port(pid: int, within: float = 120.0) -> int:
    """The TCP port process ``pid`` listens on (its first; e.g. a device's peer port after
    ``--listen 127.0.0.1:0``), once it listens.

    Raises:
        TimeoutError: it listened on none within ``within`` seconds.
    """
    deadline = time.monotonic() + within
    while (port := _listening(pid)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} listens on no TCP port")
        await asyncio.sleep(0.1)
    return port


def _listening(pid: int) -> int | None:
    """A TCP port process ``pid`` listens on now (from /proc), or None."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    return int(fields[1].rpartition(":")[2], 16)
    return None


class TcpProxy:
    """Forward ``127.0.0.1:port`` to ``target_host:target_port``; use as ``async with``.

    ``connections`` counts the client connections accepted so far.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.connections = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = set()

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._server is not None
        self._server.close()
        self._flowing.set()
        self.drop()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def stalled(self) -> bool:
        """Whether the proxy holds every byte now."""
        return not self._flowing.is_set()

    def stall(self) -> None:
        """Stop moving bytes, in both directions, on every connection; keep them open."""
        self._flowing.clear()

    def resume(self) -> None:
        """Move bytes again (first those held during the stall)."""
        self._flowing.set()

    def drop(self) -> None:
        """Reset every current connection, on both sides."""
        for client, upstream in list(self._pairs):
            client.transport.abort()
            if upstream is not None:
                upstream.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter | None] = (writer, None)
        self._pairs.add(pair)
        upstream: asyncio.StreamWriter | None = None
        try:
            await self._flowing.wait()  # a silent network does not connect either
            try:
                up_reader, upstream = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._pairs.discard(pair)
            pair = (writer, upstream)
            self._pairs.add(pair)
            pumps = [asyncio.create_task(self._pump(reader, upstream)),
                     asyncio.create_task(self._pump(up_reader, writer))]
            try:
                # one side closed (or failed): the connection is over for both
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._pairs.discard(pair)
            for end in (writer, upstream):
                if end is not None:
                    end.close()
                    with contextlib.suppress(OSError):
                        await end.wait_closed()
            self._handlers.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    return
                await self._flowing.wait()  # a stall that began meanwhile holds these too
                writer.write(data)
                await writer.drain()


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a process's output and when it arrived (``time.monotonic()``)."""

    at: float
    text: str


@dataclass
class Output:
    """A process's output (stdout and stderr together), line by line, as it arrives."""

    lines: list[Line] = field(default_factory=list)
    closed: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self, stream: asyncio.StreamReader) -> None:
        """Collect ``stream`` until its end."""
        try:
            while line := await stream.readline():
                self.lines.append(Line(time.monotonic(), line.decode(errors="replace").rstrip()))
                self._changed.set()
        finally:
            self.closed = True
            self._changed.set()

    def find(self, pattern: str, *, since: float = 0.0) -> list[Line]:
        """Lines that arrived at or after ``since`` and match ``pattern`` (`re.search`)."""
        return [line for line in self.lines
                if line.at >= since and re.search(pattern, line.text)]

    async def wait_for(self, pattern: str, *, since: float = 0.0,
                       within: float = 120.0) -> Line:
        """The first line at or after ``since`` that matches ``pattern``; waits for it.

        Raises:
            TimeoutError: no such line within ``within`` seconds (or the output ended);
                the message holds the output so far.
        """
        deadline = time.monotonic() + within
        while not (found := self.find(pattern, since=since)):
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                raise TimeoutError(f"no line matching {pattern!r} in:\n{self.text()}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return found[0]

    def text(self) -> str:
        """Everything so far, one line per line."""
        return "\n".join(line.text for line in self.lines)


@dataclass
class Process:
    """A child process and its output."""

    name: str
    process: asyncio.subprocess.Process | ForkedProcess
    output: Output
    reader: asyncio.Task[None]

    def send_signal(self, signal: int) -> None:
        """Send ``signal`` (if the process still runs)."""
        if self.process.returncode is None:
            self.process.send_signal(signal)

    async def wait(self, within: float) -> int:
        """Its exit status (after its output has been read to the end).

        Raises:
            TimeoutError: it did not exit within ``within`` seconds.
        """
        async with asyncio.timeout(within):
            code = await self.process.wait()
            await self.reader
        return code


class ProcessFleet:
    """Server and device processes of one run; ``async with`` kills what still runs.

    Args:
        directory: where the run's config file and results go.
        config: run keys for the server's ``--config`` file (TOML: numbers, strings,
            booleans); the run's system's options among them go in its table
            (``[hadfl]``).
        pictures: whether the processes may draw the results' pictures (`NO_PICTURES`).
    """

    def __init__(self, directory: Path, config: Mapping[str, object], *,
                 pictures: bool = False) -> None:
        self.directory = directory
        self.config = dict(config)  # the run's keys
        self.pictures = pictures
        self.config_file = directory / "run.toml"
        owners = option_owners()
        top = "".join(f"{k} = {_toml(v)}\n" for k, v in config.items() if k not in owners)
        own = "".join(f"{k} = {_toml(v)}\n" for k, v in config.items() if k in owners)
        if own:
            table = options_of(str(config.get("mode", RunConfig().mode))).table
            top += f"[{table}]\n{own}"
        self.config_file.write_text(top)
        self.out_dir = directory / "run"
        self.processes: list[Process] = []
        self.url = ""

    async def __aenter__(self) -> ProcessFleet:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        for p in self.processes:
            if p.process.returncode is None:
                p.process.kill()
        for p in self.processes:
            with contextlib.suppress(TimeoutError):
                await p.wait(30)

    async def start(self, name: str, args: Sequence[str], *,
                    env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Process:
        """Start ``python -m ARGS`` in ``cwd`` (default: the fleet's directory) with the
        repository importable (and ``env`` added to the environment; a PYTHONPATH there
        goes first): `child_env`."""
        environment = child_env(env, pictures=self.pictures)
        where = cwd or self.directory
        process: asyncio.subprocess.Process | ForkedProcess
        if use_zygote():  # forked warm (tests/forked.py): the same process, seconds sooner
            process, stdout = await forked(args, environment, where)
        else:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", *args, env=environment, cwd=where,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
            assert process.stdout is not None
            stdout = process.stdout
        output = Output()
        started = Process(name, process, output, asyncio.create_task(output.read(stdout)))
        self.processes.append(started)
        return started

    async def start_server(self, *options: str, env: Mapping[str, str] | None = None
                           ) -> Process:
        """Start the server on a free port; returns once it listens (``self.url``)."""
        server = await self.start("server", [
            "aiopipe.server", "--config", str(self.config_file), "--port", "0",
            "--out-dir", str(self.out_dir), *options], env=env)
        line = await server.output.wait_for(r"waiting for \d+ devices? at (ws://\S+)")
        match = re.search(r"(ws://\S+)", line.text)
        assert match is not None
        self.url = match.group(1)
        return server

    async def start_device(self, k: int, *options: str, url: str | None = None,
                           env: Mapping[str, str] | None = None, cwd: Path | None = None
                           ) -> Process:
        """Start device k, connecting to ``url`` (default: the server's), with ``options``
        (e.g. ``--listen 127.0.0.1:0``)."""
        return await self.start(f"device{k}", [
            "aiopipe.device", "--server", url or self.url, "--device-id", str(k), *options],
            env=env, cwd=cwd)

    async def start_warm(self, name: str, args: Sequence[str], *,
                         env: Mapping[str, str] | None = None) -> Process:
        """Start ``python -m ARGS`` warm (tests/warm_start.py): a process that imports
        what a node imports now and runs ARGS when `go` says so; for a node started again
        after a fault without the seconds of its imports."""
        extra = dict(env or {})
        extra["PYTHONPATH"] = os.pathsep.join(filter(None, [
            extra.get("PYTHONPATH"), str(REPO / "tests")]))
        return await self.start(name, ["warm_start", *args], env=extra)

    async def start_spare(self, k: int, *options: str, url: str | None = None,
                          env: Mapping[str, str] | None = None) -> Process:
        """`start_warm` for device k, connecting to ``url`` (default: the server's), with
        ``options``: its process started again, once `go` says so."""
        return await self.start_warm(f"device{k} (again)", [
            "aiopipe.device", "--server", url or self.url, "--device-id", str(k), *options],
            env=env)

    async def go(self, warm: Process, within: float = 120.0) -> Process:
        """Run what ``warm`` (`start_warm`) waits to run, once it is warm; ``warm``."""
        await warm.output.wait_for("^warm$", within=within)
        warm.send_signal(signal.SIGUSR1)
        return warm

    async def finish(self, server: Process, devices: Sequence[Process], *,
                     within: float = 180.0) -> None:
        """Wait for the server, then every device, to exit with status 0.

        Raises:
            AssertionError: one did not, or took too long; the message holds every
                process's output.
        """
        try:
            assert await server.wait(within) == 0
            for device in devices:
                assert await device.wait(60) == 0
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(self.all_output()) from exc

    def metrics(self) -> list[dict[str, object]]:
        """The finished run's ``metrics.jsonl``, one mapping per epoch."""
        text = (self.out_dir / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]

    def port(self) -> int:
        """The server's port."""
        match = re.search(r":(\d+)/", self.url)
        assert match is not None
        return int(match.group(1))

    @contextlib.asynccontextmanager
    async def proxy(self) -> AsyncIterator[TcpProxy]:
        """A `TcpProxy` to the server; devices reach the server through it at
        `proxy_url`."""
        async with TcpProxy("127.0.0.1", self.port()) as proxy:
            yield proxy

    def proxy_url(self, proxy: TcpProxy) -> str:
        """The server's websocket URL through ``proxy``."""
        return f"ws://127.0.0.1:{proxy.port}/ws"

    def all_output(self) -> str:
        """Every process's output, for failure messages."""
        return "\n".join(f"--- {p.name} (exit {p.process.returncode})\n{p.output.text()}"
                         for p in self.processes)


def check_pipeline_figures(out_dir: Path, epochs: Sequence[Mapping[str, Any]],
                           stages: int) -> None:
    """The figures of a pipeline run of ``stages`` devices in ``epochs`` (of its
    ``metrics.jsonl`` in ``out_dir``; epochs where device p runs stage p): each stage
    busy, its busy and idle time the epoch's; each directed link between neighbours busy;
    and one trace track per stage and per directed link."""
    links = {f"device{p}->device{q}" for p in range(stages) for q in (p - 1, p + 1)
             if 0 <= q < stages}
    assert epochs
    for epoch in epochs:
        assert [s["stage"] for s in epoch["stages"]] == list(range(stages))
        for stage in epoch["stages"]:
            assert stage["busy_s"] > 0
            assert math.isclose(stage["busy_s"] + stage["idle_s"], epoch["time_s"],
                                rel_tol=1e-6, abs_tol=1e-9), (stage, epoch["time_s"])
        assert set(epoch["links"]) == links
        assert all(v["busy_s"] > 0 for v in epoch["links"].values())
    trace = json.loads((out_dir / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {f"device{p}/compute" for p in range(stages)} | links <= tracks


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")
