"""HADFL's training strategy (aiopipe.scheduler.hadfl): the hyperperiod and local steps
by capacity, expected versions, Holt's version prediction, and Eq. 8's selection, whose
frequencies over many rounds match its probabilities."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from aiopipe.errors import ConfigError
from aiopipe.scheduler.hadfl import (
    MAX_HYPERPERIOD,
    Holt,
    StrategyGenerator,
    bypass,
    expected_versions,
    hyperperiod,
    local_steps,
    ring,
    select,
    selection_probabilities,
    upstream,
)


@pytest.mark.parametrize(("epochs", "expected"), [
    ([2.0, 4.0, 6.0], 12.0),  # 1, 2, 3 fastest epochs: their LCM, 6
    ([1.0, 1.9, 4.1], 4.0),  # rounded to 1, 2, 4
    ([1.0, 7.0, 11.0, 13.0], 13.0),  # LCM 1001 > the cap: the slowest, in fastest epochs
    ([3.0], 3.0),
])
def test_the_hyperperiod_is_the_lcm_of_the_epoch_times_within_a_cap(
        epochs: list[float], expected: float) -> None:
    assert hyperperiod(epochs) == pytest.approx(expected)
    assert hyperperiod(epochs) <= MAX_HYPERPERIOD * min(epochs)


def test_local_steps_follow_each_device_s_speed() -> None:
    assert local_steps([0.1, 0.2, 0.3], 6.0) == (60, 30, 20)
    assert local_steps([10.0], 1.0) == (1,)  # at least one


def test_a_faster_device_is_expected_to_reach_a_newer_version() -> None:
    """Eq. 6 as we read it: the epochs a device completes in a period."""
    versions = expected_versions([10.0, 20.0, 40.0], 2, 12.0)
    assert versions == pytest.approx((2.4, 1.2, 0.6))


@pytest.mark.parametrize("bad", [[], [0.0], [1.0, math.nan], [-1.0]])
def test_bad_times_are_refused(bad: list[float]) -> None:
    with pytest.raises(ConfigError):
        hyperperiod(bad)


def test_holt_follows_a_trend_and_a_level() -> None:
    trend = Holt(0.5, 5.0)
    for j in range(1, 60):
        trend.update(5.0 + 3.0 * j)
    assert trend.predict() == pytest.approx(5.0 + 3.0 * 60, abs=1e-6)
    assert trend.predict(4) == pytest.approx(5.0 + 3.0 * 63, abs=1e-6)
    level = Holt(0.3, 7.0)
    for _ in range(10):
        level.update(7.0)
    assert level.predict() == pytest.approx(7.0)
    with pytest.raises(ConfigError):
        Holt(1.0, 0.0)


def test_selection_favours_the_third_quartile_and_keeps_stragglers() -> None:
    versions = [10.0, 40.0, 50.0, 60.0, 100.0]
    p = selection_probabilities(versions)
    assert math.fsum(p) == pytest.approx(1.0)
    assert max(range(5), key=p.__getitem__) == 3  # the third quartile is 60
    assert p[3] > p[4] > p[0] > 0  # the newest is not the likeliest; stragglers stay in
    assert selection_probabilities([5.0] * 4) == pytest.approx((0.25,) * 4)


def _inclusion(p: tuple[float, ...], count: int) -> list[float]:
    """Each device's chance of being among ``count`` drawn one after another without
    replacement with weights ``p``, by enumerating every ordered draw."""
    chance = [0.0] * len(p)
    for order in itertools.permutations(range(len(p)), count):
        left, probability = 1.0, 1.0
        for d in order:
            probability *= p[d] / left
            left -= p[d]
        for d in order:
            chance[d] += probability
    return chance


@pytest.mark.parametrize("count", [1, 2, 3])
def test_selection_frequencies_over_many_rounds_match_eq_8(count: int) -> None:
    versions = [12.0, 30.0, 31.0, 45.0, 47.0, 80.0]
    p = selection_probabilities(versions)
    rng = random.Random(26)
    rounds = 20000
    seen = [0] * len(versions)
    for _ in range(rounds):
        chosen = select(versions, count, rng)
        assert len(set(chosen)) == count
        for d in chosen:
            seen[d] += 1
    expected = _inclusion(p, count)
    for d in range(len(versions)):
        # 4 standard errors of a binomial frequency
        tolerance = 4 * math.sqrt(expected[d] * (1 - expected[d]) / rounds) + 1e-9
        assert abs(seen[d] / rounds - expected[d]) < tolerance, (d, seen[d] / rounds)
    with pytest.raises(ConfigError):
        select(versions, 7, rng)


def test_the_ring_is_a_random_order_of_the_chosen() -> None:
    rng = random.Random(1)
    orders = {ring([3, 5, 8], rng) for _ in range(200)}
    assert all(sorted(order) == [3, 5, 8] for order in orders)
    assert len(orders) == 6  # every directed ring of three appears


def test_the_strategy_generator_plans_rounds_by_capacity_and_prediction() -> None:
    """Devices 2x and 4x slower than device 0 (warm-up of 2 epochs; 10 batches an
    epoch): the period is 2 hyperperiods of 4 fastest epochs; each device's steps fill
    it at its speed; the first round expects Eq. 6's versions; later ones Holt's
    predictions of the versions the synchronisations saw; every ring holds N_p devices."""
    generator = StrategyGenerator([2.0, 4.0, 8.0], 2, [10, 10, 10], periods=2, selected=2,
                                  alpha=0.5, seed=3)
    first = generator.next_round()
    assert first.period_s == pytest.approx(8.0)  # 2 x lcm(1, 2, 4) x 1 s
    assert first.steps == (80, 40, 20)
    assert first.expected == pytest.approx((8.0, 4.0, 2.0))
    assert len(first.ring) == 2
    seen = [8.0, 4.0, 2.0]
    for _ in range(30):
        seen = [v + d for v, d in zip(seen, (8.0, 4.0, 1.0), strict=True)]  # 2 slows down
        later = generator.next_round(seen)
        assert len(set(later.ring)) == 2
    assert later.expected == pytest.approx([v + d for v, d in zip(seen, (8.0, 4.0, 1.0),
                                                                  strict=True)], abs=1e-3)
    with pytest.raises(ConfigError):
        generator.next_round([1.0, math.inf, 2.0])
    with pytest.raises(ConfigError):
        StrategyGenerator([2.0, 4.0], 2, [10, 10], periods=1, selected=3, alpha=0.5, seed=0)


def test_a_dead_peer_is_bypassed_by_its_upstream() -> None:
    """Ring 4 -> 1 -> 7 -> 2 -> 4: device 7 dies; its downstream (2) warns its upstream
    (1), which sends to 2 from then on; the others keep their order."""
    order = (4, 1, 7, 2)
    assert upstream(order, 2) == 7
    assert upstream(order, 7) == 1
    assert upstream(order, 4) == 2  # the last sends to the first
    repaired = bypass(order, 7)
    assert repaired == (4, 1, 2)
    assert upstream(repaired, 2) == 1
    with pytest.raises(ValueError, match="not in the ring"):
        bypass(order, 9)
