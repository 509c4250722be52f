"""A server node and its devices in one event loop, over memory links, with faults on
cue: the harness aiopipe's own fault tests use, for testing a model, a plan or a
deployment's settings before real devices run them.

Devices reconnect by themselves when their link breaks (`Fleet.cut`); `Fleet.kill` ends
a device as SIGKILL would, and `Fleet.start_device` starts a new process with that id;
`Fleet.block` makes the server unreachable for one device for a while (its connection
attempts fail, so it retries with backoff); `Fleet.kill_server` ends the server (start
another with `Fleet.restart_server`, which resumes from the checkpoint directory). Failures of the
harness's own tasks that are not aiopipe errors (the server and the devices must raise
nothing else) are kept in ``crashes`` and raised, so that they end the task group, and
the test, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

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
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link, LinkSpec, MemoryLink, open_memory_link_pair
from aiopipe.transport.fabric import MemoryFabric

__all__ = ["Fleet", "joined", "open_fleet", "ready_for", "uniform_costs"]


def uniform_costs(config: RunConfig) -> CostTable:
    """A made-up cost table for ``config``'s model, every unit alike (10 ms forward, 20 ms
    backward and 1 ms step per 10 samples): virtual time that does not depend on the
    machine, for tests of behaviour rather than speed."""
    if isinstance(config.model, str):
        data = train_dataset(config)
        model = build_model(config, num_classes=data.num_classes, in_shape=data.in_shape)
    else:
        model = config.model
    return CostTable.uniform(unit_count(model), forward=0.01, backward=0.02, step=0.001,
                             batch=10)


def ready_for(plan: Plan, samples: int) -> Ready:
    """What an honest device that holds ``samples`` samples announces after ``plan``
    (scripted devices send it by hand)."""
    config = RunConfig.from_mapping(plan.run)
    model = build_model(config, num_classes=plan.num_classes, in_shape=plan.in_shape)
    return Ready(samples, plan.in_shape, plan.num_classes, model_digest(model))


async def joined(node: Coordinator) -> Coordinator:
    """``node`` as if every device of its emulated fleet had joined (announced its
    shard): planned, and, when it resumes, restored from its checkpoint."""
    config = node.config
    for k in range(config.devices):
        node.announced[k] = Ready(config.device_samples_of(k), node.in_shape,
                                  node.num_classes, node.model_digest)
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
        fabric: where devices listen for each other (runs that link devices: a pipeline).
        checkpoint_dir: where the server writes its checkpoints (none by default).

    Attributes:
        node: the server; a test may replace it (a restarted server).
        device_links, server_links: device k's current link, device end and server end.
        devices: device k's latest process (task).
        started_at: when device k's latest process started.
        outcomes: per device, what each of its processes ended with: its `DeviceSummary`,
            the aiopipe error it failed with, or "killed".
        crashes: exceptions other than aiopipe errors from the server or a device.
    """

    def __init__(self, config: RunConfig, clock: Clock, tasks: asyncio.TaskGroup, *,
                 cost_table: CostTable | None = None, wire: LinkSpec | None = None,
                 fabric: MemoryFabric | None = None,
                 checkpoint_dir: Path | None = None) -> None:
        if cost_table is None and isinstance(clock, VirtualClock):
            cost_table = uniform_costs(config)
        self.node = Coordinator(config, clock=clock, cost_table=cost_table,
                                checkpoint_dir=checkpoint_dir)
        self.checkpoint_dir = checkpoint_dir
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

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a helper in the fleet's task group (``helpers`` keeps it, to cancel it)."""
        task = self.tasks.create_task(coroutine)
        self.helpers.append(task)
        return task

    def connect(self, k: int = 0) -> tuple[MemoryLink, MemoryLink]:
        """A new connection to the server, paced as device k's: (device end, server end);
        the server serves it."""
        network = self.node.config.device_network(k)
        device_end, server_end = open_memory_link_pair(
            self.clock, a_to_b=self.wire or network.up, b_to_a=self.wire or network.down)
        self.spawn(self._serve(server_end))
        return device_end, server_end

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
                                checkpoint_dir=self.checkpoint_dir, resume=True)

    def train(self) -> asyncio.Task[RunResult]:
        """Start the server's training in the fleet's task group."""
        return self.tasks.create_task(self.node.train())

    def cut(self, k: int) -> None:
        """Break device k's link; the device reconnects by itself."""
        self.device_links[k].break_(f"the link of device {k} was cut")

    def block(self, k: int, seconds: float) -> None:
        """Make the server unreachable for device k's new connections for ``seconds``."""
        self._blocked_until[k] = self.clock.now() + seconds

    def activations_in(self, k: int, round_no: int) -> int:
        """Activations the server accepted from device k in round ``round_no`` so far."""
        session = self.node.sessions.get(k)
        window = session.window if session else None
        return len(session.seen) if session and window and window.round == round_no else 0

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
    """
    own = clock is None
    clock = VirtualClock() if clock is None else clock
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
