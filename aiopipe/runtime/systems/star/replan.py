"""Re-selecting plans mid-run from live measurements (PiPar §5.6.3).

Theory of operation
-------------------
With "auto" split points or micro-batch counts, the coordinator plans before training
from what it was told: the server's measured cost table, each device's declared
``device_slowdown`` and the ``network`` preset. After every round it looks at what
actually happened ([Note: live profile]), estimates the fleet's epoch under the current
plans and under a fresh selection, and switches when the fresh one is better by more
than ``replan_threshold`` ([Note: switching]).

[Note: live profile] From the round's trace (the server's own slices and the devices'
reports):
- server speed ``c`` = seconds of the server's ``s`` slices over what the cost table
  says they take; the planning table is scaled by ``c`` (contention, a busy machine);
- device k's slowdown = seconds of its ``f`` and ``b`` slices over ``c`` x the table's
  time for the same work (over its own table's, when it was profiled where it runs);
  a device that trains the whole model (fl, P = Q) has one ``s`` slice per batch, its
  forward, backward and step; a round of fl leaves the server's ``c`` at 1 (it
  computed nothing) and the device's links as they were (no activation crossed them);
- device k's uplink (downlink) bandwidth = bytes of its activation (gradient) frames
  over the seconds its ``u`` (``d``) slices took. A direction whose frames took no
  measurable time is unshaped. Latency is not observable from one side: the
  configured one is kept. This holds only where a send's slice is the frame's wire
  time (`Link.times_the_wire`: memory links, websockets shaped by aiopipe or timed by
  acknowledgements on Linux). Elsewhere a plain websocket's send returns once the OS
  has buffered the frame, well before its wire time, so bandwidths read from send
  times come out far above the link's, most of all for frames small enough to fit the
  buffers: a re-planner that trusted them moved devices to split points with large
  activations, and every switch lengthened the epoch (evidence:
  bench/results/2026-11-21-vgg5). There the bandwidths are kept as before (declared by
  the ``network`` preset).
A device without slices in the round (lost) keeps its previous profile.

[Note: switching] Only plans that keep every device's samples per iteration (B' x N)
are taken, so iterations per epoch, rounds and the data order are unchanged: with
"auto" N the candidates are the divisors of B, which all give B' x N = B. A switch
happens between rounds, when no work is in flight. Weights move with the layers (the
global model is whole on the server after aggregation; each device receives its new
half in `RoundStart`). Momentum is kept for every parameter that stays on the same
side; a layer that moves to the other side starts with zero momentum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiopipe.config import RunConfig
from aiopipe.metrics.trace import Slice
from aiopipe.runtime.plan import DevicePlan
from aiopipe.runtime.systems.star.options import star_options
from aiopipe.runtime.systems.star.planning import choose_plans
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile, estimate_epoch
from aiopipe.transport.network import LinkSpec

__all__ = ["Replan", "live_profiles", "reselect"]

#: Seconds per frame below which a direction counts as unshaped.
_UNSHAPED_S = 1e-6


@dataclass(frozen=True, slots=True)
class Replan:
    """One switch of plans: after ``round`` (of ``epoch``), from the estimated epoch
    ``before_s`` under the old plans to ``after_s`` under ``plans`` ((P_k, N_k)), and
    of the system when ``mode`` names one."""

    round: int
    epoch: int
    before_s: float
    after_s: float
    plans: tuple[tuple[int, int], ...]
    #: the system switched to (mode auto's second look), "" when the system stays
    mode: str = ""

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (for ``/status`` and the results)."""
        return {"round": self.round, "epoch": self.epoch,
                "estimated_epoch_before_s": round(self.before_s, 6),
                "estimated_epoch_after_s": round(self.after_s, 6),
                "plans": [list(p) for p in self.plans],
                **({"mode": self.mode} if self.mode else {})}


def live_profiles(slices: Sequence[Slice], plans: Sequence[DevicePlan],
                  served: Sequence[int], profile: ModelProfile,
                  previous: Sequence[DeviceProfile], *,
                  paced: Sequence[bool] | None = None,
                  ) -> tuple[ModelProfile, list[DeviceProfile]]:
    """The model and device profiles a round's trace shows ([Note: live profile]).

    ``slices``: the round's slices (server and device tracks); ``served[k]``: how many
    of device k's micro-batches the server computed in the round; ``profile``: the
    planning profile (its cost table unscaled); ``previous``: the profiles so far;
    ``paced[k]``: whether device k's link times its sends by the wire (`Link.times_the_wire`;
    default: every link does); when not, its bandwidths stay as in ``previous``.
    """
    costs = profile.costs
    q = costs.units
    expected = sum(n * (costs.forward_time(p.split_point, q, p.micro_batch_size)
                        + costs.backward_time(p.split_point, q, p.micro_batch_size))
                   + _accumulations(n, p) * costs.accumulate_time(p.split_point, q)
                   for p, n in zip(plans, served, strict=True))
    busy: dict[tuple[str, str], list[float]] = {}
    for s in slices:
        busy.setdefault((s.track, s.name), []).append(s.duration)
    server = sum(busy.get(("server/compute", "s"), ()))
    scale = server / expected if expected > 0 and server > 0 else 1.0
    live = dataclasses.replace(profile, costs=costs.scaled(scale)) if scale != 1.0 else profile
    devices = []
    for plan, before in zip(plans, previous, strict=True):
        k, p, micro = plan.device_id, plan.split_point, plan.micro_batch_size
        # against the device's own table when it has one, else the server's as it ran
        base, factor = (before.costs, 1.0) if before.costs is not None else (costs, scale)
        if p == q:  # fl: one item per batch, the whole model's forward, backward and step
            forwards, backwards = busy.get((f"device{k}/compute", "s"), []), []
            table = factor * len(forwards) * (base.forward_time(0, q, micro)
                                              + base.backward_time(0, q, micro)
                                              + base.step_time(0, q))
        else:
            forwards = busy.get((f"device{k}/compute", "f"), [])
            backwards = busy.get((f"device{k}/compute", "b"), [])
            table = factor * (len(forwards) * base.forward_time(0, p, micro)
                              + len(backwards) * base.backward_time(0, p, micro)
                              + _accumulations(len(backwards), plan)
                              * base.accumulate_time(0, p))
        slowdown = (sum(forwards) + sum(backwards)) / table if table > 0 and (
            forwards or backwards) else before.slowdown
        uplink, downlink = before.uplink, before.downlink
        if paced is None or paced[k]:
            uplink = _bandwidth(busy.get((f"device{k}/uplink", "u"), []),
                                profile.activation_frame_bytes(p, micro), before.uplink)
            downlink = _bandwidth(busy.get((f"device{k}/downlink", "d"), []),
                                  profile.gradient_frame_bytes(p, micro), before.downlink)
        devices.append(DeviceProfile(max(slowdown, 1e-6), uplink, downlink, before.samples,
                                     before.costs))
    return live, devices


def _accumulations(backwards: int, plan: DevicePlan) -> int:
    """Of ``backwards`` of a stage's backwards in whole iterations of ``plan``, those that
    add into an earlier micro-batch's gradients ([Note: accumulated gradients])."""
    return backwards - -(-backwards // plan.parallel_batches)


def reselect(auto: RunConfig, profile: ModelProfile, devices: Sequence[DeviceProfile],
             current: Sequence[tuple[int, int]],
             ) -> tuple[list[tuple[int, int]], float, float]:
    """The plans to run next, given the profiles a round showed ([Note: switching]).

    ``auto``: the run's config with its "auto" fields; ``current``: the (P_k, N_k) run
    so far. Returns (plans, estimated epoch under ``current``, under a fresh selection):
    the fresh selection when it is estimated better by more than
    ``replan_threshold``, else ``current``. The selection takes the estimate's own
    N (no speed band, [Note: speed band] in aiopipe/scheduler/select.py): the speeds are
    the round's own, and the threshold is what guards a switch against their noise.
    """
    chosen = choose_plans(auto, profile, list(devices), speed_band=1.0)
    b, every = auto.batch_size, auto.aggregation_every
    before = estimate_epoch(profile, list(devices), current, b, aggregation_every=every)
    after = estimate_epoch(profile, list(devices), chosen, b, aggregation_every=every)
    if chosen != list(current) and after < before * (1 - star_options(auto).replan_threshold):
        return chosen, before, after
    return list(current), before, after


def _bandwidth(durations: Sequence[float], frame_bytes: int, before: LinkSpec) -> LinkSpec:
    """The direction's bandwidth from its frames' wire times (latency as before)."""
    if not durations:
        return before
    seconds = sum(durations)
    if seconds <= _UNSHAPED_S * len(durations):
        return LinkSpec(None, before.latency_s)
    return LinkSpec(8.0 * frame_bytes * len(durations) / seconds, before.latency_s)
