"""Mode auto's second look: after the first round, each other system that the round's
speeds say may be faster is tried for a round, and the fastest as measured runs on.

[Note: re-choosing the system] Mode auto's first choice ([Note: choosing the system] in
aiopipe.scheduler.auto) predicts each candidate's epoch from profiles taken before
training, each node timed alone. A run on a real clock also pays what such profiles
cannot see: nodes that share a host's cores, the server's passes slowed by its
devices' compute and by other work on the machine, per-micro-batch hand-overs that
wait for a core. Plans of many small micro-batches pay most, since each one is a server
pass and two messages (bench/results/2026-11-29-s29-auto: vgg5 over wifi with five
emulated nodes on two cores, pipar at N = 5 was predicted 21-30% ahead of fl and sfl
and ran behind them, its server passes three to four times their profiled time).

Nor does predicting again from the first round's speeds settle it. Read from the round's
trace ([Note: live profile] in replan.py), the server's speed and each device's
slowdown are the running system's conditions, and on a shared host they do not carry
over to another system: a device's compute beside a busy server is slower than beside
an idle one (fl's). On that vgg5 fleet the round's speeds predicted pipar within 10% of
its measured epoch and fl 12% above its own, so a prediction still preferred pipar.

So auto measures instead of trusting a second prediction:

1. After round 1 it takes the running system's measured epoch (`steady_epoch`: the
   round's span, less the warm-up of its first iteration's compute, scaled from the
   round's iterations to an epoch's) and predicts every candidate from the
   round's speeds (`estimate_systems` on the live profiles: each with its best plan).
2. Each other candidate is tried for a round, fastest predicted first, if its
   prediction is within `TRIAL_MARGIN` of the measured epoch (at most twice it), which
   covers the spread of the predictions' error between systems seen on this machine.
   If none is, the first choice stays.
3. After the trial rounds, when two or more systems measured within `CLOSE_MARGIN` of
   the fastest, one round each cannot tell them apart: each of them runs one more round
   (the running one first, so no switch is spent on it), once, and each system's
   rounds are pooled (`close_calls`).
4. Then the system with the shortest (pooled) epoch runs on; a simpler system (earlier
   in `STAR_MODES`) within the tie margin of it wins instead, as at the first choice.
   (Trying only the runner-up was not enough: on vgg5 over an unshaped link the
   round's speeds predicted sfl and pipar 17-25% below their measured epochs and fl
   10% above its own, so pipar was tried, and fl, the fastest, was not.)

- Once per run, at most one trial round per other candidate (two with three
  candidates), each predicted at most twice the first round's epoch, and at most one
  more round per close candidate: a run that kept trying would chase noise, and every
  switch restarts the momentum of the layers that change side. A close call's extra
  rounds cost at most `CLOSE_MARGIN` of an epoch each.
- The switches are the re-planner's ([Note: switching] in replan.py): every candidate's
  plans keep B samples per iteration, so iterations per epoch, rounds and the order of
  the data stay as they were; weights move with the layers between rounds.
- Not with devices sampled per round (each round is planned anew then, [Note: plans per
  round]), and not with ``rechoose = false``: the first choice stays.
- A resumed run goes on with the system and plans its checkpoint ran, and looks no
  second time (`Star.restore`; its checkpoint holds the chosen system's config, which
  `Star.resumed_config` checks against the run's mode auto config).
- A round's measured epoch is the wall time of that round; a trial round that is its
  epoch's only round is that epoch in `metrics.jsonl`, and the epoch reports the plans
  it ended with.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from aiopipe.config import RunConfig
from aiopipe.metrics.trace import Slice
from aiopipe.runtime.plan import DevicePlan
from aiopipe.scheduler.auto import STAR_MODES, TIE_MARGIN, SystemEstimate, estimate_systems
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile

__all__ = ["CLOSE_MARGIN", "TRIAL_MARGIN", "Measured", "close_calls", "fastest_measured",
           "pooled", "steady_epoch", "to_try"]

#: Another candidate is tried when predicted within this fraction above the running
#: system's measured epoch: twice it. Measured / predicted ran from 0.9 to 1.8 across
#: systems in bench/results/2026-11-29-s29-auto (pipar at N >= 5 highest), and a
#: prediction from a round's speeds can err as far the other way: after a round of
#: pipar at N = 10 on vgg5 over wifi, fl was predicted 1.44 x pipar's measured epoch
#: and ran faster than it (the devices' speed read from micro-batches of 5 samples of
#: one unit, where a pass's fixed costs weigh most, does not carry to the whole model
#: at 50). A margin of 0.3 left fl untried there.
TRIAL_MARGIN = 1.0

#: Systems whose single trial rounds measured within this fraction of the fastest run one
#: more round each before the choice: one round's epoch strayed up to about 20% from the
#: same system's mean in one run on this 2-core host (bench/results/2026-11-29-s31-auto),
#: so a smaller difference in one round each is as likely chance as speed.
CLOSE_MARGIN = 0.20


@dataclass(frozen=True, slots=True)
class Measured:
    """A system as one round ran it: its plans ((P_k, N_k)) and measured epoch."""

    mode: str
    plans: tuple[tuple[int, int], ...]
    epoch_s: float


def steady_epoch(span: float, slices: Sequence[Slice], plans: Sequence[DevicePlan]
                 ) -> float | None:
    """An epoch's seconds as a round showed them: the round's ``span`` on the
    coordinator's clock, less the warm-up of the device that finished last (at most half
    the span), scaled by that device's iterations per epoch over the round's. None when
    the round's trace (``slices``) shows no iteration.

    The warm-up is what the device's compute items of the round's first iteration took
    beyond the same items' median in its later iterations: a process's first passes
    at a size pay for allocations and first calls that later ones do not. Waits
    between items (the first iteration's devices queueing at the server at once) are
    the schedule's, not warm-up, and stay in. The span is the coordinator's own, and a
    device's report moves the figure by no more than half of it: what a device says of
    its own slices sways only which of the allowed systems runs on.
    """
    last: tuple[float, float, int, int] | None = None  # (end, warm-up, iterations, per epoch)
    for plan in plans:
        track = f"device{plan.device_id}/compute"
        mine = [s for s in slices if s.track == track]
        # a device's iteration ends with its step; fl's "s" item holds its step
        marker = "step" if any(s.name == "step" for s in mine) else "s"
        ends = sorted(s.end for s in mine if s.name == marker)
        if not ends:
            continue
        first = min(s.iteration for s in mine)
        later: dict[str, list[float]] = {}
        for s in mine:
            if s.iteration != first:
                later.setdefault(s.name, []).append(s.duration)
        warm_up = sum(max(0.0, s.duration - statistics.median(later[s.name]))
                      for s in mine if s.iteration == first and s.name in later)
        if last is None or ends[-1] > last[0]:
            last = (ends[-1], warm_up, len(ends), plan.iterations_per_epoch)
    if last is None:
        return None
    _, warm_up, iterations, per_epoch = last
    return (span - min(warm_up, span / 2)) * per_epoch / iterations


def to_try(auto: RunConfig, candidates: Sequence[str], running: Measured,
           profile: ModelProfile, devices: Sequence[DeviceProfile]
           ) -> tuple[list[SystemEstimate], list[SystemEstimate]]:
    """The candidates to try next, fastest predicted first ([Note: re-choosing the
    system], step 2), and every candidate's prediction from the round's speeds
    (``profile``, ``devices``: `live_profiles`).

    Raises:
        ConfigError: a device holds fewer samples than one batch.
    """
    estimates = estimate_systems(
        profile, devices, auto.batch_size, modes=candidates,
        memory_budget_bytes=[auto.device_memory_bytes_of(k) for k in range(len(devices))],
        aggregation_every=auto.aggregation_every)
    close = [e for e in estimates if e.mode != running.mode and e.epoch_s is not None
             and e.epoch_s < running.epoch_s * (1 + TRIAL_MARGIN)]
    return sorted(close, key=lambda e: (e.epoch_s or 0.0, STAR_MODES.index(e.mode))), estimates


def pooled(measured: Sequence[Measured]) -> list[Measured]:
    """One entry per system, in order of first appearance: its plans as first measured
    and the mean of its rounds' measured epochs."""
    rounds: dict[str, list[Measured]] = {}
    for m in measured:
        rounds.setdefault(m.mode, []).append(m)
    return [Measured(mode, ms[0].plans, statistics.fmean(m.epoch_s for m in ms))
            for mode, ms in rounds.items()]


def close_calls(measured: Sequence[Measured], running: str) -> tuple[Measured, ...]:
    """The systems to run one more round each before choosing ([Note: re-choosing the
    system], step 3): those whose pooled epoch is within `CLOSE_MARGIN` of the fastest,
    when there are two or more; ``running`` (the system that ran last) first, the others
    fastest first. Empty when one system is clearly fastest."""
    systems = pooled(measured)
    best = min(m.epoch_s for m in systems)
    close = sorted((m for m in systems if m.epoch_s <= best * (1 + CLOSE_MARGIN)),
                   key=lambda m: (m.mode != running, m.epoch_s))
    return tuple(close) if len(close) > 1 else ()


def fastest_measured(measured: Sequence[Measured]) -> Measured:
    """The system that runs on after the trials ([Note: re-choosing the system], step
    4): the shortest measured epoch, pooled over each system's rounds; a simpler system
    (earlier in `STAR_MODES`) within `TIE_MARGIN` of it instead."""
    systems = pooled(measured)
    best = min(m.epoch_s for m in systems)
    return min((m for m in systems if m.epoch_s <= best * (1 + TIE_MARGIN)),
               key=lambda m: STAR_MODES.index(m.mode))
