"""Choosing (P_k, N_k) per device by the estimated epoch (pipar.txt §3.3.3).

Pure: functions of profiles, no I/O, no clock. The candidates and the fleet objective
are in `aiopipe.scheduler.candidates`, steps 1-4 of the search (below) in
`aiopipe.scheduler.descent`, and steps 5-7 here.

Theory of operation
-------------------
Candidates. P ranges over 1..Q-1 (or the given split points). N ranges over the
shortlist of [Note: N shortlist] (or the given list), within 1..B. A candidate is kept if
the device holds at least one iteration of it (B' x N samples) and it fits the device's
memory budget ([Note: device memory]).

Search. `select_plans` minimizes `estimate_epoch` over one candidate per device:

1. alone: each device's best candidate against an otherwise idle server, exact and O(1)
   per candidate (`alone_end`, [Note: one device in closed form]);
2. balanced: the server's load is shared, so also solve the proxy
   min over plans of max(max_k alone epoch_k, sum_k server seconds_k per epoch) exactly,
   by searching the threshold T on the alone epochs (each device takes its candidate with
   the least server load among those with alone epoch <= T);
3. the better of the two (by the fleet estimate) seeds coordinate descent on the fleet
   estimate (`descend`): devices in order of their estimated epoch, slowest first, try
   their candidates with the others fixed and take the best if it improves; rounds
   repeat until one changes nothing, then two devices may change together (a pair move,
   the slowest pairs first, `PAIR_TRIES` candidates each), and single rounds resume.
   Moves are compared in leximax order of the per-device epochs (the slowest first,
   then the next), so a move that helps a device off the critical path counts: the
   fleet epoch is a max with wide plateaus. A candidate is skipped without running the
   schedule when its device's floor epoch already reaches the best estimate (its
   iterations x `alone_floor`, its own chain with an idle server, plus its transfers: no
   fleet estimate of it is lower, [Note: chained iterations]). The rest are tried
   most promising first ([Note: move proxy]).
4. iterated local search (`perturbed`): give up to 3 random devices a random candidate
   (a seeded generator: the same inputs give the same plans), descend again, keep the
   result if it is better; stop after `KICKS` kicks in a row that find nothing. Some
   optima need three devices to change at once, which no descent step does.
5. identical devices given different plans get one plan when that is estimated within
   `SYMMETRY_MARGIN` of the mixed choice (`_symmetric`, [Note: identical devices]);
6. each device (each group of identical devices together) moves to the shallowest split
   point whose best plan keeps the fleet estimate within ``shallow_margin`` (default
   `SHALLOW_MARGIN`) of step 5's (`_shallower`, [Note: shallow splits]);
7. each group of identical devices on one plan takes, at its split point, the number of
   micro-batches whose estimate stays nearest the best on average over a band of compute
   speeds around the profile's (`_steady`, [Note: speed band]).

Everything stops when the schedules run so far have simulated `WORK_BUDGET`
micro-batches in total. In small fleets this rarely binds and every viable candidate is
tried; in large ones each device tries only its most promising few per round so that
every device gets a turn, and the budget is usually spent before step 4: this is what
bounds the search's time for large fleets (100 devices x 35 units), at the price of a
plan that more search would still improve (bench/planner.py measures both).

`exhaustive_plans` is the true argmin of the estimate over every combination (for tests
and small fleets).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from aiopipe.errors import ConfigError
from aiopipe.scheduler.candidates import Candidate, Objective, plan_candidates
from aiopipe.scheduler.descent import alone_best, balanced_choice, descend, perturbed
from aiopipe.scheduler.profiles import DeviceProfile, ModelProfile

__all__ = ["exhaustive_plans", "select_plans"]

#: Micro-batches the descent may simulate in total (sum of N_k over every schedule run).
WORK_BUDGET = 300_000
#: How much worse (relative) a uniform plan for identical devices may be estimated than
#: a mixed one and still be chosen ([Note: identical devices]).
SYMMETRY_MARGIN = 0.10
#: How much worse (relative) a plan with fewer layers on the device may be estimated than
#: the search's and still be chosen ([Note: shallow splits]).
SHALLOW_MARGIN = 0.02
#: Compute speeds the plan must hold up across: devices' and server's seconds each
#: divided and multiplied by this ([Note: speed band]).
SPEED_BAND = 1.25
#: How much worse (relative) at the profile's speeds a number of micro-batches may be
#: estimated than the search's and still be taken for holding up better in the band.
BAND_MARGIN = 0.10
#: Mean regrets over the speed band this close (relative) count as a tie, which the
#: fewest micro-batches win ([Note: speed band]).
BAND_TIE = 0.03
#: Most combinations `exhaustive_plans` accepts.
MAX_COMBINATIONS = 1_000_000


def select_plans(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    batch_size: int,
    *,
    split_points: Sequence[int] | None = None,
    parallel_batches: Sequence[int] | None = None,
    memory_budget_bytes: Sequence[int | None] | None = None,
    aggregation_every: int = 0,
    shallow_margin: float = SHALLOW_MARGIN,
    speed_band: float = SPEED_BAND,
) -> list[tuple[int, int]]:
    """Choose (P_k, N_k) per device minimizing the estimated fleet epoch (see module docs).

    ``split_points`` / ``parallel_batches`` restrict the candidates (default: 1..Q-1 and
    the [Note: N shortlist]); ``memory_budget_bytes[k]`` (None = unlimited) drops the
    candidates device k cannot hold ([Note: device memory]); ``aggregation_every`` as in
    `estimate_epoch`; ``shallow_margin``: how much worse (relative) an estimate may be
    for a plan with fewer layers on a device ([Note: shallow splits]; 0: the search's
    plan, the estimate's optimum in small fleets); ``speed_band``: the factor the
    compute speeds may be off by that the number of micro-batches must hold up across
    ([Note: speed band]; 1: none).

    Raises:
        ConfigError: an empty fleet, a batch size < 1, candidates outside 1..Q-1 or
            1..B, as many budgets as devices not given, a device holding fewer samples
            than one iteration of any candidate, or a device whose every candidate breaks
            its memory budget (the message names the device and the smallest need).
    """
    candidates = plan_candidates(
        model, devices, batch_size, split_points, parallel_batches, memory_budget_bytes,
        aggregation_every,
    )
    if not (isinstance(shallow_margin, (int, float)) and 0 <= shallow_margin < math.inf):
        raise ConfigError(f"shallow margin must be a finite number >= 0, got {shallow_margin!r}")
    if not (isinstance(speed_band, (int, float)) and 1 <= speed_band < math.inf):
        raise ConfigError(f"speed band must be a finite number >= 1, got {speed_band!r}")
    objective = Objective(model, candidates, aggregation_every)
    choice = [alone_best(cs) for cs in candidates]  # exact for one device: alone is the fleet
    if len(devices) > 1:
        balanced = balanced_choice(candidates)
        if balanced != choice and objective(balanced)[0] < objective(choice)[0]:
            choice = balanced
        choice = perturbed(objective, *descend(objective, choice, WORK_BUDGET), WORK_BUDGET)
        choice = _symmetric(objective, choice)
    if shallow_margin > 0:
        choice = _shallower(objective, choice, shallow_margin)
    if speed_band > 1 and (parallel_batches is None or len(set(parallel_batches)) > 1):
        choice = _steady(objective, choice, speed_band)
    return [cs[i].plan for cs, i in zip(candidates, choice, strict=True)]


def _groups(candidates: Sequence[Sequence[Candidate]]) -> list[list[int]]:
    """The devices grouped by identical profile (they share one candidate list)."""
    groups: dict[int, list[int]] = {}
    for k, cs in enumerate(candidates):
        groups.setdefault(id(cs), []).append(k)
    return list(groups.values())


def _uniform_bound(cs: Sequence[Candidate], members: Sequence[int], i: int) -> float:
    """A lower bound of the fleet estimate with every member on candidate ``i``: the
    larger of a member's floor epoch and the group's server seconds per epoch."""
    return max(cs[i].floor_epoch, len(members) * cs[i].server_load)


def _shallower(objective: Objective, choice: list[int], margin: float) -> list[int]:
    """Step 6 of the search: each group of identical devices (one device, when the
    fleet is mixed) takes the shallowest split point whose best plan keeps the fleet
    estimate within ``margin`` of ``choice``'s.

    [Note: shallow splits] Plans close in the estimate are a coin toss in practice, and
    the toss is not fair: the estimate's error is largest on the device side. Before
    the first round a device's speed is declared, not measured; emulated in one process,
    the devices' compute runs further above the profile than the server's ([Note: real
    clocks] in estimate.py), so the deeper split's estimated gain, made on the device,
    is the part most likely to be missing. A shallower split also needs less device
    memory and moves a smaller half at every aggregation. `SHALLOW_MARGIN` comes from
    re-selecting the planner bench's recorded estimates (bench/planner_accuracy.py, its
    nine cases, a fresh profile per run): in every run one case took a deeper split
    estimated just ahead of a shallower one that ran faster (once, about as fast); this
    margin moves that case to the shallower split in every run and changes no other, a
    smaller one moves it only in some (evidence: the planner_accuracy runs in
    bench/results from 2026-11-21-s6-planner to 2026-11-22-s10c-planner). The margin is
    held against ``choice``'s estimate, not each step's, so the fleet estimate grows by
    at most ``margin`` in all. Within a split point the best estimate wins (N is not a
    device-side bet of this kind). Candidates whose `_uniform_bound` passes the limit
    are not tried, and none after `WORK_BUDGET` micro-batches.
    """
    candidates = objective.candidates
    limit = objective(choice)[0] * (1 + margin)
    budget = objective.work + WORK_BUDGET
    for members in _groups(candidates):
        cs = candidates[members[0]]
        shallowest = min(cs[choice[k]].plan[0] for k in members)  # no member goes deeper
        shallower: dict[int, list[int]] = {}
        for i in range(len(cs)):
            if cs[i].plan[0] < shallowest and _uniform_bound(cs, members, i) <= limit:
                shallower.setdefault(cs[i].plan[0], []).append(i)
        for point in sorted(shallower):
            found: tuple[float, list[int]] | None = None
            for i in shallower[point]:
                if objective.work >= budget:
                    return choice
                trial = choice.copy()
                for k in members:
                    trial[k] = i
                value = objective(trial)[0]
                if value <= limit and (found is None or value < found[0]):
                    found = (value, trial)
            if found is not None:
                choice = found[1]
                break
    return choice


def _steady(objective: Objective, choice: list[int], band: float) -> list[int]:
    """Step 7 of the search: each group of identical devices that shares one plan takes,
    at its split point, the number of micro-batches with the least mean regret over the
    speed band.

    [Note: speed band] A profile measures the machine at one moment, and this machine's
    speed moves from one profile to the next, every batch size alike. The best N weighs
    compute against the links, so it moves with that speed: profiles taken in a row
    choose different Ns for the same case (evidence:
    bench/results/2026-11-27-s20-planner/notes.md). Each candidate N at the group's
    split point whose estimate at the profile's speeds is within `BAND_MARGIN` of the
    choice's is estimated again with the devices' and the server's compute
    seconds each scaled by 1 / ``band``, 1 and ``band`` (`SPEED_BAND`; nine points,
    links as profiled); at each point its regret is its estimate over the best of the
    candidates there. The least mean regret wins, and the Ns within `BAND_TIE` of it
    count as a tie that the fewest micro-batches win (fewer items, messages and
    activations in flight, whose costs the estimate knows least well), then the least
    estimate at the profile's speeds. Only N is reconsidered: the split point already
    keeps to the shallowest within `SHALLOW_MARGIN` ([Note: shallow splits]). Skipped
    once the schedules have spent `WORK_BUDGET` micro-batches of this step's budget.
    The rule and its constants were chosen on re-estimates of fresh profiles against
    the measured epochs of the planner bench (the notes above): it steadies the choice
    where the band covers the machine's swings, and cannot where one profile is slower
    than the band (there it may still take a slower N).
    """
    candidates = objective.candidates
    limit = objective(choice)[0] * (1 + BAND_MARGIN)
    budget = objective.work + WORK_BUDGET
    points = [(server, device) for server in (1 / band, 1.0, band)
              for device in (1 / band, 1.0, band)]
    for members in _groups(candidates):
        if len({choice[k] for k in members}) > 1 or objective.work >= budget:
            continue
        cs = candidates[members[0]]
        split = cs[choice[members[0]]].plan[0]
        trials: list[tuple[int, list[int], float]] = []
        for i in range(len(cs)):
            if cs[i].plan[0] != split or objective.work >= budget:
                continue
            trial = choice.copy()
            for k in members:
                trial[k] = i
            value = objective(trial)[0]  # the fleet as chosen so far, this group on i
            if value <= limit:
                trials.append((i, trial, value))
        if len(trials) < 2:
            continue
        values = [[objective.at_speeds(trial, point) for point in points]
                  for _, trial, _ in trials]
        best = [min(column) for column in zip(*values, strict=True)]
        regrets = [sum(v / b for v, b in zip(row, best, strict=True)) / len(points)
                   for row in values]
        least = min(regrets)
        near = [t for t in range(len(trials)) if regrets[t] <= least * (1 + BAND_TIE)]
        pick = min(near, key=lambda t: (cs[trials[t][0]].plan[1], trials[t][2]))
        choice = trials[pick][1]
    return choice


def _symmetric(objective: Objective, choice: list[int]) -> list[int]:
    """Step 5 of the search: identical devices get one plan unless mixing their plans
    is estimated to be better by more than `SYMMETRY_MARGIN`.

    [Note: identical devices] Devices with the same profile and candidates are
    interchangeable. A mixed plan for them (say P=3 for one, P=5 for the other) wins in
    the estimate by staggering their server requests; the runtime staggers them anyway
    as the devices drift out of phase. In the planner bench (bench/planner_accuracy.py,
    two identical devices) the mixed plans the search chose ran slower than the best
    uniform plan, while their estimates were close. So for each group of identical
    devices with mixed plans, the best uniform choice (every member on the same
    candidate, the other devices as chosen) is kept if its estimate is within the
    margin. Every candidate of the group is a uniform choice to try, not only the plans
    the mix holds: a mix can hold neither half of the best uniform plan, and one of its
    halves for every member can run slower than that plan (evidence:
    bench/results/2026-11-22-s9a-planner). The margin is wide because noise in a profile
    moves a mix's estimated lead across a narrower one, between plans of which the
    uniform one ran faster every time it was measured; `SYMMETRY_MARGIN` is wide enough
    that fresh profiles of the same case keep to the uniform plan (evidence:
    bench/results/2026-11-26-s18-planner, from bench/planner_accuracy.py --stability).
    The trials go in the order of a lower bound of their estimate, the larger of a
    member's floor epoch and the group's server seconds per epoch, and stop where that
    bound reaches the best trial (no later one can beat it) or after `WORK_BUDGET`
    micro-batches of schedules.
    """
    candidates = objective.candidates
    best_value = objective(choice)[0]
    for members in _groups(candidates):
        if len(members) < 2 or len({choice[k] for k in members}) < 2:
            continue
        cs = candidates[members[0]]
        bound = {i: _uniform_bound(cs, members, i) for i in range(len(cs))}
        budget = objective.work + WORK_BUDGET
        found: tuple[float, list[int]] | None = None
        for i in sorted(bound, key=lambda i: (bound[i], cs[i].plan)):
            if found is not None and (bound[i] >= found[0] or objective.work >= budget):
                break
            trial = choice.copy()
            for k in members:
                trial[k] = i
            value = objective(trial)[0]
            if found is None or value < found[0]:
                found = (value, trial)
        if found is not None and found[0] <= best_value * (1 + SYMMETRY_MARGIN):
            choice, best_value = found[1], min(found[0], best_value)
    return choice


def exhaustive_plans(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    batch_size: int,
    *,
    split_points: Sequence[int] | None = None,
    parallel_batches: Sequence[int] | None = None,
    memory_budget_bytes: Sequence[int | None] | None = None,
    aggregation_every: int = 0,
) -> list[tuple[int, int]]:
    """The exact argmin of the estimated epoch over every combination of candidates.

    Same candidates as `select_plans`; among equal estimates the first combination in
    lexicographic candidate order wins.

    Raises:
        ConfigError: as `select_plans`, or more than `MAX_COMBINATIONS` combinations.
    """
    candidates = plan_candidates(
        model, devices, batch_size, split_points, parallel_batches, memory_budget_bytes,
        aggregation_every,
    )
    combinations = math.prod(len(cs) for cs in candidates)
    if combinations > MAX_COMBINATIONS:
        raise ConfigError(
            f"{combinations} plan combinations, more than the "
            f"{MAX_COMBINATIONS} an exhaustive search accepts"
        )
    objective = Objective(model, candidates, aggregation_every)
    best_value, best_choice = math.inf, [0] * len(candidates)
    for choice in itertools.product(*(range(len(cs)) for cs in candidates)):
        value = objective(choice)[0]
        if value < best_value:
            best_value, best_choice = value, list(choice)
    return [cs[i].plan for cs, i in zip(candidates, best_choice, strict=True)]
