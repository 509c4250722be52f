"""Central differential privacy at the server: DP-FedAvg with fixed or adaptive clipping.

Theory of operation (McMahan et al. 2018, "Learning Differentially Private Recurrent
Language Models", DP-FedAvg with a fixed denominator; Andrew et al. 2021,
"Differentially Private Learning with Adaptive Clipping", Algorithm 1). Each device's
update is its model minus the round's start, Delta_k = w_k - x_t, over every floating
entry it uploads (parameters and floating buffers, [Note: strategies see what is
uploaded]). The server

    clips      Delta_k <- Delta_k * min(1, C / ||Delta_k||)      (one L2 norm over all)
    sums       S = sum_k Delta_k
    noises     S~ = S + N(0, (z_Delta C)^2 I)
    averages   x_{t+1} = x_t + eta S~ / m

with m the expected number of devices a round (``devices_per_round``'s count, else all):
a fixed denominator, so that adding or removing one device moves S by at most C and the
round is a Gaussian mechanism of noise multiplier z_Delta (devices weigh the same; their
sample counts are not used, which would raise the sensitivity).

Adaptive clipping (``clipping = "adaptive"``) moves C towards the ``target_quantile``
gamma of the update norms: each device also contributes b_k = 1[||Delta_k|| <= C],
centred as b_k - 1/2 (so that one device moves their sum by at most 1/2: a Gaussian
mechanism of multiplier 2 sigma_b); the server takes b~ = (sum_k (b_k - 1/2) +
N(0, sigma_b^2)) / m + 1/2 and sets C <- C exp(-eta_C (b~ - gamma)) (the geometric
update). Both releases are accounted as one Gaussian mechanism of the run's
``noise_multiplier`` z by drawing the updates' noise with z_Delta = (z^-2 -
(2 sigma_b)^-2)^(-1/2) (Andrew et al. §3.1; TensorFlow Privacy's quantile estimator
centres the bits alike), which needs sigma_b > z / 2. The paper's
sigma_b is m / 20; for small fleets, where that is below z / 2, aiopipe's default is
max(m / 20, z) (the updates' noise is then at most 1.155 z).

Noise is drawn in float64 from a generator seeded by (run seed, round): first the clip
count's (adaptive), then each floating entry's in ``start``'s order; a run is
reproducible.

One release a round. The coordinator's judge may ask for the aggregate again on subsets
of the devices when it refuses one ([Note: judging updates]); each such aggregate would
be another release, chosen by looking at the last. So `DpFedAvg.aggregate` computes
the round's aggregate once, from the devices it is first given, and answers every later
call of the round (until `DpFedAvg.configure_round`) with that same aggregate: the judge
installs it or, finding it refused on every subset, leaves the round's start as the
model (the round's update is dropped, its privacy spent).

Accounting (aiopipe.runtime.privacy_accounting): every round's aggregate is one
sampled Gaussian mechanism of noise multiplier z and rate q = m / N (1 when every device
trains every round), N the run's devices; epsilon at the run's ``delta`` is Opacus's RDP
accountant's for that history ([Note: sampling assumed by the accountant]: rounds draw
m devices without replacement, the accountant assumes Poisson sampling). A round whose
aggregate the judge refused is still counted. Integer entries (batch norm's counters)
take the devices' plain average, as FedAvg's, unnoised: they count batches, not what is
in them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from aiopipe.errors import ConfigError, TrainingError
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.privacy import round_generator
from aiopipe.runtime.privacy_accounting import epsilon, require_opacus
from aiopipe.strategies.base import Settings, State, Stateless
from aiopipe.strategies.builtin import _count, _number

__all__ = ["CLIPPINGS", "DpFedAvg", "central_generator", "clip_noise_multiplier"]

#: How the clipping norm is set.
CLIPPINGS = ("fixed", "adaptive")
#: Where central DP's generators sit among `round_generator`'s device ids: above any
#: device's, so that no device's noise is the server's.
_SERVER_STREAM = 1 << 24


def central_generator(seed: int, round_no: int) -> torch.Generator:
    """The central noise of round ``round_no``'s aggregate."""
    return round_generator(seed, _SERVER_STREAM, round_no)


def clip_noise_multiplier(z: float, count_stddev: float) -> float:
    """z_Delta, the updates' noise multiplier that leaves adaptive clipping with the
    privacy of one Gaussian mechanism of multiplier ``z`` (Andrew et al. §3.1).

    Raises:
        ConfigError: ``count_stddev`` <= z / 2 (no z_Delta exists).
    """
    if not count_stddev > z / 2:
        raise ConfigError(f"clip_count_stddev must be > noise_multiplier / 2 ({z / 2:g}) "
                          f"for adaptive clipping, got {count_stddev:g}")
    return float((z ** -2 - (2 * count_stddev) ** -2) ** -0.5)


class DpFedAvg(Stateless):
    """DP-FedAvg (module docstring). Options (``aggregation_options``): ``noise_multiplier``
    z > 0, ``clip`` C > 0 (the initial one when adaptive), ``clipping`` "fixed" or
    "adaptive", ``target_quantile`` gamma in (0, 1), ``clip_learning_rate`` eta_C > 0,
    ``clip_count_stddev`` sigma_b (0: max(m / 20, z)), ``eta`` (server learning rate),
    ``delta``. From the run unless given: ``delta`` (``dp_delta``), ``seed``,
    ``population`` (devices) and ``per_round`` (devices a round).

    Raises:
        ConfigError: a value out of range, or Opacus (the accountant) is not installed.
    """

    def __init__(self, noise_multiplier: float = 1.0, clip: float = 1.0,
                 clipping: str = "fixed", target_quantile: float = 0.5,
                 clip_learning_rate: float = 0.2, clip_count_stddev: float = 0.0,
                 eta: float = 1.0, delta: float = 1e-5, seed: int = 0, population: int = 1,
                 per_round: int = 1) -> None:
        self.noise_multiplier = _positive("noise_multiplier", noise_multiplier)
        self.clip = _positive("clip", clip)
        if clipping not in CLIPPINGS:
            raise ConfigError(f"clipping must be one of {', '.join(CLIPPINGS)}, got "
                              f"{clipping!r}")
        self.adaptive = clipping == "adaptive"
        self.target_quantile = _number("target_quantile", target_quantile, 0.0, 1.0)
        self.clip_learning_rate = _positive("clip_learning_rate", clip_learning_rate)
        self.eta = _positive("eta", eta)
        self.delta = _number("delta", delta, 0.0, 1.0)
        if not self.delta > 0:
            raise ConfigError(f"delta must be a number in (0, 1), got {delta!r}")
        self.seed = int(seed)
        self.population = _count("population", population, 1)
        self.per_round = _count("per_round", per_round, 1)
        if self.per_round > self.population:
            raise ConfigError(f"per_round ({per_round}) exceeds the population "
                              f"({population})")
        stddev = _number("clip_count_stddev", clip_count_stddev, 0.0)
        self.clip_count_stddev = stddev or max(self.per_round / 20, self.noise_multiplier)
        #: the updates' noise multiplier (z itself with fixed clipping)
        self.update_noise = (clip_noise_multiplier(self.noise_multiplier,
                                                   self.clip_count_stddev)
                             if self.adaptive else self.noise_multiplier)
        self.releases = 0  # aggregates computed: Gaussian mechanisms to account
        self._round = 0
        self._released: State | None = None  # the round's aggregate, once computed
        self._staged_clip: float | None = None
        require_opacus('aggregation "dp-fedavg"')  # its accountant: refused now, not later

    @property
    def sample_rate(self) -> float:
        """q = m / N: the chance a device is in a round."""
        return self.per_round / self.population

    def configure_round(self, round_no: int) -> Settings:
        """No settings; notes the round (its noise's seed), whose aggregate is yet to
        be computed."""
        self._round, self._released = round_no, None
        return {}

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """The noised, clipped mean update added to ``start`` (module docstring); with
        adaptive clipping, the next clip norm staged for `installed`. Counts one release;
        a later call in the same round returns the round's aggregate again (one release
        a round: module docstring).

        Raises:
            TrainingError: no states, or states that do not match ``start``.
        """
        if self._released is not None:
            return dict(self._released)
        if not states:
            raise TrainingError("dp-fedavg needs at least one device's state")
        ids = sorted(states)
        for k in ids:
            if set(states[k]) != set(start):
                raise TrainingError(f"dp-fedavg: device {k}'s model does not have the "
                                    "round's entries")
        floating = [key for key, value in start.items() if value.is_floating_point()]
        total = {key: torch.zeros(start[key].shape, dtype=torch.float64) for key in floating}
        below = 0
        for k in ids:
            delta = {key: states[k][key].detach().to(torch.float64)
                     - start[key].detach().to(torch.float64) for key in floating}
            norm = math.sqrt(sum(float(d.square().sum()) for d in delta.values()))
            below += norm <= self.clip
            factor = min(1.0, self.clip / norm) if norm > 0 else 1.0
            for key, d in delta.items():
                total[key].add_(d, alpha=factor)
        generator = central_generator(self.seed, self._round)
        self.releases += 1
        if self.adaptive:
            centred = below - len(ids) / 2 + self.clip_count_stddev * float(
                torch.randn((), generator=generator, dtype=torch.float64))
            fraction = centred / self.per_round + 0.5
            self._staged_clip = self.clip * math.exp(
                -self.clip_learning_rate * (fraction - self.target_quantile))
        sigma = self.update_noise * self.clip
        counters = [key for key in start if key not in total]
        out: State = fedavg([{key: states[k][key] for key in counters} for k in ids],
                            [1.0] * len(ids)) if counters else {}
        for key, value in start.items():
            if key in out:
                continue
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
            mean = total[key].add_(noise, alpha=sigma).div_(self.per_round)
            out[key] = (value.detach().to(torch.float64) + self.eta * mean).to(value.dtype)
        self._released = {key: out[key] for key in start}
        return dict(self._released)

    def installed(self) -> None:
        """Keep the clip norm the installed aggregate computed (adaptive)."""
        if self._staged_clip is not None:
            self.clip, self._staged_clip = self._staged_clip, None

    def privacy_spent(self) -> tuple[float, float]:
        """(epsilon, delta) of the releases so far (module docstring's accounting).

        Raises:
            ConfigError: Opacus is not installed.
        """
        return epsilon([(self.noise_multiplier, self.sample_rate, self.releases)],
                       self.delta), self.delta

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The clip norm and the releases accounted."""
        return {"clip": torch.tensor([self.clip], dtype=torch.float64),
                "releases": torch.tensor([self.releases], dtype=torch.int64)}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take back the clip norm and the releases (a resumed run goes on accounting).

        Raises:
            ConfigError: a tensor this strategy does not keep.
        """
        for name in tensors:
            if name not in ("clip", "releases"):
                raise ConfigError(f"DpFedAvg keeps no state {name!r}")
        if "clip" in tensors:
            self.clip = float(tensors["clip"].reshape(-1)[0])
        if "releases" in tensors:
            self.releases = int(tensors["releases"].reshape(-1)[0])
        self._staged_clip = None


def _positive(what: str, value: object) -> float:
    number = _number(what, value, 0.0)
    if not number > 0:
        raise ConfigError(f"{what} must be a number > 0, got {value!r}")
    return number
