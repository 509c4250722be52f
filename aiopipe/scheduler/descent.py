"""Steps 1-4 of the plan search (`aiopipe.scheduler.select`, whose module docstring
describes them): each device's best plan alone, the balanced plan, coordinate descent on
the fleet estimate and iterated local search.

Pure and deterministic: the kicks come from a generator with a fixed seed. Every
function stops once the `Objective` has simulated the ``budget`` it is given, in
micro-batches (`aiopipe.scheduler.select.WORK_BUDGET`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from aiopipe.scheduler.candidates import Candidate, Objective

__all__ = ["KICKS", "PAIR_TRIES", "alone_best", "balanced_choice", "descend", "perturbed"]

#: Candidates each device of a pair move tries.
PAIR_TRIES = 8
#: Kicks in a row that find nothing better before the iterated local search stops.
KICKS = 10
#: Relative improvement below which two estimates count as equal.
_EPS = 1e-12


def alone_best(cs: Sequence[Candidate]) -> int:
    """Step 1 of the search: the candidate with the least alone epoch (ties: the least
    server load, then the fewest micro-batches, then the shallowest split)."""
    return min(
        range(len(cs)),
        key=lambda i: (cs[i].alone_epoch, cs[i].server_load, cs[i].plan[1], cs[i].plan[0]),
    )


def balanced_choice(candidates: list[list[Candidate]]) -> list[int]:
    """Exact argmin of max(max_k alone epoch_k, sum_k server load_k) (step 2 of the search)."""
    fronts = []  # per device: alone epochs ascending, and the least-load index so far
    for cs in candidates:
        order = sorted(range(len(cs)), key=lambda i: (cs[i].alone_epoch, cs[i].server_load))
        epochs = [cs[i].alone_epoch for i in order]
        best_so_far, lightest = [], order[0]
        for i in order:
            if cs[i].server_load < cs[lightest].server_load:
                lightest = i
            best_so_far.append(lightest)
        fronts.append((epochs, best_so_far))

    def choose(threshold: float) -> tuple[float, float, list[int]]:
        choice = [
            lightest[bisect.bisect_right(epochs, threshold) - 1] for epochs, lightest in fronts
        ]
        worst = max(cs[i].alone_epoch for cs, i in zip(candidates, choice, strict=True))
        load = sum(cs[i].server_load for cs, i in zip(candidates, choice, strict=True))
        return max(worst, load), load, choice

    floor = max(epochs[0] for epochs, _ in fronts)
    thresholds = sorted({e for epochs, _ in fronts for e in epochs if e >= floor})
    # the load is non-increasing in the threshold: find the first T with load <= T
    lo, hi = 0, len(thresholds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if choose(thresholds[mid])[1] <= thresholds[mid]:
            hi = mid
        else:
            lo = mid + 1
    tries = [choose(thresholds[i]) for i in sorted({max(0, lo - 1), lo})]
    return min(tries, key=lambda t: t[0])[2]


def _leximax_less(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether per-device epochs ``a`` beat ``b``: the largest first, then the next, ..."""
    for x, y in zip(sorted(a, reverse=True), sorted(b, reverse=True), strict=True):
        if x < y * (1 - _EPS):
            return True
        if y < x * (1 - _EPS):
            return False
    return False


class _Search:
    """The descent's state: the current choice, its per-device epochs, and the budget."""

    def __init__(self, objective: Objective, start: list[int], budget: int) -> None:
        self.objective = objective
        self.budget = budget
        self.candidates = objective.candidates
        self.current = list(start)
        before = objective.work
        self.best, self.per_device = objective(self.current)
        # how many candidates one device may try per round: all of them in small fleets;
        # in large ones as many as lets every device have its turn twice within budget
        affordable = budget // max(1, objective.work - before)
        self.tries = max(1, affordable // (2 * len(start)))

    def spent(self) -> bool:
        return self.objective.work >= self.budget

    def _viable(self, k: int) -> list[int]:
        """Device k's other candidates that could beat the best, most promising first.

        [Note: move proxy] A candidate is ranked by a guess of the worst epoch it would
        lead to: its own alone epoch plus the contention device k suffers now, and, for
        the slowest other devices, their epoch plus the change in server seconds per
        iteration it causes, times the iterations they share with k.
        """
        cs, mine = self.candidates[k], self.candidates[k][self.current[k]]
        limit = self.best * (1 - _EPS)
        delay = self.per_device[k] - mine.alone_epoch
        work_now = mine.server_load / mine.iterations
        slowest = sorted(
            (j for j in range(len(self.current)) if j != k), key=lambda j: -self.per_device[j]
        )[:4]
        others = [
            (self.per_device[j], self.candidates[j][self.current[j]].iterations) for j in slowest
        ]

        def guess(i: int) -> tuple[float, float]:
            c = cs[i]
            change = c.server_load / c.iterations - work_now
            worst = c.alone_epoch + delay
            for epoch, iterations in others:
                worst = max(worst, epoch + min(iterations, c.iterations) * change)
            return worst, c.alone_epoch

        viable = [i for i in range(len(cs)) if i != self.current[k] and cs[i].floor_epoch < limit]
        viable.sort(key=guess)
        return viable

    def _try(self, changes: Sequence[tuple[int, int]]) -> tuple[float, list[float]] | None:
        trial = self.current.copy()
        for k, i in changes:
            trial[k] = i
        value, per_device = self.objective(trial)
        return (value, per_device) if _leximax_less(per_device, self.per_device) else None

    def single_round(self) -> bool:
        """Each device in turn (slowest first) takes its best candidate; any change?"""
        improved = False
        for k in sorted(range(len(self.current)), key=lambda j: -self.per_device[j]):
            pick: tuple[int, float, list[float]] | None = None
            for i in self._viable(k)[: self.tries]:
                if self.spent():
                    break
                found = self._try([(k, i)])
                if found and (pick is None or _leximax_less(found[1], pick[2])):
                    pick = (i, *found)
            if pick is not None:
                self.current[k], self.best, self.per_device = pick
                improved = True
            if self.spent():
                break
        return improved

    def pair_move(self) -> bool:
        """Two devices change together, the slowest pairs first (first improvement); each
        tries its `PAIR_TRIES` most promising candidates."""
        order = sorted(range(len(self.current)), key=lambda j: -self.per_device[j])
        tries = min(self.tries, PAIR_TRIES)
        for a, k in enumerate(order):
            mine = self._viable(k)[:tries]
            for j in order[a + 1 :]:
                for i in mine:
                    for i2 in self._viable(j)[:tries]:
                        if self.spent():
                            return False
                        found = self._try([(k, i), (j, i2)])
                        if found:
                            self.current[k], self.current[j] = i, i2
                            self.best, self.per_device = found
                            return True
        return False


def descend(objective: Objective, start: list[int], budget: int
            ) -> tuple[list[int], list[float]]:
    """Coordinate descent on the fleet estimate from ``start``: its local optimum and the
    per-device epochs there (step 3 of the search), until ``objective`` has simulated
    ``budget`` micro-batches in all.

    Single-device rounds until one changes nothing, then one pair move, and again, until
    neither helps or the budget is spent. Every accepted move makes the per-device
    epochs strictly better in leximax order (the slowest first, then the next: moves
    that help a device off the critical path count), so the descent cannot cycle.
    """
    search = _Search(objective, start, budget)
    while not search.spent():
        if search.single_round():
            continue
        if not search.pair_move():
            break
    return search.current, search.per_device


def perturbed(objective: Objective, best: list[int], per_device: list[float],
              budget: int) -> list[int]:
    """Iterated local search (step 4 of the search): kick, descend, keep the better; until
    ``objective`` has simulated ``budget`` micro-batches in all."""
    candidates = objective.candidates
    rng = random.Random(0)  # a fixed seed: the same inputs give the same plans
    stale = 0
    while stale < KICKS and objective.work < budget:
        trial = best.copy()
        for k in rng.sample(range(len(trial)), min(3, len(trial))):
            trial[k] = rng.randrange(len(candidates[k]))
        found, found_devices = descend(objective, trial, budget)
        if _leximax_less(found_devices, per_device):
            best, per_device, stale = found, found_devices, 0
        else:
            stale += 1
    return best
