"""A node's compute resource: dedicated threads and one FIFO queue.

Torch work runs in the node's compute thread, so the event loop keeps moving bytes while
a forward or backward pass runs. Work items run one at a time in the order they were
submitted (first come, first served), which is the "one compute queue shared
by all devices" of the server (DESIGN §4). A server with ``lanes`` > 1 (PiPar's replicas
trained in parallel, `RunConfig.server_lanes`) runs up to that many items at once, each
on a thread of its own; its callers keep each replica's items in order (a session awaits
each of its items before it submits the next) ([Note: server lanes] in
aiopipe/scheduler/estimate.py).

Two ways time is charged:
- real time (`SystemClock`): the work runs in the thread and takes what it takes; with a
  slowdown factor s > 1 each item instead takes s x its CPU time, waiting on the clock
  for the rest without burning CPU, to emulate a slower device (see
  [Note: emulated slow devices]);
- cost time (a cost is given, as in virtual-time simulation): the work runs inline (the
  clock stands still meanwhile), then the resource is busy for cost x s on the clock.
  Timing is then a pure function of the cost table: deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from aiopipe.clock import Clock, ready_time
from aiopipe.errors import ConfigError
from aiopipe.metrics.trace import Recorder
from aiopipe.runtime.allocator import tune_malloc

if TYPE_CHECKING:
    import torch

__all__ = ["TORCH_DEVICE_CHOICES", "Compute", "resolve_torch_device", "warm_up_torch"]

T = TypeVar("T")


class Compute:
    """Serial compute resource of one node, recording a slice per work item.

    Args:
        clock: the node's clock.
        recorder: where slices go.
        track: the trace track, e.g. ``"device0/compute"``.
        slowdown: factor >= 1 applied to every work item's time.
        charge_costs: run work inline and charge the given costs (virtual time) instead
            of measuring real durations.
        lanes: items run at once (threads), >= 1; above 1 only without a slowdown.

    Raises:
        ValueError: ``lanes`` < 1, or lanes with a slowdown (an emulated device is one
            serial resource).
    """

    def __init__(self, clock: Clock, recorder: Recorder, track: str, *, slowdown: float = 1.0,
                 charge_costs: bool = False, lanes: int = 1) -> None:
        if lanes < 1 or (lanes > 1 and slowdown > 1.0):
            raise ValueError(f"{track}: lanes must be >= 1, and 1 with a slowdown "
                             f"(got {lanes} lanes, slowdown {slowdown:g})")
        self._clock = clock
        self._recorder = recorder
        self.track = track
        self.slowdown = slowdown
        self.charge_costs = charge_costs
        self.lanes = lanes
        self._lanes = _Lanes(lanes)
        self._executor: ThreadPoolExecutor | None = None
        self._free_at = float("-inf")  # when the emulated slow device finished its last item
        self._last_end = float("-inf")

    @property
    def last_end(self) -> float:
        """Clock time the last item ended (-inf before the first): for an emulated slow
        device, when it ended in the emulation, which its wake-up may have followed
        late ([Note: emulated slow devices])."""
        return self._last_end

    async def run(self, name: str, work: Callable[[], T], *, cost: float | None = None,
                  epoch: int = -1, iteration: int = -1, micro_batch: int = -1,
                  ready_at: float | None = None, exclusive: bool = False) -> T:
        """Run ``work`` on this resource when its turn comes; return its result.

        ``cost`` (seconds before slowdown) is required when the resource charges costs.
        ``exclusive``: with several lanes, run it alone (it reads what the other items
        change: a checkpoint's copy of every replica).
        ``ready_at``: the clock time the work was ready, when that was before this call
        (typically `last_end`: the caller submits it right after the previous item);
        an emulated slow device starts it from then, not from the late wake-up that
        let the caller submit it.

        Raises:
            ValueError: costs are charged and no cost was given.
            Exception: whatever ``work`` raises.
        """
        if self.charge_costs and cost is None:
            raise ValueError(f"{self.track}: work {name!r} needs a cost in cost-time mode")
        submitted = ready_time(self._clock, ready_at)
        async with self._taken(exclusive):
            start = self._clock.now()
            if self.charge_costs:
                result = work()
                assert cost is not None
                await self._clock.sleep(cost * self.slowdown)
            elif self.slowdown > 1.0:
                with self._clock.hold():
                    result, cpu = await asyncio.get_running_loop().run_in_executor(
                        self._thread(), _timed, work
                    )
                # [Note: emulated slow devices]
                self._free_at = max(submitted, self._free_at) + self.slowdown * cpu
                await self._clock.sleep(self._free_at - self._clock.now())
            else:
                with self._clock.hold():
                    result = await asyncio.get_running_loop().run_in_executor(
                        self._thread(), work
                    )
            self._last_end = (self._free_at if self.slowdown > 1.0 and not self.charge_costs
                              else self._clock.now())
            self._recorder.add(self.track, name, start, self._clock.now(), epoch=epoch,
                               iteration=iteration, micro_batch=micro_batch)
        return result

    @contextlib.asynccontextmanager
    async def _taken(self, exclusive: bool) -> AsyncIterator[None]:
        """Hold a lane (every lane, when ``exclusive``) while the block runs."""
        count = self.lanes if exclusive else 1
        await self._lanes.take(count)
        try:
            yield
        finally:
            self._lanes.give(count)

    async def call(self, work: Callable[[], T]) -> T:
        """Run ``work`` in the compute thread without charging or recording it.

        For bookkeeping (evaluation, loading weights) that is not part of the pipeline.
        """
        if self.charge_costs:
            return work()
        with self._clock.hold():
            return await asyncio.get_running_loop().run_in_executor(self._thread(), work)

    def close(self) -> None:
        """Stop the compute thread (waits for the item in progress)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            with contextlib.suppress(RuntimeError):
                executor.shutdown(wait=True)

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.lanes,
                                                thread_name_prefix=f"aiopipe-{self.track}")
        return self._executor


class _Lanes:
    """A node's compute lanes, granted strictly first come, first served: an item that
    needs every lane (``exclusive``) is not overtaken by later items while it waits for
    the lanes to free (a semaphore taken lane by lane would let them)."""

    def __init__(self, lanes: int) -> None:
        self.free = lanes
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []  # (not a 760-byte deque)

    async def take(self, count: int) -> None:
        """Wait for ``count`` lanes, after everyone who asked before."""
        if not self._waiting and self.free >= count:
            self.free -= count
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((count, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.give(count)  # granted, then cancelled before it could run
            else:
                if (count, granted) in self._waiting:  # (`_grant` may have passed it)
                    self._waiting.remove((count, granted))
                self._grant()
            raise

    def give(self, count: int) -> None:
        """Free ``count`` lanes; grant them in order."""
        self.free += count
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.free >= self._waiting[0][0]:
            count, granted = self._waiting.pop(0)
            if not granted.done():
                self.free -= count
                granted.set_result(None)


def _timed(work: Callable[[], T]) -> tuple[T, float]:
    """Run ``work`` on this thread; its result and the thread's CPU seconds for it."""
    started = _thread_seconds()
    result = work()
    return result, _thread_seconds() - started


#: CPU seconds of the calling thread (a module attribute so tests can stand in for it).
_thread_seconds = time.thread_time


# [Note: emulated slow devices]
# A device with slowdown s must take s times as long as this machine needs for the same
# work. Multiplying the item's elapsed time would multiply more than the work: on a
# machine whose cores are shared (a simulation of many nodes, a bench of many processes)
# the elapsed time includes waiting for a core, and s x that wait is a contention the
# emulated device would not have. So an item is charged s x the CPU time its thread spent
# on it (torch runs on that thread with one intra-op thread, the default torch_threads),
# as if the device had a core of its own.
#
# The charge is kept on the device's own timeline: an item starts, in emulation, when it
# was submitted (or ready, ``ready_at``) or when the previous item ended, whichever is
# later, and ends s x CPU seconds after that. The sleep to that end wakes late (the event
# loop rounds timers up to the millisecond, and under load it is busier still: 0.3-0.6
# ms per item in runs of vgg5); an item that was already queued, or that its caller says
# was ready at the previous item's end (a device's back-to-back forwards), starts from
# that emulated end, not from the late wake-up, so the error does not add up over
# back-to-back items.


def warm_up_torch() -> None:
    """Do torch's lazy first-use imports now (about 800 modules, seconds under load),
    and let freed tensor memory be reused (`aiopipe.runtime.allocator.tune_malloc`).

    The first optimizer call imports ``torch._dynamo``; imports hold the GIL, so doing
    this mid-run, even in the compute thread, would freeze the event loop long enough to
    miss heartbeats. Nodes call this before they connect or serve.
    """
    global _warmed_up
    if _warmed_up:  # once a process: a simulation's 100,000 devices each call it
        return
    import torch

    tune_malloc()

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.zero_grad()
    _warmed_up = True


_warmed_up = False


#: What ``--torch-device`` accepts besides an explicit torch device string.
TORCH_DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_torch_device(name: str) -> torch.device:
    """The torch device a node's stages run on: ``"auto"`` (a CUDA GPU when torch sees
    one, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Tensors on the wire
    stay CPU bytes whatever it is.

    Raises:
        ConfigError: an unknown name, or a CUDA device this machine does not have.
    """
    import torch

    if not isinstance(name, str):
        raise ConfigError(f"torch device: expected a name, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"torch device: unknown {name!r}; expected auto, cpu, cuda or "
                          "cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(f"torch device {name!r}: this machine has {count} CUDA "
                              "device(s) torch can use")
    elif device.type != "cpu":
        raise ConfigError(f"torch device: {name!r} is not supported; expected auto, cpu, "
                          "cuda or cuda:N")
    return device
