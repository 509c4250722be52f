"""Device nodes as Ray actors: wall-clock runs larger than one machine (``aiopipe[ray]``).

Theory of operation. The driver (the process that calls `run_on_ray`) serves the run with
a `Server` on an address every Ray node can reach, draws a token secret for the run and
mints each device its own token. It then starts Ray actors spread over the cluster's
CPUs; each actor runs its share of the devices as `aiopipe.Device` tasks in its own
asyncio event loop (Ray's async actor), and each device dials the server over a real,
authenticated websocket, exactly as ``python -m aiopipe.device`` would. Ray carries only
plain values to the actors (the URL, device ids, token strings) and plain values back
(what each device did, or why it failed); activations, gradients and weights cross
aiopipe's own links, where nothing is unpickled. Ray is the launcher, not the transport.

Time is the wall clock: this is for simulations too large for one machine's cores or
memory. Virtual time stays single-process and deterministic: `aiopipe.simulate`.

Each actor process imports torch (about 300 MB), so an actor hosts several devices: by
default one actor per free CPU of the cluster, the devices divided among them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from aiopipe.errors import ConfigError, TrainingError
from aiopipe.wording import plural

if TYPE_CHECKING:
    from aiopipe.api import Server
    from aiopipe.config import RunConfig
    from aiopipe.metrics.results import EpochMetrics, RunResult

__all__ = ["DeviceHost", "DeviceOutcome", "actor_groups", "run_on_ray"]

log = logging.getLogger("aiopipe.ray")

#: Seconds the driver waits, once training has finished, for the devices to say goodbye.
GOODBYE_S = 30.0


class DeviceOutcome(TypedDict, total=False):
    """What one device did on its actor, in plain values: ``rounds``, ``samples`` and the
    server's ``reason`` for ending; or ``error``, why it failed."""

    device: int
    node: str
    rounds: int
    samples: int
    reason: str
    error: str


class DeviceHost:
    """The body of one Ray actor: hosts devices in the actor's event loop.

    Ray runs a class with coroutine methods as an async actor, so each `run_device` call
    is a task of one event loop, as the devices of `aiopipe.simulate` share one (each
    still computes on its own thread).
    """

    async def node(self) -> tuple[str, str]:
        """Where this actor runs: (Ray node id, the node's IP address)."""
        ray = _import_ray()
        return str(ray.get_runtime_context().get_node_id()), str(ray.util.get_node_ip_address())

    async def run_device(self, url: str, device_id: int, token: str, *, peers: bool = False,
                         connect_timeout: float = 300.0) -> DeviceOutcome:
        """Run device ``device_id`` against the server at ``url`` until it says goodbye.

        ``peers``: listen for peer devices' links on this node's address (modes that
        link devices directly). Never raises for the device's own failure: the outcome
        says why, in plain words, so nothing of aiopipe is pickled back to the driver.
        """
        from aiopipe.api import Device  # torch: only in the actor

        node = (await self.node())[1]
        try:
            async with Device(url, device_id, token=token, torch_device="cpu",
                              listen=(node, 0) if peers else None,
                              connect_timeout=connect_timeout) as device:
                summary = await device.run()
        except Exception as exc:  # the driver names the device and the cause
            return {"device": device_id, "node": node, "error": f"{type(exc).__name__}: {exc}"}
        return {"device": device_id, "node": node, "rounds": summary.rounds,
                "samples": summary.samples, "reason": summary.reason}


def actor_groups(devices: int, cpus: float, devices_per_actor: int | None = None
                 ) -> tuple[list[list[int]], float]:
    """How ``devices`` are spread over actors on a cluster with ``cpus`` free CPUs: the
    device ids of each actor (contiguous, sizes differing by at most one), and the CPUs
    each actor asks Ray for.

    By default one actor per whole free CPU (at most one per device); with
    ``devices_per_actor``, as many actors as that needs. Each actor asks for an equal
    share of the free CPUs (a whole number of them, or a fraction below one), no more than
    it has devices, so that all of them fit at once and SPREAD scheduling has to use
    every node.

    Raises:
        ConfigError: no devices, no free CPU, or ``devices_per_actor`` below 1.
    """
    if devices < 1:
        raise ConfigError(f"devices must be >= 1, got {devices}")
    if devices_per_actor is not None and devices_per_actor < 1:
        raise ConfigError(f"devices_per_actor must be >= 1, got {devices_per_actor}")
    if not cpus > 0:
        raise ConfigError("the Ray cluster has no free CPU for device actors")
    if devices_per_actor is None:
        actors = max(1, min(devices, math.floor(cpus)))
    else:
        actors = math.ceil(devices / devices_per_actor)
    base, extra = divmod(devices, actors)
    groups, start = [], 0
    for a in range(actors):
        size = base + (a < extra)
        groups.append(list(range(start, start + size)))
        start += size
    share = cpus / actors
    each = math.floor(share) if share >= 1 else math.floor(share * 100) / 100
    return groups, max(0.01, min(float(len(groups[0])), each))


async def run_on_ray(config: RunConfig, *, address: str = "auto", host: str | None = None,
                     port: int = 0, devices_per_actor: int | None = None,
                     join_timeout: float = 300.0, torch_device: str = "auto",
                     progress: Callable[[EpochMetrics], None] | None = None) -> RunResult:
    """Serve ``config``'s run here and host its devices as Ray actors over a Ray cluster;
    the server's result.

    Args:
        config: the run; every device trains its shard of ``config.dataset`` (an
            emulated fleet), so every node needs aiopipe installed and, for files, the
            dataset at the same path; a custom model must be a ``module:function``
            name every node can import.
        address: the Ray cluster (`ray.init`'s ``address``): "auto" (``$RAY_ADDRESS``,
            or the cluster ``ray start`` began on this machine) or ``HOST:PORT`` of its
            head. When this process is already connected to Ray, that connection is
            used (and left open).
        host: the address the server binds and the devices dial; default: this node's
            address as Ray sees it. "0.0.0.0" binds every interface and the devices
            dial this node's address.
        port: the server's port; 0 picks a free one (open it to the other nodes).
        devices_per_actor: devices each actor hosts; default: one actor per free CPU of
            the cluster, the devices divided among them (`actor_groups`).
        join_timeout: seconds for the actors to start and every device to join.
        torch_device: where the server's stages compute, as `aiopipe.Server`'s; the
            devices compute on their actors' CPUs.
        progress: called with each finished epoch's metrics.

    Raises:
        ConfigError: Ray is not installed, the cluster cannot be reached or has no free
            CPU, the actors cannot be placed or started within ``join_timeout``, the
            model is an object rather than a name, or the config cannot run.
        TrainingError: a device failed (the message names it, its node and why) or the
            run failed.
    """
    ray = _import_ray()
    if not isinstance(config.model, str):
        raise ConfigError("a Ray fleet needs the model by name (a zoo name or "
                          "module:function every node can import), not an object")
    connected_here = not ray.is_initialized()
    if connected_here:
        await _connect(ray, address)
    try:
        cpus = float(ray.available_resources().get("CPU", 0.0))
        groups, cpus_each = actor_groups(config.devices, cpus, devices_per_actor)
        here = str(ray.util.get_node_ip_address())
        from aiopipe.api import Server  # torch: after Ray is known to be there
        from aiopipe.auth import generate_secret

        secret = generate_secret().encode()  # this run's; each device gets its own token
        async with Server(config, host=host or here, port=port, token_secret=secret,
                          join_timeout=join_timeout, torch_device=torch_device,
                          progress=progress) as server:
            url = _dialled(server.url, here)
            hosts = [ray.remote(DeviceHost).options(num_cpus=cpus_each,
                                                    scheduling_strategy="SPREAD").remote()
                     for _ in groups]
            try:
                nodes = await _placed(ray, hosts, join_timeout)
                log.info("server at %s; %s on %s (%g CPU each) on %s", url,
                         plural(config.devices, "device"), plural(len(hosts), "Ray actor"),
                         cpus_each, plural(len({node_id for node_id, _ in nodes}), "node"))
                for (node_id, ip), ids in zip(nodes, groups, strict=True):
                    log.info("devices %d-%d on Ray node %s (%s)", ids[0], ids[-1], node_id, ip)
                return await _train(ray, server, hosts, groups, [ip for _, ip in nodes], url,
                                    secret, join_timeout)
            finally:
                for actor in hosts:  # also on failure: nothing of the run stays on the cluster
                    ray.kill(actor)
    finally:
        if connected_here:
            await asyncio.to_thread(ray.shutdown)


def _import_ray() -> Any:
    """The ``ray`` module (untyped here: it ships no stubs).

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise ConfigError("the Ray backend needs Ray: pip install 'aiopipe[ray]'") from None


async def _connect(ray: Any, address: str) -> None:
    """Connect this process to the Ray cluster at ``address``.

    Raises:
        ConfigError: nothing answers there, or Ray refuses to connect.
    """
    await _probe(address)
    quiet = _Without("SIGTERM handler is not set")  # in a thread on purpose: see below
    worker_log = logging.getLogger("ray._private.worker")
    worker_log.addFilter(quiet)
    try:
        # in a thread, so that Ray installs no SIGTERM handler of its own over the
        # command's (aiopipe.cli.run_command), and the event loop goes on meanwhile
        await asyncio.to_thread(ray.init, address=address, logging_level=logging.WARNING,
                                log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {_first_line(exc)} "
                          "(start one with ray start --head; see docs/howto/ray.md)") from None
    finally:
        worker_log.removeFilter(quiet)


async def _probe(address: str, within_s: float = 5.0) -> None:
    """Check that a ``HOST:PORT`` address accepts connections ("auto" and ``ray://``
    are Ray's to resolve): `ray.init` retries an address that does not answer for
    minutes.

    Raises:
        ConfigError: the address does not accept a connection within ``within_s``.
    """
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), within_s)
    except (OSError, TimeoutError) as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {why} (start one "
                          "with ray start --head; see docs/howto/ray.md)") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _placed(ray: Any, hosts: Sequence[Any], within_s: float) -> list[tuple[str, str]]:
    """Wait until every actor runs; where each runs (node id, IP address).

    Raises:
        ConfigError: an actor did not start within ``within_s`` (the cluster has no room)
            or could not start (e.g. aiopipe is not installed on its node).
    """
    calls = [_result(h.node.remote()) for h in hosts]
    try:
        async with asyncio.timeout(within_s):
            return list(await asyncio.gather(*calls))
    except TimeoutError:
        raise ConfigError(f"Ray did not start {len(hosts)} device actors within {within_s:g} "
                          "s: the cluster has no room for them (see ray status)") from None
    except ray.exceptions.RayError as exc:
        raise ConfigError(f"a Ray device actor could not start: {_first_line(exc)} (is "
                          "aiopipe installed on every node?)") from None


async def _train(ray: Any, server: Server, hosts: Sequence[Any], groups: Sequence[list[int]],
                 nodes: Sequence[str], url: str, secret: bytes, join_timeout: float
                 ) -> RunResult:
    """Run the server's training while every device runs on its actor; the result.

    Raises:
        TrainingError: a device failed before training finished, or training failed.
    """
    from aiopipe.auth import mint_token
    from aiopipe.runtime.tasks import first_error

    peers = server.node.system.links_devices
    try:
        async with asyncio.TaskGroup() as tasks:
            training = tasks.create_task(server.run())
            devices = [tasks.create_task(_device(
                ray, host.run_device.remote(url, k, mint_token(secret, k), peers=peers,
                                            connect_timeout=join_timeout),
                k, node, training))
                for host, ids, node in zip(hosts, groups, nodes, strict=True) for k in ids]
            result = await training
            done, late = await asyncio.wait(devices, timeout=GOODBYE_S)
            for task in late:  # the actors are killed next
                task.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    for outcome in (t.result() for t in done):
        if "error" in outcome:
            log.warning("device %d on %s ended after training: %s", outcome["device"],
                        outcome["node"], outcome["error"])
    if late:
        log.warning("%s did not end within %g s of the run's end",
                    plural(len(late), "device"), GOODBYE_S)
    return result


async def _device(ray: Any, call: Any, device_id: int, node: str,
                  training: asyncio.Task[RunResult]) -> DeviceOutcome:
    """Device ``device_id``'s outcome once it ends.

    Raises:
        TrainingError: it failed, or its actor died, while training was still going on.
    """
    try:
        outcome: DeviceOutcome = await _result(call)
    except ray.exceptions.RayError as exc:  # the actor died (memory, its node, a kill)
        outcome = {"device": device_id, "node": node,
                   "error": f"its Ray actor died: {_first_line(exc)}"}
    if "error" in outcome and not training.done():
        raise TrainingError(f"device {device_id} on Ray node {node} failed: "
                            f"{outcome['error']}")
    return outcome


async def _result(ref: Any) -> Any:
    """The value of a Ray object ref, awaited without blocking the event loop."""
    return await asyncio.wrap_future(ref.future())


def _dialled(url: str, here: str) -> str:
    """The URL the devices dial: the server's, with a wildcard bind address replaced by
    this node's address."""
    for wildcard in ("//0.0.0.0:", "//[::]:", "//:::"):
        url = url.replace(wildcard, f"//{here}:")
    return url


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (Ray's carry tracebacks)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class _Without(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()

