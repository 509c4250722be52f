"""HADFL's training strategy (§III-B, §III-C), pure: how many local steps each device
takes between synchronisations, which parameter versions the devices will hold, and who
synchronises with whom.

- **Mutual negotiation** (§III-B): every device trains ``E_warmup`` epochs and reports
  the seconds ``T_i`` they took. An epoch takes ``T_i / E_warmup`` on device i.
- **Hyperperiod** (§III-C): ``H_E``, the least common multiple of the devices' epoch
  times; a synchronisation comes every ``T_sync`` hyperperiods. Epoch times are real
  numbers, so `hyperperiod` takes the LCM of each device's epoch time in whole multiples
  of the fastest one's (rounded), and caps it (`MAX_HYPERPERIOD`): a fleet whose ratios
  are 1, 2 and 3 has a hyperperiod of 6 fastest epochs; one whose LCM would exceed the
  cap gets the slowest device's epoch time, rounded up to a whole number of fastest
  epochs, instead (every device then still completes a whole number of its epochs, or
  close to it, within a period).
- **Local steps** (Algorithm 1): device i takes as many steps as fit its speed in the
  period, ``E_i = round(T_sync · H_E / step_i)`` (at least 1), where ``step_i`` is its
  seconds per mini-batch.
- **Expected versions** (Eq. 6): the version a device's parameters reach in a period, in
  epochs. As printed, Eq. 6 reads ``v̂_i = T_sync · T_i / E_warmup``, which would expect
  the *slowest* device to be newest; §III-B says ``T_i`` is inversely proportional to
  the device's computing power, so we take the epochs it completes in a period:
  ``v̂_i = T_sync · H_E · E_warmup / T_i`` (docs/design.md §HADFL records the choice).
- **Version prediction** (Eq. 7): Holt's double exponential smoothing of each device's
  version per round (`Holt`), predicting the next round's.
- **Selection** (Eq. 8): device i is chosen with probability ``f(v_i) / Σ f(v_n)``, f the
  normal density centred on μ, the third quartile of the predicted versions, so devices
  of medial-to-new versions are chosen most and stragglers still sometimes. Eq. 8 uses
  the density of a unit variance on raw versions, which makes every device more than a
  few versions from μ all but unselectable (versions run into the thousands); we measure
  the distance from μ in units of the versions' spread (their standard deviation; 1 when
  they are all equal). ``N_p`` devices are drawn one after another without replacement,
  each draw by those probabilities among the devices left (`select`), and a random
  directed ring joins them (`ring`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from aiopipe.errors import ConfigError

__all__ = [
    "MAX_HYPERPERIOD",
    "Holt",
    "Round",
    "StrategyGenerator",
    "bypass",
    "expected_versions",
    "groups_of",
    "hyperperiod",
    "local_steps",
    "ring",
    "select",
    "selection_probabilities",
    "upstream",
]

#: The most fastest-device epochs a hyperperiod may last (`hyperperiod`).
MAX_HYPERPERIOD = 64


def _check_times(times: Sequence[float], what: str) -> None:
    if not times or any(not math.isfinite(t) or t <= 0 for t in times):
        raise ConfigError(f"{what} must be positive finite seconds, one per device, got "
                          f"{list(times)}")


def hyperperiod(epoch_times: Sequence[float]) -> float:
    """``H_E``: the least common multiple of the devices' epoch times (seconds), each
    taken as a whole number of the fastest device's epochs (rounded, at least 1); capped
    at `MAX_HYPERPERIOD` fastest epochs, past which the slowest device's epoch time,
    rounded up to whole fastest epochs, is the period (module docstring).

    Raises:
        ConfigError: a time is not a positive finite number, or there is none.
    """
    _check_times(epoch_times, "epoch times")
    fastest = min(epoch_times)
    multiples = [max(1, round(t / fastest)) for t in epoch_times]
    lcm = math.lcm(*multiples)
    if lcm > MAX_HYPERPERIOD:
        lcm = math.ceil(max(epoch_times) / fastest)
    return fastest * lcm


def local_steps(step_times: Sequence[float], period_s: float) -> tuple[int, ...]:
    """``E_i``: the mini-batches device i trains in a period of ``period_s`` seconds at
    ``step_times[i]`` seconds each (rounded, at least 1).

    Raises:
        ConfigError: a time or the period is not a positive finite number.
    """
    _check_times(step_times, "step times")
    _check_times([period_s], "the period")
    return tuple(max(1, round(period_s / t)) for t in step_times)


def expected_versions(warmup_times: Sequence[float], warmup_epochs: int,
                      period_s: float) -> tuple[float, ...]:
    """Eq. 6 as we read it (module docstring): the epochs device i completes in a period
    of ``period_s`` seconds, having taken ``warmup_times[i]`` seconds for
    ``warmup_epochs`` epochs.

    Raises:
        ConfigError: a time, the period or the epochs are not positive.
    """
    _check_times(warmup_times, "warm-up times")
    _check_times([period_s], "the period")
    if warmup_epochs < 1:
        raise ConfigError(f"warm-up epochs must be at least 1, got {warmup_epochs}")
    return tuple(period_s * warmup_epochs / t for t in warmup_times)


class Holt:
    """Holt's double exponential smoothing of one device's parameter version (Eq. 7).

    Args:
        alpha: the smoothing factor, 0 < alpha < 1 (larger: closer to the latest
            version).
        first: the first version seen (both smoothed series start there).
    """

    def __init__(self, alpha: float, first: float) -> None:
        if not 0 < alpha < 1:
            raise ConfigError(f"the smoothing factor must lie in (0, 1), got {alpha}")
        self.alpha = alpha
        self.s1 = self.s2 = float(first)

    def update(self, version: float) -> None:
        """The version this round's synchronisation saw."""
        a = self.alpha
        self.s1 = a * version + (1 - a) * self.s1
        self.s2 = a * self.s1 + (1 - a) * self.s2

    def predict(self, ahead: int = 1) -> float:
        """``v̂_{j+m}``: the version ``ahead`` rounds after the last one seen."""
        level = 2 * self.s1 - self.s2
        trend = self.alpha / (1 - self.alpha) * (self.s1 - self.s2)
        return level + trend * ahead


def selection_probabilities(versions: Sequence[float]) -> tuple[float, ...]:
    """Eq. 8: each device's probability of being chosen, from its predicted version:
    the normal density at its distance from the versions' third quartile, in units of
    their standard deviation (module docstring), normalised over the devices.

    Raises:
        ConfigError: no versions, or one is not finite.
    """
    if not versions or any(not math.isfinite(v) for v in versions):
        raise ConfigError(f"versions must be finite numbers, got {list(versions)}")
    if len(versions) == 1:
        return (1.0,)
    mu = statistics.quantiles(versions, n=4, method="inclusive")[2]
    spread = statistics.pstdev(versions) or 1.0
    density = [math.exp(-0.5 * ((v - mu) / spread) ** 2) for v in versions]
    total = math.fsum(density)
    return tuple(d / total for d in density)


def select(versions: Sequence[float], count: int, rng: random.Random) -> tuple[int, ...]:
    """``count`` devices (indices into ``versions``) drawn one after another without
    replacement, each draw by Eq. 8's probabilities among the devices left.

    Raises:
        ConfigError: ``count`` is not in 1..len(versions), or a version is not finite.
    """
    if not 1 <= count <= len(versions):
        raise ConfigError(f"cannot select {count} of {len(versions)} devices")
    weights = list(selection_probabilities(versions))
    left = list(range(len(versions)))
    chosen: list[int] = []
    for _ in range(count):
        pick = rng.choices(range(len(left)), weights=[weights[d] for d in left])[0]
        chosen.append(left.pop(pick))
    return tuple(chosen)


def ring(devices: Sequence[int], rng: random.Random) -> tuple[int, ...]:
    """A random directed ring over ``devices``: each sends to the next, the last to the
    first."""
    order = list(devices)
    rng.shuffle(order)
    return tuple(order)


def upstream(order: Sequence[int], device: int) -> int:
    """Who sends to ``device`` in the ring ``order``.

    Raises:
        ValueError: ``device`` is not in the ring.
    """
    return order[order.index(device) - 1]


def bypass(order: Sequence[int], dead: int) -> tuple[int, ...]:
    """The ring without ``dead`` (§III-D's fault tolerance: its downstream, hearing
    nothing within the waiting time, asks it, then warns its upstream, which sends to the
    downstream from then on); the others keep their order.

    Raises:
        ValueError: ``dead`` is not in the ring.
    """
    if dead not in order:
        raise ValueError(f"device {dead} is not in the ring {list(order)}")
    return tuple(d for d in order if d != dead)


@dataclass(frozen=True, slots=True)
class Round:
    """One synchronisation round's configuration: the period (seconds of training
    between synchronisations), each device's local steps in it, the versions the
    devices are expected to reach, and the devices chosen, in ring order (each sends to
    the next, the last to the first)."""

    period_s: float
    steps: tuple[int, ...]
    expected: tuple[float, ...]
    ring: tuple[int, ...]


class StrategyGenerator:
    """HADFL's strategy generator and runtime supervisor (§III-A to §III-C): from the
    mutual negotiation's times, each round's period, local steps and ring; from the
    versions each synchronisation saw, the next round's predicted versions (`Holt`),
    and so its selection.

    Args:
        warmup_times: seconds each device took for the warm-up.
        warmup_epochs: ``E_warmup``.
        batches: each device's mini-batches per epoch.
        periods: ``T_sync``, hyperperiods between synchronisations (>= 1).
        selected: ``N_p``, devices in each ring (1..devices).
        alpha: Holt's smoothing factor.
        seed: the selections' and rings' random stream.
        fixed_steps: every device takes this many steps per round instead of Algorithm
            1's (the synchronous baselines: decentralized FedAvg, DDP).

    Raises:
        ConfigError: a value is out of its range.
    """

    def __init__(self, warmup_times: Sequence[float], warmup_epochs: int,
                 batches: Sequence[int], *, periods: int, selected: int, alpha: float,
                 seed: int, fixed_steps: int | None = None) -> None:
        _check_times(warmup_times, "warm-up times")
        if len(batches) != len(warmup_times) or any(b < 1 for b in batches):
            raise ConfigError(f"batches per epoch must be at least 1 for each of the "
                              f"{len(warmup_times)} devices, got {list(batches)}")
        if not 0 < alpha < 1:
            raise ConfigError(f"the smoothing factor must lie in (0, 1), got {alpha}")
        if periods < 1 or not 1 <= selected <= len(warmup_times):
            raise ConfigError(f"T_sync must be at least 1 and N_p in 1..{len(warmup_times)}"
                              f", got {periods} and {selected}")
        epoch_times = [t / warmup_epochs for t in warmup_times]
        self.period_s = periods * hyperperiod(epoch_times)
        #: each device's seconds per mini-batch, as the negotiation measured
        self.step_times = tuple(t / b for t, b in zip(epoch_times, batches, strict=True))
        self.steps = local_steps(self.step_times, self.period_s)
        self._expected = expected_versions(warmup_times, warmup_epochs, self.period_s)
        if fixed_steps is not None:
            if fixed_steps < 1:
                raise ConfigError(f"fixed local steps must be at least 1, got {fixed_steps}")
            self.steps = (fixed_steps,) * len(batches)
            self._expected = tuple(fixed_steps / b for b in batches)
        self.selected = selected
        self._rng = random.Random(seed)
        self._holt: list[Holt] | None = None
        self._alpha = alpha

    def next_round(self, versions: Sequence[float] | None = None,
                   available: Sequence[int] | None = None) -> Round:
        """The next round: with ``versions`` (each device's parameter version, in
        epochs, at the synchronisation that ended the last round), predicted by Holt's
        smoothing; before any (the first round), Eq. 6's expectation. The ring is drawn
        among ``available`` (the liveness monitor's; None: every device), of at most
        ``selected`` of them.

        Raises:
            ConfigError: ``versions`` does not hold one finite version per device, or
                no device is available.
        """
        expected = self.predict(versions)
        pool = list(range(len(self.steps))) if available is None else available
        return Round(self.period_s, self.steps, expected,
                     self.draw(expected, pool, self.selected))

    def predict(self, versions: Sequence[float] | None = None) -> tuple[float, ...]:
        """Each device's version expected at the next synchronisation: Holt's
        prediction once it has seen ``versions`` (the last round's), Eq. 6's before.

        Raises:
            ConfigError: ``versions`` does not hold one finite version per device.
        """
        if versions is not None:
            if len(versions) != len(self.steps) or any(not math.isfinite(v)
                                                       for v in versions):
                raise ConfigError(f"one finite version per device, got {list(versions)}")
            if self._holt is None:
                self._holt = [Holt(self._alpha, v) for v in versions]
            else:
                for holt, v in zip(self._holt, versions, strict=True):
                    holt.update(v)
        return (tuple(h.predict() for h in self._holt) if self._holt is not None
                else self._expected)

    def draw(self, expected: Sequence[float], pool: Sequence[int], count: int
             ) -> tuple[int, ...]:
        """A random ring of at most ``count`` of ``pool``'s devices, drawn by Eq. 8 on
        their ``expected`` versions.

        Raises:
            ConfigError: ``pool`` is empty or names a device that is not the fleet's.
        """
        pool = sorted(pool)
        if not pool or any(not 0 <= d < len(self.steps) for d in pool):
            raise ConfigError(f"no devices of 0..{len(self.steps) - 1} available: {pool}")
        picked = select([expected[d] for d in pool], min(count, len(pool)), self._rng)
        return ring([pool[i] for i in picked], self._rng)


def groups_of(devices: int, size: int) -> list[list[int]]:
    """The fleet's groups (§III-C, many devices): consecutive ids, ``size`` each (the
    last the rest); one group of all when ``size`` is 0 or at least ``devices``."""
    if size <= 0 or size >= devices:
        return [list(range(devices))]
    return [list(range(first, min(first + size, devices)))
            for first in range(0, devices, size)]
