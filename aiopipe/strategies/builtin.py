"""The built-in strategies that average or pick: FedAvg, the robust ones, FedProx.

Each is `aiopipe.runtime.aggregation`'s function of the same name behind the `Strategy`
protocol, so a run's ``aggregation = "fedavg"`` (or "fedmedian", "trimmed-mean",
"krum") gives the numbers it gave before strategies were objects, bit for bit:

- `FedAvg`: sum_k |D_k| / sum_j |D_j| * M_k (PiPar Eq. 3; McMahan et al. 2017);
- `FedMedian`: the coordinate-wise median (Yin et al. 2018), unweighted;
- `TrimmedMean`: per coordinate, the mean after dropping the ``trim`` fraction of
  highest and of lowest values (Yin et al. 2018), unweighted;
- `Krum` / `MultiKrum`: the model (Krum) or the mean of the ``keep`` models (Multi-Krum)
  with the least summed squared distance to their n - f - 2 nearest others, for at most
  f Byzantine devices (Blanchard et al. 2017, "Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent", §4 and §5); the median when a round has fewer
  than f + 3 models left;
- `FedProx` (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): its
  aggregation is FedAvg; what makes it FedProx is on the devices, the proximal term
  mu/2 ||w - w_global||^2 added to each device's loss (`ProximalHook`, named by
  `FedProx.train_hook`), with ``mu`` sent to the round's devices (`configure_round`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from aiopipe.errors import ConfigError
from aiopipe.runtime.aggregation import fedavg, fedmedian, krum, trimmed_mean
from aiopipe.strategies.base import Settings, State, Stateless

__all__ = ["FedAvg", "FedMedian", "FedProx", "Krum", "MultiKrum", "TrimmedMean"]


def _sorted(states: Mapping[int, Mapping[str, torch.Tensor]]
            ) -> tuple[list[int], list[Mapping[str, torch.Tensor]]]:
    ids = sorted(states)
    return ids, [states[k] for k in ids]


def _number(what: str, value: object, low: float, high: float = math.inf) -> float:
    """``value`` as a float in [low, high).

    Raises:
        ConfigError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and low <= value < high):
        bound = f"in [{low:g}, {high:g})" if math.isfinite(high) else f">= {low:g}"
        raise ConfigError(f"{what} must be a number {bound}, got {value!r}")
    return float(value)


def _count(what: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


class FedAvg(Stateless):
    """FedAvg: the devices' states weighted by their samples (module docstring)."""

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """The weighted average (`aiopipe.runtime.aggregation.fedavg`, float64).

        Raises:
            TrainingError: no states, mismatched states, or weights without a positive sum.
        """
        ids, models = _sorted(states)
        return fedavg(models, [weights[k] for k in ids])


class FedMedian(Stateless):
    """The coordinate-wise median (module docstring)."""

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """The median of ``states`` (unweighted).

        Raises:
            TrainingError: no states, or mismatched states.
        """
        return fedmedian(_sorted(states)[1])


class TrimmedMean(Stateless):
    """The coordinate-wise trimmed mean (module docstring); ``trim`` in [0, 0.5) (the
    run's ``trim_fraction`` by default).

    Raises:
        ConfigError: ``trim`` is outside [0, 0.5).
    """

    def __init__(self, trim: float = 0.2) -> None:
        self.trim = _number("trim", trim, 0.0, 0.5)

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """The trimmed mean of ``states`` (unweighted).

        Raises:
            TrainingError: no states, or mismatched states.
        """
        return trimmed_mean(_sorted(states)[1], self.trim)


class MultiKrum(Stateless):
    """Multi-Krum (module docstring): the mean of the ``keep`` lowest-scored models, for
    at most ``byzantine`` bad devices (the run's ``byzantine_devices`` by default);
    ``keep`` 0: n - f, the paper's choice of m. Falls back to the median when fewer than
    f + 3 models are left; ``keep`` above the models left keeps them all.

    Raises:
        ConfigError: ``byzantine`` or ``keep`` is not an integer >= 0.
    """

    def __init__(self, byzantine: int = 1, keep: int = 0) -> None:
        self.byzantine = _count("byzantine", byzantine, 0)
        self.keep = _count("keep", keep, 0)

    def chosen(self, n: int) -> int:
        """How many of ``n`` models are averaged."""
        return min(self.keep, n) if self.keep else max(n - self.byzantine, 1)

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """Multi-Krum's mean of ``states`` (unweighted), or their median when too few.

        Raises:
            TrainingError: no states, or mismatched states.
        """
        models = _sorted(states)[1]
        if len(models) < self.byzantine + 3:
            return fedmedian(models)
        return krum(models, self.byzantine, keep=self.chosen(len(models)))[0]


class Krum(MultiKrum):
    """Krum (module docstring): Multi-Krum keeping one model.

    Raises:
        ConfigError: ``byzantine`` is not an integer >= 0.
    """

    def __init__(self, byzantine: int = 1) -> None:
        super().__init__(byzantine, keep=1)


class FedProx(FedAvg):
    """FedProx (module docstring): FedAvg on the server; on the devices, the proximal
    term with ``mu`` >= 0 (0 is FedAvg).

    Raises:
        ConfigError: ``mu`` is not a finite number >= 0.
    """

    #: the devices' hook (`aiopipe.strategies.hooks.ProximalHook`)
    train_hook = "aiopipe.strategies.hooks:ProximalHook"

    def __init__(self, mu: float = 0.01) -> None:
        self.mu = _number("mu", mu, 0.0)

    def configure_round(self, round_no: int) -> Settings:
        """``proximal_mu``: the round's mu."""
        return {"proximal_mu": self.mu}
