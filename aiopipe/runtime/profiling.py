"""Devices profiled where they run (PiPar §3.3.1): their own cost tables and link rates.

[Note: device profiles] With "auto" plans on real clocks, the coordinator plans from
what each device measures of itself, not from its own table times a declared slowdown:
once every device is ready, it sends each a `ProfileRequest` (the micro-batch sizes the
plan may use) followed at once by a `Probe` of `PROBE_BYTES`; the device times the
probe's arrival after the request (the downlink's rate), times its own units at those
sizes on its own data (`aiopipe.runtime.plan.measure_planning_costs`, in its compute
thread), and answers with its table, how long that took and the downlink rate, followed
at once by a probe of its own, whose arrival after the answer the coordinator times (the
uplink's rate). A probe that arrives within `UNSHAPED_S` of its message is too fast to
time: the link counts as unshaped. Both directions are timed where the bytes arrive, so
the rates are what the network gives, whether it is shaped by the sender
(``shape_links``), by ``tc`` or by the world.

Devices on one machine would slow each other down if they profiled at once, so the
coordinator asks the devices of one host (`host_fingerprint`, announced in `Ready`) one
after the other, and different hosts at once. A device that shares the coordinator's
machine and table (an in-process simulation) answers with no table; the planner then
uses the coordinator's table times the device's ``device_slowdown``. So does a device
that does not answer within `PROFILE_TIMEOUT_S` (logged). ``device_slowdown`` still
emulates a slower device: it multiplies the device's own table.

A device keeps its measured table in the cost cache ([Note: cost cache] in
cost_cache.py; `aiopipe.runtime.plan.cached_planning_costs`), under a key of its machine,
torch's and aiopipe's versions, torch threads, the model's units, the input shape, its
data's kind, learning rate and momentum: the next request on the same machine whose
micro-batch sizes the kept table holds (the next run, of whichever system, or the next
device of this host) is answered from the file at once, and the log says which file, or
how long measuring took; a request for other sizes measures them with the kept ones.
The table is the device's own, before ``device_slowdown`` (which the coordinator
applies), so the slowdown is not in the key. The coordinator keeps its own
table the same way. The probes run every time: link rates change between runs, and a
probe costs its wire time each way (`PROBE_BYTES`: about 0.84 s up at 10 Mbit/s and
0.34 s down at 25, nothing to speak of unshaped).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

import torch

from aiopipe.clock import Clock, wait_for
from aiopipe.errors import ConfigError, DeviceLostError, RemoteProtocolError
from aiopipe.protocol import Message, Probe, Profile, ProfileRequest, to_tensor_data
from aiopipe.runtime.plan_text import profile_text
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.transport import LinkSpec

__all__ = [
    "PROBE_BYTES",
    "PROFILE_TIMEOUT_S",
    "UNSHAPED_S",
    "ProbeTimer",
    "Profiled",
    "answer_request",
    "host_fingerprint",
    "measured_profile",
    "probe",
    "profile_figures",
    "profile_fleet",
    "rate_bps",
]

log = logging.getLogger("aiopipe.server")

#: Bytes of a probe: long enough that its wire time dwarfs the jitter of a busy host on
#: a slow link (0.84 s at 10 Mbit/s), short enough to cost little on a fast one.
PROBE_BYTES: Final = 1 << 20
#: A probe that arrives this soon after its message is too fast to time (4 Gbit/s).
UNSHAPED_S: Final = 0.002
#: Seconds the coordinator waits for a device's profile before it plans without it.
PROFILE_TIMEOUT_S: Final = 300.0


def host_fingerprint() -> str:
    """16 hex digits naming this machine (its host name and boot), the same for every
    node on it and different across machines (and reboots)."""
    boot = ""
    with contextlib.suppress(OSError):  # not Linux: the host name alone
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return hashlib.sha256(f"{socket.gethostname()}|{boot}".encode()).hexdigest()[:16]


def probe() -> Probe:
    """A probe of `PROBE_BYTES` zero bytes."""
    return Probe(to_tensor_data(torch.zeros(PROBE_BYTES, dtype=torch.uint8)))


def rate_bps(seconds: float) -> float:
    """The rate a probe that arrived ``seconds`` after its message shows, in bits per
    second; 0.0 when it came too soon to time (an unshaped link)."""
    if seconds < UNSHAPED_S:
        return 0.0
    return 8.0 * PROBE_BYTES / seconds


class Profiled(Protocol):
    """The coordinator's side of one device, as profiling needs it."""

    async def profile(self, batch_sizes: tuple[int, ...]) -> tuple[Profile, float]:
        """The device's answer to a profile request, and its probe's delay."""
        ...


async def profile_fleet(devices: Mapping[int, Profiled], hosts: Mapping[int, str],
                        declared: Sequence[DeviceProfile], *, sizes: tuple[int, ...],
                        units: int, clock: Clock
                        ) -> tuple[list[DeviceProfile], dict[int, dict[str, float | None]]]:
    """Every device as it measures itself ([Note: device profiles]): one host's devices
    one after the other, hosts at once; a device that gives no usable profile within
    `PROFILE_TIMEOUT_S` keeps its ``declared`` one (logged). Also, per device, its
    figures for people (`profile_figures`)."""
    measured = list(declared)
    figures: dict[int, dict[str, float | None]] = {}
    by_host: dict[str, list[int]] = {}
    for k in sorted(devices):
        by_host.setdefault(hosts[k], []).append(k)

    async def one_host(ids: list[int]) -> None:
        for k in ids:
            try:
                answer, delay = await wait_for(clock, devices[k].profile(sizes),
                                               PROFILE_TIMEOUT_S)
                measured[k] = measured_profile(declared[k], answer, delay, sizes, units)
            except (TimeoutError, DeviceLostError, RemoteProtocolError) as exc:
                log.warning("device %d gave no usable profile (%s); planning with its "
                            "declared speed", k, exc or "timed out")
                continue
            figures[k] = profile_figures(measured[k], answer, sizes, units)
            if answer.costs:
                log.info("device %d profiled itself in %.1f s: %s", k, answer.seconds,
                         profile_text(figures[k]))

    async with asyncio.TaskGroup() as tasks:
        for ids in by_host.values():
            tasks.create_task(one_host(ids))
    return measured, figures


def measured_profile(declared: DeviceProfile, answer: Profile, delay: float,
                     sizes: Sequence[int], units: int) -> DeviceProfile:
    """A device's profile from its own measurements: its table (times its emulated
    slowdown) and its links' rates (latency as declared); ``declared`` where it has no
    table of its own.

    Raises:
        RemoteProtocolError: the table does not hold the model's ``units`` at every one
            of ``sizes``, or holds a time that is NaN or negative.
    """
    if not answer.costs:
        return declared
    try:
        costs = CostTable.from_mapping(answer.costs)
    except ConfigError as exc:
        raise RemoteProtocolError(f"a malformed profile: {exc}") from None
    rows = [*costs.forward.values(), *costs.backward.values()]
    if costs.units != units or set(costs.forward) != set(range(units)) or any(
            set(sizes) - set(row) for row in rows):
        raise RemoteProtocolError(f"a profile of other units or sizes than the model's "
                                  f"{units} units at {list(sizes)}")
    times = [t for row in rows for t in row.values()] + list(costs.step.values())
    if any(math.isnan(t) or t < 0 for t in times):
        raise RemoteProtocolError("a profile with a NaN or negative time")
    up, down = rate_bps(delay), answer.downlink_bps
    return DeviceProfile(
        declared.slowdown,
        LinkSpec(up or None, declared.uplink.latency_s),
        LinkSpec(down or None, declared.downlink.latency_s),
        declared.samples, costs)


def profile_figures(profile: DeviceProfile, answer: Profile, sizes: Sequence[int],
                    units: int) -> dict[str, float | None]:
    """What a device's profile says, in figures a person reads: how long profiling took,
    its training seconds per sample (the whole model's forward and backward at the
    largest size, before emulation), and its links' rates in Mbit/s (None: unshaped)."""
    largest = max(sizes)
    per_sample = None
    if profile.costs is not None:
        costs = profile.costs
        per_sample = (costs.forward_time(0, units, largest)
                      + costs.backward_time(0, units, largest)) / largest

    def mbps(link: LinkSpec) -> float | None:
        return None if link.bandwidth_bps is None else round(link.bandwidth_bps / 1e6, 3)

    return {"seconds": round(answer.seconds, 3), "train_s_per_sample": per_sample,
            "uplink_mbps": mbps(profile.uplink), "downlink_mbps": mbps(profile.downlink)}


class ProbeTimer:
    """A device's side of the downlink probe: the coordinator posts its probe right after
    its `ProfileRequest`; how much later the probe arrives than the request times the
    downlink ([Note: device profiles])."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.delay: asyncio.Future[float] | None = None
        self._asked_at = 0.0

    def asked(self) -> None:
        """A profile request arrived: its probe follows."""
        self.delay = asyncio.get_running_loop().create_future()
        self.delay.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._asked_at = self.clock.now()

    def arrived(self) -> None:
        """The probe arrived.

        Raises:
            RemoteProtocolError: no profile request came before it.
        """
        if self.delay is None or self.delay.done():
            raise RemoteProtocolError("a probe without a profile request")
        self.delay.set_result(self.clock.now() - self._asked_at)


async def answer_request(request: ProfileRequest, probe_delay: Awaitable[float], *,
                         clock: Clock, measure: Callable[[tuple[int, ...]], Awaitable[CostTable]]
                         | None) -> list[Message]:
    """A device's answer to ``request``: its profile and a probe to post back to back
    (the profile alone when ``measure`` is None: a device that shares the coordinator's
    machine and table, or whose compute the CPU profiler cannot time).

    ``probe_delay``: how much later than the request the coordinator's probe arrived;
    ``measure``: times our own units at the sizes asked (in the compute thread).
    """
    if measure is None:
        return [Profile({}, 0.0, 0.0)]
    try:
        delay = await wait_for(clock, probe_delay, 60.0)
    except TimeoutError:
        delay = 0.0  # no probe: the rate stays unknown (unshaped)
    started = clock.now()
    costs = await measure(request.batch_sizes)
    seconds = clock.now() - started
    return [Profile(costs.to_mapping(), seconds, rate_bps(delay)), probe()]
