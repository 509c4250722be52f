"""The PiPar fleet's iterations as a list schedule: per-micro-batch stage seconds in,
step ends out.

Pure: no I/O, no clock, no torch, and no profiles. `aiopipe.scheduler.estimate` turns
profiles and plans into `Stages`, and the ends computed here into estimates; its module
docstring holds the theory (one iteration's DAG, [Note: server order], [Note: epoch
approximation]). `chained_schedule` runs iterations back to back with the server shared
by every device ([Note: chained iterations], [Note: server lanes]); `alone_end` and
`alone_floor` are closed forms for one device with an otherwise idle server ([Note: one
device in closed form]), which the plan search uses to rank and skip candidates.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "CHAINED_ITERATIONS",
    "Stages",
    "alone_end",
    "alone_floor",
    "chained_schedule",
    "cycles",
    "schedule_ends",
]


class Stages(NamedTuple):
    """Per-micro-batch stage seconds of one device's plan: all the schedule needs.

    A named tuple rather than a frozen dataclass: a plan search builds one per candidate
    (10^4 - 10^5 of them) and tuples are built several times faster.
    """

    n: int
    f: float
    b: float
    device_step: float
    u: float
    up_latency: float
    s: float
    server_step: float
    d: float
    down_latency: float


#: Iterations an epoch estimate simulates back to back per phase; the rest of the phase
#: repeats the mean spacing of the later half of their device steps ([Note: epoch
#: approximation]).
CHAINED_ITERATIONS = 6


def schedule_ends(fleet: Sequence[Stages], lanes: int = 1
                  ) -> tuple[list[float], list[float]]:
    """Per device: when its own step ends, and when the server's step of its replica ends,
    in one iteration that every device starts at 0.

    The event-driven list schedule of `aiopipe.scheduler.estimate`'s module docs, with
    the shared FIFO server (``lanes`` passes at once).
    """
    device_ends, replica_ends = chained_schedule(fleet, 1, lanes=lanes)
    return [d[0] for d in device_ends], [r[0] for r in replica_ends]


def chained_schedule(fleet: Sequence[Stages], rounds: int,
                     starts: Sequence[float] | None = None, *, lanes: int = 1,
                     ) -> tuple[list[list[float]], list[list[float]]]:
    """``rounds`` iterations back to back, device k starting its first at ``starts[k]``
    (default 0): per device and iteration, when its own step ends and when its replica's
    step ends.

    [Note: chained iterations] As the runtime runs them: a device starts the forwards of
    its next iteration as soon as it has stepped, and its next server pass is asked for
    once the activation has arrived and the replica has stepped; its uplink and downlink
    carry on in order. Devices that start together collide on the server in their first
    iteration; the ones served later start their next iteration later, so in the later
    iterations their requests spread out, as on a real server.

    The server is simulated with a heap of pending requests ordered by when they were
    made (ties by device, then micro-batch; the step counts as micro-batch N). A device's
    next iteration is planned when its replica's step is taken off the heap: by then all
    its server passes have ended, and every request it makes is later than that step.

    [Note: server lanes] A server with ``lanes`` > 1 runs up to that many passes at once,
    each as long as the table says (threads on cores of their own; a GPU's concurrent
    passes are slower than that, `bench/gpu_concurrency.py`): the request taken off the
    heap starts on the lane that frees first. A replica's passes stay in order, one at a
    time (its next request is made after its previous pass ended), as the runtime runs
    them: a device's session awaits each of its passes.
    """
    count = len(fleet)
    device_ends: list[list[float]] = [[] for _ in range(count)]
    replica_ends: list[list[float]] = [[] for _ in range(count)]
    up_free = [0.0] * count
    down_free = [0.0] * count
    arrivals: list[list[float]] = [[] for _ in range(count)]
    forwards_end = [0.0] * count
    s_end = [[0.0] * st.n for st in fleet]
    heap: list[tuple[float, int, int]] = []

    def forwards(k: int, start: float) -> float:
        """Device k's forwards and uploads from ``start``; when its first activation
        arrives."""
        st = fleet[k]
        t, u_end = start, up_free[k]
        arrive = [0.0] * st.n
        for i in range(st.n):
            t = t + st.f
            u_end = (t if t > u_end else u_end) + st.u
            arrive[i] = u_end + st.up_latency
        arrivals[k], forwards_end[k], up_free[k] = arrive, t, u_end
        return arrive[0]

    for k in range(count):
        heap.append((forwards(k, starts[k] if starts is not None else 0.0), k, 0))
    heapq.heapify(heap)
    free = 0.0
    lane_free = [0.0] * lanes  # a heap of when each lane frees (lanes > 1)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        ready, k, i = pop(heap)
        st = fleet[k]
        if lanes > 1:
            free = lane_free[0]
        start = ready if ready > free else free
        if i < st.n:
            free = start + st.s
            if lanes > 1:
                heapq.heapreplace(lane_free, free)
            s_end[k][i] = free
            if i + 1 < st.n:
                a = arrivals[k][i + 1]
                push(heap, (a if a > free else free, k, i + 1))
            else:
                push(heap, (free, k, st.n))
            continue
        free = start + st.server_step
        if lanes > 1:
            heapq.heapreplace(lane_free, free)
        replica_ends[k].append(free)
        d_end, b_end = down_free[k], forwards_end[k]
        for se in s_end[k]:
            d_end = (se if se > d_end else d_end) + st.d
            g = d_end + st.down_latency
            b_end = (g if g > b_end else b_end) + st.b
        down_free[k] = d_end
        step_end = b_end + st.device_step
        device_ends[k].append(step_end)
        if len(device_ends[k]) < rounds:
            a = forwards(k, step_end)
            push(heap, (a if a > free else free, k, 0))
    return device_ends, replica_ends


def cycles(device_end: Sequence[float], replica_end: Sequence[float]) -> list[float]:
    """Per device, when both halves have stepped: the iteration's length in an epoch."""
    return [d if d > r else r for d, r in zip(device_end, replica_end, strict=True)]


def alone_end(st: Stages) -> float:
    """`cycles` of a device alone with the server, in closed form (O(1)).

    [Note: one device in closed form] f, u, s, d form a flow line of identical jobs, whose
    n-th job leaves the last stage at sum(times) + (n-1) x max(times) (latencies are pure
    delays: they add to the sum, not the max). The backwards are one machine with
    release times r_1 = max(arrival of d_1, N f) and r_n = arrival of d_n, so b_N ends
    at max_m r_m + (N - m + 1) b, which is linear in m and peaks at an end point.
    """
    n = st.n
    m3 = max(st.f, st.u, st.s)
    s_first = st.f + st.u + st.up_latency + st.s
    server_done = s_first + (n - 1) * m3 + st.server_step
    return max(alone_floor(st), server_done)


def alone_floor(st: Stages) -> float:
    """When the device's own step ends with an otherwise idle server, from the start of
    its forwards (closed form, [Note: one device in closed form]).

    A lower bound for each of its iterations in any fleet, chained or not ([Note: chained
    iterations]): an iteration starts when the device has stepped, by then its links are
    free, and waiting for the server only delays it.
    """
    n = st.n
    m4 = max(st.f, st.u, st.s, st.d)
    g = st.f + st.u + st.up_latency + st.s + st.d + st.down_latency
    b_done = max(g + n * st.b, g + (n - 1) * m4 + st.b, n * st.f + n * st.b)
    return b_done + st.device_step
