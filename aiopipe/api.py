"""The public entry points: `simulate`, and `Server` / `Device` for embedding a node.

- ``await simulate(config, clock=...)`` runs the server and every device in the current
  event loop over memory links shaped like each device's ``config.network`` (DESIGN §5);
- ``async with Server(config, host=..., port=...) as server: await server.run()`` serves
  devices over websockets (or mount it on your own aiohttp app with `Server.add_routes`);
- ``async with Device(url, device_id) as device: await device.run()`` is one device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl as ssl_module
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web
from torch import nn

from aiopipe.auth import Revocations, check_secret
from aiopipe.clock import Clock, SystemClock, VirtualClock
from aiopipe.config import RunConfig
from aiopipe.data import Dataset, as_dataset, kind_of
from aiopipe.errors import AiopipeError, ConfigError, TrainingError, TransportError
from aiopipe.metrics.results import (
    EpochMetrics,
    RunResult,
    check_fresh_out_dir,
    write_results,
)
from aiopipe.runtime.compute import resolve_torch_device
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import Connector, DeviceSummary, run_device
from aiopipe.runtime.guard import ConnectionGuard, ConnectionLimits, GuardedSite
from aiopipe.runtime.http import add_routes
from aiopipe.runtime.plan import (
    build_model,
    cached_planning_costs,
    declared_devices,
    model_profile,
    train_dataset,
)
from aiopipe.runtime.systems.base import planning_batch_sizes, system_class
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link, open_memory_link_pair, open_websocket_link
from aiopipe.transport.fabric import Endpoint, MemoryFabric, open_websocket_endpoint

__all__ = ["Device", "Server", "explain_auto", "simulate"]

device_log = logging.getLogger("aiopipe.device")
server_log = logging.getLogger("aiopipe.server")

Progress = Callable[[EpochMetrics], None]


async def simulate(config: RunConfig, *, clock: Clock | None = None,
                   cost_table: CostTable | None = None,
                   progress: Progress | None = None,
                   datasets: Sequence[Any] | None = None,
                   held_out: Sequence[Any] | None = None,
                   server_cost_table: CostTable | None = None,
                   torch_device: str = "cpu") -> RunResult:
    """Run server and devices in this event loop over memory links; the run's result.

    With a `VirtualClock`, compute is charged from ``cost_table`` (when not given:
    measured on this machine once per model and kept on disk, [Note: cost cache] in
    `aiopipe.runtime.cost_cache`) and transfers from the network's bandwidth and
    latency: the same config gives the same result, timing included. Devices that link
    to each other (a pipeline) do so over a memory fabric whose every directed link is
    shaped like the network's uplink. ``datasets``: each device's own training data (as
    `Device`'s ``dataset``); by default each trains on its shard of ``config.dataset``.
    ``held_out``: each device's own held-out data (None for a device without), on which
    it evaluates every epoch's global model (`EpochMetrics.held_out_accuracy`). Writes
    the results directory when ``config.out_dir`` is set; a run that fails keeps its
    finished epochs there, with ``unfinished.txt`` saying why ([Note: results on every
    ending] in aiopipe/metrics/results.py). ``progress`` is called with each
    finished epoch's metrics; without it each epoch is logged at INFO on the
    ``aiopipe.simulate`` logger. ``server_cost_table``: in virtual time, charge the
    server's own stages (PiPar's server halves) from this table, the devices from
    ``cost_table`` (a server of other hardware, e.g. a GPU's table from
    `bench/gpu_costs.py`); the planner plans each side with its own. ``torch_device``:
    where every node's stages compute, "cpu" (the default, so a simulation's figures do
    not depend on the host), "auto", "cuda" or "cuda:N" (`resolve_torch_device`): on a
    GPU host, a large fleet in virtual time computes its passes there, while the time it
    is charged stays the tables'.

    Raises:
        ConfigError: the config cannot run, ``datasets`` or ``held_out`` is not one
            entry per device, ``torch_device`` is not one this machine has,
            ``config.out_dir`` holds an earlier run's results, or ``clock`` is a
            `VirtualClock` and the loop is not one it can drive (uvloop's:
            `VirtualClock.check_loop`); all before anything starts.
        TrainingError: training failed.
    """
    if isinstance(clock, VirtualClock):
        clock.check_loop()  # else every device fails at its first sleep, and the run waits
    if config.out_dir:
        check_fresh_out_dir(config.out_dir)
    resolve_torch_device(torch_device)  # refuse a device this machine lacks, first
    clock = clock or SystemClock()
    own = _per_device(config, "datasets", datasets)
    evaluate = _per_device(config, "held_out", held_out)
    if isinstance(clock, VirtualClock) and cost_table is None:
        cost_table = await asyncio.to_thread(_measure, config, own[0])
    # a device in no round of a sampled run rests: no heartbeats, no timers ([Note: idle
    # links rest] in aiopipe.runtime.liveness)
    node = Coordinator(config, clock=clock, cost_table=cost_table,
                       progress=progress or partial(_log_epoch, config.epochs),
                       server_cost_table=server_cost_table, torch_device=torch_device,
                       rest_idle_links=True)
    custom = None if isinstance(config.model, str) else config.model
    networks = [config.device_network(k) for k in range(config.devices)]
    fabric = None
    if system_class(config.mode).links_devices:  # device a -> b goes at a's uplink
        fabric = MemoryFabric(clock, links={
            (f"device{a}", f"device{b}"): networks[a].up
            for a in range(config.devices) for b in range(config.devices) if a != b})
    try:
        async with asyncio.TaskGroup() as tasks:
            for k in range(config.devices):
                device_end, server_end = open_memory_link_pair(
                    clock, a_to_b=networks[k].up, b_to_a=networks[k].down,
                    max_frame_bytes=node.max_frame_bytes)
                endpoint = fabric.endpoint(f"device{k}") if fabric is not None else None
                tasks.create_task(_serve(node, server_end))
                tasks.create_task(_device(device_end, k, clock, cost_table, custom, endpoint,
                                          own[k], evaluate[k], node.joined.is_set,
                                          torch_device))
            result = await node.train()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    if isinstance(clock, VirtualClock):
        await clock.aclose()
    return _finish(result)


def _per_device(config: RunConfig, what: str, values: Sequence[Any] | None
                ) -> list[Dataset | None]:
    """One dataset (or None) per device.

    Raises:
        ConfigError: not one per device, or one that is not a dataset.
    """
    if values is None:
        return [None] * config.devices
    if len(values) != config.devices:
        raise ConfigError(f"{what}: expected {config.devices} (one per device), got "
                          f"{len(values)}")
    return [None if v is None else as_dataset(v) for v in values]


def _measure(config: RunConfig, dataset: Dataset | None) -> CostTable:
    """A cost table for every batch size the run (or its planner) may use, loading
    micro-batches of ``dataset`` (default: the emulated fleet's training set): measured
    once per machine and model, then read from the cache ([Note: cost cache])."""
    if dataset is None:
        dataset = train_dataset(config)
    kind = kind_of(dataset)
    model = build_model(config, num_classes=kind.classes, in_shape=kind.in_shape)
    return cached_planning_costs(config, model, kind.inputs, dataset,
                                 sizes=planning_batch_sizes(config), role="simulation",
                                 what="the simulated devices' cost table")


def explain_auto(config: RunConfig, *, cost_table: CostTable | None = None) -> str:
    """What ``mode = "auto"`` would choose for ``config``'s declared fleet (each device's
    ``device_slowdown``, ``network`` and ``samples_per_device``), as the table of every
    candidate's predicted epoch ([Note: choosing the system] in aiopipe.scheduler.auto),
    charged from ``cost_table`` (default: this machine's, measured once per model and
    kept, [Note: cost cache]). A run on real clocks chooses from what the devices
    measure of themselves instead, so its choice may differ.

    Raises:
        ConfigError: ``config`` is not a mode auto config, or no candidate fits.
    """
    if config.mode != "auto":
        raise ConfigError(f"--explain shows mode auto's choice; this run's mode is {config.mode}")
    from aiopipe.runtime.systems.star.options import server_lanes_of
    from aiopipe.runtime.systems.star.planning import choose_system

    kind = kind_of(train_dataset(config))
    model = build_model(config, num_classes=kind.classes, in_shape=kind.in_shape)
    profile = model_profile(model, kind.inputs, cost_table or _measure(config, None),
                            server_lanes=server_lanes_of(config))
    samples = [config.device_samples_of(k) for k in range(config.devices)]
    _, _, line, table = choose_system(config, profile, declared_devices(config, samples))
    return f"{line}\n{table}"


async def _serve(node: Coordinator, link: Link) -> None:
    """Serve one device's link; a device that breaks the contract or is lost is left out
    (the coordinator has logged why) and the run goes on without it, as a server's
    would."""
    with contextlib.suppress(AiopipeError):
        await node.serve_link(link)


async def _device(link: Link, k: int, clock: Clock, costs: CostTable | None,
                  model: nn.Sequential | None, endpoint: Endpoint | None,
                  dataset: Dataset | None, held_out: Dataset | None = None,
                  joined: Callable[[], bool] = lambda: False,
                  torch_device: str = "cpu") -> None:
    """Run simulated device k. It fails the simulation if it fails before the fleet has
    joined (the set-up is wrong); later it ends alone (logged), as a real device would.

    Raises:
        AiopipeError: the device failed before every device had joined.
    """
    try:
        # a simulated device shares this machine and its cost table: it profiles nothing
        await run_device(link, k, clock=clock, cost_table=costs, clock_offset=0.0, model=model,
                         endpoint=endpoint, dataset=dataset, profile=False,
                         held_out=held_out, torch_device=torch_device)
    except AiopipeError as exc:
        if not joined():
            raise
        device_log.warning("device %d ended: %s", k, exc)
    finally:
        await link.aclose()
        if endpoint is not None:
            await endpoint.aclose()


def _finish(result: RunResult) -> RunResult:
    if not result.config.out_dir:
        return result
    path = write_results(result, result.config.out_dir)
    return RunResult(result.config, result.epochs, result.model, result.trace,
                     result.trace_origin, path)


class Server:
    """An aiopipe server as an async context manager.

    Args:
        config: the run to coordinate.
        host: where to listen; ``host=None`` listens nowhere (mount the routes on your
            own app with `add_routes`).
        port: the port to listen on; 0 picks a free port (see `url`).
        token_secret: device k must send ``Authorization: Bearer <token>`` with
            ``aiopipe.auth.mint_token(token_secret, k)`` and may then speak only as device
            k; bytes, or a str taken as UTF-8 (``aiopipe.auth.generate_secret()`` as is);
            None admits any connection (keep such a server on loopback). A refused device
            is told why in the HTTP 401's ``WWW-Authenticate`` (RFC 6750).
        ssl: serve ``wss://`` with this context (see `aiopipe.auth.server_ssl_context`);
            only when this server listens itself (``host`` given).
        clock: defaults to the system clock.
        join_timeout: seconds to wait for every device.
        progress: called with each finished epoch's metrics.
        resume: continue from the checkpoint in ``<config.out_dir>/checkpoint`` (written
            after every round whenever ``config.out_dir`` is set).
        torch_device: where the server's stages compute (PiPar's server halves): "auto"
            (a CUDA GPU when torch sees one, else the CPU), "cpu", "cuda" or "cuda:N";
            tensors on the wire stay CPU bytes.
        limits: bounds on connections before they are a device's (handshake timeout,
            pending connections, connections per token, pre-hello frame size); the
            defaults of `ConnectionLimits`.
        revoked: a revocation file (`aiopipe.auth.Revocations`): the token ids listed
            there are refused, also while the server runs (a connected device whose
            token is revoked is closed within a second).

    Raises:
        ConfigError: the config cannot run, the secret is shorter than 16 bytes,
            ``revoked`` is given without ``token_secret``, ``config.out_dir`` holds an
            earlier run's results (and ``resume`` is not set),
            ``ssl`` is given without ``host``, or there is no checkpoint to resume from;
            on entering, the address cannot be listened on (a port in use).
    """

    def __init__(self, config: RunConfig, *, host: str | None = "127.0.0.1", port: int = 0,
                 token_secret: str | bytes | None = None,
                 ssl: ssl_module.SSLContext | None = None,
                 clock: Clock | None = None, join_timeout: float = 300.0,
                 progress: Progress | None = None, resume: bool = False,
                 torch_device: str = "auto", limits: ConnectionLimits | None = None,
                 revoked: str | os.PathLike[str] | None = None) -> None:
        secret = check_secret(token_secret) if token_secret is not None else None
        if limits is not None and not isinstance(limits, ConnectionLimits):
            raise ConfigError(f"limits must be ConnectionLimits, got {type(limits).__name__}")
        if ssl is not None and not isinstance(ssl, ssl_module.SSLContext):
            raise ConfigError(f"ssl must be an ssl.SSLContext, got {type(ssl).__name__}")
        if ssl is not None and host is None:
            raise ConfigError("ssl needs host: with host=None your own app's site does TLS")
        self.config = config
        if config.out_dir and not resume:
            check_fresh_out_dir(config.out_dir)
        checkpoints = Path(config.out_dir) / "checkpoint" if config.out_dir else None
        self.node = Coordinator(config, clock=clock or SystemClock(),
                                join_timeout=join_timeout, progress=progress,
                                checkpoint_dir=checkpoints, resume=resume,
                                torch_device=torch_device)
        self._host, self._port, self._secret, self._ssl = host, port, secret, ssl
        self.guard = ConnectionGuard(limits or ConnectionLimits())
        if revoked is not None and secret is None:
            raise ConfigError("revoked needs token_secret: without tokens there is nothing "
                              "to revoke")
        self._revocations = Revocations(revoked) if revoked is not None else None
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def dashboard_url(self) -> str:
        """The live dashboard's address (``http://host:port/``, https with TLS) once this
        server listens; "" before, or where it does not listen itself."""
        return "http" + self.url.removeprefix("ws").removesuffix("ws") if self.url else ""

    def add_routes(self, app: web.Application, *, prefix: str = "") -> None:
        """Mount ``{prefix}/ws``, ``{prefix}/status``, ``{prefix}/metrics`` and the live
        dashboard (``{prefix}/``, fed by ``{prefix}/events``) on ``app``."""
        add_routes(app, self.node, token_secret=self._secret, prefix=prefix,
                   shape_downlinks=self.node.config.shape_links, guard=self.guard,
                   revocations=self._revocations)

    async def __aenter__(self) -> Server:
        if isinstance(self.node.clock, VirtualClock):
            self.node.clock.check_loop()  # a ConfigError now, not a hang at the first sleep
        if self._host is not None:
            app = web.Application()
            self.add_routes(app)
            self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
            await self._runner.setup()
            site = GuardedSite(self._runner, self._host, self._port, self.guard,
                               ssl_context=self._ssl)
            try:
                await site.start()
            except OSError as exc:
                await self._runner.cleanup()
                self._runner = None
                why = os.strerror(exc.errno) if exc.errno else str(exc)
                raise ConfigError(f"cannot listen on {self._host}:{self._port}: "
                                  f"{why}") from None
            sockets = self._runner.addresses
            port = sockets[0][1] if sockets else self._port
            scheme = "ws" if self._ssl is None else "wss"
            self.url = f"{scheme}://{self._host}:{port}/ws"
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._runner is not None:
            await self.node.wait_disconnected(10.0)
            await self._runner.cleanup()
            self._runner = None

    async def run(self) -> RunResult:
        """Wait for the devices, train every epoch, write results; the run's result.

        A run that fails or is cancelled keeps its finished epochs' metrics, the last good
        model and why it ended in ``config.out_dir`` (the files of
        `aiopipe.metrics.results.write_unfinished`: [Note: results on every ending]).

        Raises:
            TrainingError: devices did not join in time, or one was lost.
        """
        result = await self.node.train()
        if self.config.out_dir:
            server_log.info("writing the results to %s", self.config.out_dir)
        # in a thread: meanwhile the loop sends the devices their goodbye (and heartbeats)
        with self.node.clock.hold():
            return await asyncio.to_thread(_finish, result)


class Device:
    """One device as an async context manager that connects to a server's websocket.

    Args:
        server: the server's websocket URL (``ws://host:port/ws`` or ``wss://...``).
        device_id: this device's id, 0..K-1.
        token: this device's token (``python -m aiopipe.auth mint``), sent as
            ``Authorization: Bearer <token>``.
        ssl: for a ``wss://`` URL, the context that verifies the server (see
            `aiopipe.auth.client_ssl_context`); None verifies it against the system's
            certificate authorities.
        clock: defaults to the system clock.
        model: the user's own model when the server runs a custom one.
        dataset: this device's own training data: an `aiopipe.data.Dataset` or any
            map-style torch dataset of ``(input tensor, integer label)``; None: its
            shard of the run's ``dataset`` (an emulated fleet).
        listen: ``(host, port)`` where this device accepts its peer devices' links (runs
            that link devices directly: modes pipeline, ftpipehd, asteroid and hadfl);
            port 0 picks a free one.
            None: it takes no peer links.
        advertise: the address peers dial (default: the endpoint's own,
            ``ws://host:port/peer``; give one when ``host`` is 0.0.0.0 or behind NAT).
        torch_device: where this device's stage computes, as `Server`'s.
        held_out: this device's own held-out data (as ``dataset``): it evaluates each
            epoch's global model on it and reports how it does
            (`EpochMetrics.held_out_accuracy`); it then receives the whole model.
        connect_timeout: seconds entering waits for a server that does not answer yet
            (refused or unreachable: retried with backoff); a server that refuses the
            token fails at once.

    Raises:
        ConfigError: the URL is not ws:// or wss://, ``ssl`` is given for ws://,
            ``connect_timeout`` is negative, or ``dataset`` is not a usable dataset
            (`aiopipe.data.as_dataset` says why).
        TrainingError: (on entering) no server answered within ``connect_timeout``.
        AuthenticationError: (on entering) the server refused the token.
    """

    def __init__(self, server: str, device_id: int, *, token: str | None = None,
                 ssl: ssl_module.SSLContext | None = None, clock: Clock | None = None,
                 model: nn.Sequential | None = None, max_frame_bytes: int = 1 << 30,
                 listen: tuple[str, int] | None = None, advertise: str | None = None,
                 dataset: Any = None, torch_device: str = "auto",
                 held_out: Any = None, connect_timeout: float = 300.0) -> None:
        if not server.startswith(("ws://", "wss://")):
            raise ConfigError(f"server URL must start with ws:// or wss://, got {server!r}")
        if ssl is not None and not server.startswith("wss://"):
            raise ConfigError(f"a TLS context needs a wss:// server URL, got {server!r}")
        if advertise is not None and listen is None:
            raise ConfigError("advertise needs listen: only a listening device has peers")
        self.server, self.device_id, self.token = server, device_id, token
        self.ssl = ssl
        self.clock = clock or SystemClock()
        self.model = model
        self.dataset = None if dataset is None else as_dataset(dataset)
        self.held_out = None if held_out is None else as_dataset(held_out, name="held-out")
        resolve_torch_device(torch_device)  # refuse a device this machine lacks now
        self.torch_device = torch_device
        self.max_frame_bytes = max_frame_bytes
        self.listen, self.advertise = listen, advertise
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int | float) \
                or not connect_timeout >= 0:
            raise ConfigError(f"connect_timeout must be >= 0 s, got {connect_timeout!r}")
        self.connect_timeout = float(connect_timeout)
        self.endpoint: Endpoint | None = None
        self._stack = contextlib.AsyncExitStack()
        self._link: Link | None = None

    async def __aenter__(self) -> Device:
        if isinstance(self.clock, VirtualClock):
            self.clock.check_loop()  # a ConfigError now, not a hang at the first sleep
        if self.listen is not None:
            host, port = self.listen
            self.endpoint = await self._stack.enter_async_context(open_websocket_endpoint(
                host, port, clock=self.clock, max_frame_bytes=self.max_frame_bytes,
                advertise=self.advertise))
        self._link = await self._first_link()
        return self

    async def _first_link(self) -> Link:
        """Connect, waiting (with backoff) up to ``connect_timeout`` for a server that is
        not listening yet: a fleet is started by hand, server first or not."""
        deadline = time.monotonic() + self.connect_timeout
        delay, said = 0.2, False
        while True:
            try:
                return await self._stack.enter_async_context(self._open())
            except TransportError as exc:
                if not _not_listening(exc):  # TLS, HTTP: waiting would not help
                    raise
                if time.monotonic() + delay > deadline:
                    raise TrainingError(
                        f"device {self.device_id}: no server at {self.server} within "
                        f"{self.connect_timeout:g} s ({_reason(exc)}; --connect-timeout "
                        "waits longer)") from None
                if not said:
                    device_log.warning("device %d: waiting for the server at %s (%s); retrying for "
                                "up to %g s", self.device_id, self.server, _reason(exc),
                                self.connect_timeout)
                    said = True
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(2 * delay, 5.0)

    def _open(self) -> contextlib.AbstractAsyncContextManager[Link]:
        return open_websocket_link(self.server, clock=self.clock, token=self.token,
                                   max_frame_bytes=self.max_frame_bytes,
                                   ssl=self.ssl if self.ssl is not None else True)

    def _connector(self, first: Link) -> Connector:
        """The link opened on entry first, then new connections (to reconnect)."""
        unused: list[Link] = [first]

        @contextlib.asynccontextmanager
        async def connect() -> AsyncIterator[Link]:
            if unused:
                yield unused.pop()  # closed by this Device's exit stack
            else:
                async with self._open() as link:
                    yield link

        return connect

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._stack.aclose()

    async def run(self) -> DeviceSummary:
        """Train until the server says goodbye.

        Raises:
            TrainingError: the server refused this device or training broke down.
            TransportError: the connection failed.
        """
        if self._link is None:
            raise ConfigError("use `async with Device(...) as device:` before run()")
        return await run_device(self._connector(self._link), self.device_id, clock=self.clock,
                                model=self.model, max_frame_bytes=self.max_frame_bytes,
                                shape_uplink=True, endpoint=self.endpoint,
                                dataset=self.dataset, torch_device=self.torch_device,
                                held_out=self.held_out)


def _log_epoch(epochs: int, m: EpochMetrics) -> None:
    """`simulate`'s progress when none is given: one INFO line per finished epoch."""
    logging.getLogger("aiopipe.simulate").info(
        "epoch %d/%d: %.2f s, loss %.4f, test accuracy %.3f", m.epoch, epochs, m.time_s,
        m.loss, m.accuracy)


def _not_listening(exc: TransportError) -> bool:
    """Whether ``exc`` says that nothing answers at the server's address (yet): refused,
    unreachable or timed out at connect; not a TLS or HTTP failure, nor a server that
    hung up (plain ws:// to a wss:// server)."""
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientSSLError):
        return False
    return isinstance(cause, aiohttp.ClientConnectorError | TimeoutError | ConnectionError)


def _reason(exc: Exception) -> str:
    """The last words of a connection error ("Connection refused"), for one log line."""
    cause = exc.__cause__ or exc
    if isinstance(cause, OSError) and cause.errno:
        return os.strerror(cause.errno)
    return str(exc)
