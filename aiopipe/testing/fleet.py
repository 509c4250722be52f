"""A server node and its devices in one event loop, over memory links, with faults on
cue: the harness aiopipe's own fault tests use, for testing a model, a plan or a
deployment's settings before real devices run them.

Devices reconnect by themselves when their link breaks (`Fleet.cut`); `Fleet.kill` ends
a device as SIGKILL would, and `Fleet.start_device` starts a new process with that id;
`Fleet.block` makes the server unreachable for one device for a while (its connection
attempts fail, so it retries with backoff); `Fleet.stall` holds what a device's link
carries for a while (delivered, in order, when it ends), and `Fleet.slow` divides its
bandwidth; `Fleet.kill_server` ends the server (start another with
`Fleet.restart_server`, which resumes from the checkpoint directory). `Fleet.until` and
`Fleet.at_iteration` wait for the point of the run where a fault goes. Failures of the
harness's own tasks that are not aiopipe errors (the server and the devices must raise
nothing else) are kept in ``crashes`` and raised, so that they end the task group, and
the test, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

from torch import nn

from aiopipe.clock import Clock, VirtualClock
from aiopipe.config import RunConfig
from aiopipe.errors import AiopipeError, ConfigError, LinkBrokenError
from aiopipe.metrics.results import RunResult
from aiopipe.models import model_digest, unit_count
from aiopipe.protocol import Plan, Ready
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.runtime.factories import build_model
from aiopipe.runtime.plan import train_dataset
from aiopipe.runtime.systems.base import system_class
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link, LinkSpec, MemoryLink, open_memory_link_pair
from aiopipe.transport.fabric import MemoryFabric

__all__ = ["Direction", "Fleet", "joined", "open_fleet", "ready_for", "uniform_costs"]

#: Which way of a device's link a fault takes: "up" (device to server), "down", "both".
Direction = Literal["up", "down", "both"]


def uniform_costs(config: RunConfig) -> CostTable:
    """A made-up cost table for ``config``'s model, every unit alike (10 ms forward, 20 ms
    backward and 1 ms step per 10 samples): virtual time that does not depend on the
    machine, for tests of behaviour rather than speed."""
    if isinstance(config.model, nn.Sequential):
        model = config.model  # its units, whatever its weights
    else:  # a name or a factory
        data = train_dataset(config)
        model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
    return CostTable.uniform(unit_count(model), forward=0.01, backward=0.02, step=0.001,
                             batch=10)


def ready_for(plan: Plan, samples: int) -> Ready:
    """What an honest device that holds ``samples`` samples announces after ``plan``
    (scripted devices send it by hand)."""
    config = RunConfig.from_mapping(plan.run)
    model = build_model(config, num_classes=plan.num_classes, in_shape=plan.inputs[0][1])
    return Ready(samples, plan.inputs, plan.target, plan.num_classes, model_digest(model))


async def joined(node: Coordinator) -> Coordinator:
    """``node`` as if every device of its emulated fleet had joined (announced its
    shard): planned, and, when it resumes, restored from its checkpoint."""
    config = node.config
    for k in range(config.devices):
        node.announced[k] = Ready(config.device_samples_of(k), node.data.inputs,
                                  (node.data.target,), node.data.classes, node.model_digest)
    await node._prepare()
    return node


class Fleet:
    """A server node and its devices over memory links (module docstring), every task in
    ``tasks``; `open_fleet` makes one with its own task group.

    Args:
        config: the run.
        clock: a `VirtualClock` (time charged from ``cost_table``), or the system clock
            with ``cost_table=None`` (real compute).
        tasks: the task group the server, devices and helpers run in.
        cost_table: what virtual time charges; None: `uniform_costs` in virtual time,
            real compute on the system clock.
        wire: every memory link's pace both ways; None: device k's links are paced like
            its network in ``config`` (uplink and downlink).
        fabric: where devices listen for each other (runs that link devices: a pipeline);
            None: a `MemoryFabric` on ``clock`` when the mode links devices.
        checkpoint_dir: where the server writes its checkpoints (none by default).
        rest_idle_links: rest the links of devices in no round when the run samples
            devices per round, as `aiopipe.simulate` does ([Note: idle links rest] in
            aiopipe.runtime.liveness); off by default, as a `Server`.

    Attributes:
        node: the server; a test may replace it (a restarted server).
        device_links, server_links: device k's current link, device end and server end.
        devices: device k's latest process (task).
        started_at: when device k's latest process started.
        outcomes: per device, what each of its processes ended with: its `DeviceSummary`,
            the aiopipe error it failed with, or "killed".
        crashes: exceptions other than aiopipe errors from the server or a device.

    Raises:
        ConfigError: the config cannot run, or ``clock`` is a `VirtualClock` and the
            running loop is not one it can drive (`VirtualClock.check_loop`).
    """

    def __init__(self, config: RunConfig, clock: Clock, tasks: asyncio.TaskGroup, *,
                 cost_table: CostTable | None = None, wire: LinkSpec | None = None,
                 fabric: MemoryFabric | None = None,
                 checkpoint_dir: Path | None = None, rest_idle_links: bool = False) -> None:
        if isinstance(clock, VirtualClock):
            clock.check_loop()  # before any task starts (uvloop's loop: a ConfigError)
            if cost_table is None:
                cost_table = uniform_costs(config)
        self.node = Coordinator(config, clock=clock, cost_table=cost_table,
                                checkpoint_dir=checkpoint_dir,
                                rest_idle_links=rest_idle_links)
        self.checkpoint_dir = checkpoint_dir
        if fabric is None and system_class(config.mode).links_devices:
            fabric = MemoryFabric(clock)
        self.fabric = fabric
        self.clock, self.tasks = clock, tasks
        self.cost_table, self.wire = cost_table, wire
        self.device_links: dict[int, MemoryLink] = {}
        self.server_links: dict[int, MemoryLink] = {}
        self.devices: dict[int, asyncio.Task[None]] = {}
        self.started_at: dict[int, float] = {}
        self.outcomes: dict[int, list[object]] = {}
        self.crashes: list[BaseException] = []
        self.helpers: list[asyncio.Task[None]] = []
        self._blocked_until: dict[int, float] = {}
        #: (device, "up" or "down") -> the shape `slow` gave it for good, and for a while
        #: (until when): what its new connections get
        self._shapes: dict[tuple[int, str], LinkSpec] = {}
        self._temporary: dict[tuple[int, str], tuple[LinkSpec, float]] = {}

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a helper in the fleet's task group (``helpers`` keeps it, to cancel it)."""
        task = self.tasks.create_task(coroutine)
        self.helpers.append(task)
        return task

    def connect(self, k: int = 0) -> tuple[MemoryLink, MemoryLink]:
        """A new connection to the server, paced as device k's: (device end, server end);
        the server serves it."""
        device_end, server_end = open_memory_link_pair(
            self.clock, a_to_b=self._pace(k, "up"), b_to_a=self._pace(k, "down"))
        now = self.clock.now()
        for way, end in (("up", device_end), ("down", server_end)):
            if (k, way) in self._shapes:
                end.reshape(self._shapes[k, way])
            spec, until = self._temporary.get((k, way), (None, now))
            if spec is not None and until > now:
                end.reshape(spec, seconds=until - now)
        self.spawn(self._serve(server_end))
        return device_end, server_end

    def _pace(self, k: int, way: str) -> LinkSpec:
        """Device k's link in direction ``way`` ("up", "down") as the fleet was made."""
        network = self.node.config.device_network(k)
        return self.wire or (network.up if way == "up" else network.down)

    async def _serve(self, link: MemoryLink) -> None:
        try:
            await self.node.serve_link(link)
        except AiopipeError:
            pass
        except Exception as exc:
            self.crashes.append(exc)
            raise

    def connector(self, k: int) -> Callable[[], contextlib.AbstractAsyncContextManager[Link]]:
        """How device k opens a new connection (and the fleet learns of its links)."""

        @contextlib.asynccontextmanager
        async def open_link() -> AsyncIterator[Link]:
            if self.clock.now() < self._blocked_until.get(k, -1.0):
                raise LinkBrokenError(f"the server is unreachable for device {k}")
            device_end, server_end = self.connect(k)
            self.device_links[k], self.server_links[k] = device_end, server_end
            try:
                yield device_end
            finally:
                await device_end.aclose()

        return open_link

    def start_device(self, k: int) -> None:
        """Start a device process with id k (a restart, if one ran before)."""
        self.started_at[k] = self.clock.now()
        self.devices[k] = self.tasks.create_task(self._device(k))

    async def _device(self, k: int) -> None:
        endpoint = self.fabric.endpoint(f"device{k}") if self.fabric is not None else None
        try:
            model = self.node.config.model  # the user's own model, as a Device is given it
            summary = await run_device(self.connector(k), k, clock=self.clock,
                                       cost_table=self.cost_table, clock_offset=0.0,
                                       endpoint=endpoint,
                                       model=None if isinstance(model, str) else model)
        except AiopipeError as exc:
            self.outcomes.setdefault(k, []).append(exc)
        except asyncio.CancelledError:
            self.outcomes.setdefault(k, []).append("killed")
        except Exception as exc:
            self.crashes.append(exc)
            raise
        else:
            self.outcomes.setdefault(k, []).append(summary)
        finally:
            if endpoint is not None:
                await endpoint.aclose()

    def alive(self, k: int) -> bool:
        """Whether device k's latest process is still running."""
        return k in self.devices and not self.devices[k].done()

    def kill(self, k: int) -> None:
        """End device k's process, as SIGKILL would: its link breaks at once."""
        self.devices[k].cancel()
        if k in self.device_links:
            self.device_links[k].break_(f"device {k} was killed")

    def kill_server(self, training: asyncio.Task[RunResult]) -> None:
        """End the server as SIGKILL would: its training task is cancelled and every
        device's link breaks (the devices retry until a server answers)."""
        training.cancel()
        for k in self.device_links:
            self.device_links[k].break_("the server process died")

    def restart_server(self) -> None:
        """A new server in place of the killed one, resuming from the checkpoint
        directory (`Fleet.train` starts it; the devices reconnect by themselves).

        Raises:
            ConfigError: the fleet has no checkpoint directory, or it holds none.
        """
        if self.checkpoint_dir is None:
            raise ConfigError("restart_server needs the fleet's checkpoint_dir")
        self.node = Coordinator(self.node.config, clock=self.clock,
                                cost_table=self.cost_table,
                                checkpoint_dir=self.checkpoint_dir, resume=True,
                                rest_idle_links=self.node.rests_idle_links)

    def train(self) -> asyncio.Task[RunResult]:
        """Start the server's training in the fleet's task group."""
        return self.tasks.create_task(self.node.train())

    def cut(self, k: int) -> None:
        """Break device k's link; the device reconnects by itself."""
        self.device_links[k].break_(f"the link of device {k} was cut")

    def block(self, k: int, seconds: float) -> None:
        """Make the server unreachable for device k's new connections for ``seconds``."""
        self._blocked_until[k] = self.clock.now() + seconds

    def stall(self, k: int, seconds: float | None = None, *,
              direction: Direction = "both") -> None:
        """Stall device k's link (in ``direction``): from now on what it carries waits at
        the far end, and arrives in order when ``seconds`` of the fleet's clock have
        passed, or at `Fleet.release` (None). Nothing is lost, and no side sees the
        link fail; but the receiving side hears nothing meanwhile, so a stall longer
        than ``device_timeout`` is a silent device (the server gives the connection up;
        the device reconnects over a new, unstalled link). `MemoryLink.hold`.

        Raises:
            ConfigError: device k has no link yet, ``direction`` is not one, or
                ``seconds`` is negative.
        """
        for end in self._ends(k, direction):
            if end is None:
                raise ConfigError(f"device {k} has no link yet")
            end.hold(seconds)

    def release(self, k: int, *, direction: Direction = "both") -> None:
        """End a stall of device k's link now: what it held arrives at once, in order.

        Raises:
            ConfigError: device k has no link yet, or ``direction`` is not one.
        """
        for end in self._ends(k, direction):
            if end is None:
                raise ConfigError(f"device {k} has no link yet")
            end.release()

    def slow(self, k: int, factor: float | None = None, *, bandwidth_bps: float | None = None,
             seconds: float | None = None, direction: Direction = "both") -> None:
        """Slow device k's link (in ``direction``): its bandwidth divided by ``factor``
        (of the fleet's own pace for it, so ``factor=1`` restores it), or set to
        ``bandwidth_bps``; its latency stays. Frames whose wire slot starts from now on
        get it, for good or for ``seconds`` of the fleet's clock, on this connection and
        on any the device opens meanwhile. `MemoryLink.reshape`.

        Raises:
            ConfigError: not exactly one of ``factor`` and ``bandwidth_bps``, either not
                a positive finite number, ``factor`` for an unshaped link (no bandwidth
                to divide), ``direction`` is not one, or ``seconds`` is negative.
        """
        if (factor is None) == (bandwidth_bps is None):
            raise ConfigError("slow takes either factor or bandwidth_bps")
        value = factor if factor is not None else bandwidth_bps
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 < value < math.inf):
            raise ConfigError(f"slow needs a positive finite number, got {value!r}")
        if seconds is not None and not 0 <= seconds < math.inf:
            raise ConfigError(f"seconds must be a finite number >= 0, got {seconds!r}")
        ends = dict(zip(_ways(direction), self._ends(k, direction), strict=True))
        for way, end in ends.items():
            pace = self._pace(k, way)
            if factor is None:
                rate = bandwidth_bps
            elif pace.bandwidth_bps is None:
                raise ConfigError(f"device {k}'s {way}link is unshaped: give bandwidth_bps")
            else:
                rate = pace.bandwidth_bps / factor
            spec = LinkSpec(rate, pace.latency_s)
            if end is not None:
                end.reshape(spec, seconds=seconds)
            if seconds is None:  # as `MemoryLink.reshape`: a lasting shape ends a temporary one
                self._shapes[k, way] = spec
                self._temporary.pop((k, way), None)
            else:
                self._temporary[k, way] = (spec, self.clock.now() + seconds)

    def _ends(self, k: int, direction: Direction) -> list[MemoryLink | None]:
        """The ends of device k's current link that send in ``direction`` (device end:
        up; server end: down), None before it has one.

        Raises:
            ConfigError: ``direction`` is not one.
        """
        links = {"up": self.device_links.get(k), "down": self.server_links.get(k)}
        return [links[way] for way in _ways(direction)]

    def activations_in(self, k: int, round_no: int) -> int:
        """Activations the server accepted from device k in round ``round_no`` of the run
        so far (counted from 1, as the log and ``/status`` count rounds: a round played
        again takes the next number, and ``node.rounds`` is the latest's)."""
        session = self.node.sessions.get(k)
        window = session.window if session else None
        # the protocol numbers rounds from 0
        return (len(session.seen) if session and window and window.round == round_no - 1
                else 0)

    def reached(self, k: int, iteration: int, *, epoch: int = 1) -> bool:
        """Whether device k is in ``iteration`` of ``epoch`` (both from 1), or further in
        its round: the server is serving the round that holds it and has accepted an
        activation of it (its first micro-batch's forward is done and sent) or of a later
        iteration.

        Raises:
            ConfigError: ``epoch`` or ``iteration`` is below 1.
            AssertionError: device k's current round comes after that iteration (device
                k sat out the round that held it, or was down).
        """
        if epoch < 1 or iteration < 1:
            raise ConfigError(f"epochs and iterations count from 1, got iteration "
                              f"{iteration} of epoch {epoch}")
        session = self.node.sessions.get(k)
        window = session.window if session else None
        if session is None or window is None:
            return False
        at = (epoch - 1, iteration - 1)  # the protocol's indices, from 0
        if (window.epoch, window.first_iteration + window.iterations) <= at:
            return False  # not there yet
        if (window.epoch, window.first_iteration) > at:
            raise AssertionError(
                f"device {k} is in the round from iteration {window.first_iteration + 1} "
                f"of epoch {window.epoch + 1}: past iteration {iteration} of epoch {epoch}")
        return any(i >= at[1] for e, i, _ in session.seen if e == at[0])

    async def at_iteration(self, k: int, iteration: int, *, epoch: int = 1,
                           within: float = 600.0) -> None:
        """Wait until device k is in ``iteration`` of ``epoch`` (`Fleet.reached`):
        where a scripted fault goes, e.g. ``await fleet.at_iteration(1, 3);
        fleet.kill(1)``. Epochs count from 1, and iterations from 1 in each epoch,
        across its rounds (as the log and the timeline count them): round r (from 1)
        holds iterations (r - 1) P + 1 to r P, P being ``aggregation_every`` (every
        iteration of the epoch when it is 0). Modes whose devices send activations:
        sl, sfl, pipar.

        Raises:
            ConfigError: the mode sends no activations to the server; ``epoch`` or
                ``iteration`` is below 1.
            AssertionError: device k's rounds went past the iteration without it.
            TimeoutError: it did not get there within ``within`` seconds of the clock.
        """
        if not self.node.system.serves_stages:
            raise ConfigError(f"at_iteration needs activations at the server; mode "
                              f"{self.node.config.mode} sends none (wait with Fleet.until)")
        await self.until(lambda: self.reached(k, iteration, epoch=epoch), within=within)

    async def until(self, condition: Callable[[], bool], *, within: float = 600.0) -> None:
        """Wait (polling every virtual millisecond) until ``condition()`` holds.

        Raises:
            TimeoutError: it did not hold within ``within`` virtual seconds.
        """
        deadline = self.clock.now() + within
        while not condition():
            if self.clock.now() > deadline:
                raise TimeoutError(f"the condition did not hold within {within:g} s")
            await self.clock.sleep(0.001)


def _ways(direction: str) -> tuple[str, ...]:
    """"up", "down" or both for a `Direction`.

    Raises:
        ConfigError: ``direction`` is not one.
    """
    ways = {"up": ("up",), "down": ("down",), "both": ("up", "down")}.get(direction)
    if ways is None:
        raise ConfigError(f'direction must be "up", "down" or "both", got {direction!r}')
    return ways


@contextlib.asynccontextmanager
async def open_fleet(config: RunConfig, *, clock: Clock | None = None, start: bool = True,
                     **options: Any) -> AsyncIterator[Fleet]:
    """A `Fleet` in a task group of its own, its devices started (unless ``start`` is
    false); on leaving, the task group is awaited (start training with `Fleet.train` and
    await it inside) and a `VirtualClock` made here is closed. ``options``: `Fleet`'s.

    Example::

        async with open_fleet(config) as fleet:
            training = fleet.train()
            await fleet.until(lambda: fleet.activations_in(1, 0) > 0)
            fleet.kill(1)
            result = await training

    Raises:
        ConfigError: as `Fleet`, before anything starts (a `VirtualClock`, the default,
            on uvloop's loop, say).
    """
    own = clock is None
    clock = VirtualClock() if clock is None else clock
    if isinstance(clock, VirtualClock):
        clock.check_loop()
    try:
        async with asyncio.TaskGroup() as tasks:
            fleet = Fleet(config, clock, tasks, **options)
            if start:
                for k in range(config.devices):
                    fleet.start_device(k)
            yield fleet
    finally:
        if own and isinstance(clock, VirtualClock):
            await clock.aclose()
