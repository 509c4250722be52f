"""Server optimizers on the pseudo-gradient: FedAvgM, FedAdam, FedYogi, FedAdagrad.

Theory of operation. FedAvg replaces the global model x_t by the devices' average; a
server optimizer treats the round's move as a gradient instead. With the pseudo-gradient

    g_t = x_t - avg_t        (avg_t: the round's FedAvg of the devices' models)

FedAvg is SGD on g_t with learning rate 1 (x_{t+1} = x_t - g_t); the strategies here step
x_t with momentum or adaptive moments. Reddi et al. 2021, "Adaptive Federated
Optimization" (ICLR), Algorithm 2, write Delta_t = avg_t - x_t = -g_t; their rules, per
coordinate, with m_{-1} = 0 and v_{-1} = tau^2 (the paper's v_{-1} >= tau^2, at its
bound), are:

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    FedAdagrad:  v_t = v_{t-1} + Delta_t^2
    FedYogi:     v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
    FedAdam:     v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

(no bias correction: the paper has none). FedAvgM (Hsu et al. 2019, "Measuring the
Effects of Non-Identical Data Distribution for Federated Visual Classification", §3):
v_t = beta v_{t-1} + g_t, x_{t+1} = x_t - eta v_t, with v_{-1} = 0; eta = 1 and beta = 0
is FedAvg.

Every floating entry the devices upload is stepped, batch norm's running statistics too,
as Flower's FedOpt strategies do ([Note: strategies see what is uploaded]); integer ones
(``num_batches_tracked``) take the average. Moments are kept in float64, per entry, and
the new state is cast to the entry's dtype. `aggregate` stages the moments;
`installed` keeps them ([Note: judging updates]: the judge may try several subsets).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aiopipe.errors import ConfigError
from aiopipe.strategies.base import State
from aiopipe.strategies.builtin import FedAvg, _number

__all__ = ["FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptimizer"]

#: The moments of one entry: moment name -> tensor (float64).
Moments = dict[str, torch.Tensor]


class ServerOptimizer(FedAvg):
    """A strategy that steps the global model by the pseudo-gradient of FedAvg's
    average (module docstring). A subclass names its ``moments`` and writes `initial`
    and `move`. ``eta``: the server's learning rate.

    Raises:
        ConfigError: ``eta`` is not a finite number > 0.
    """

    #: the names of the state kept per entry
    moments: tuple[str, ...] = ()

    def __init__(self, eta: float) -> None:
        self.eta = _number("eta", eta, 0.0)
        if not self.eta > 0:
            raise ConfigError(f"eta must be a number > 0, got {eta!r}")
        self._state: dict[str, Moments] = {}
        self._staged: dict[str, Moments] | None = None

    def initial(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Moment ``name`` before the first round (zeros by default)."""
        return torch.zeros_like(like)

    def move(self, gradient: torch.Tensor, moments: Moments
             ) -> tuple[torch.Tensor, Moments]:
        """The step to subtract from the entry for pseudo-gradient ``gradient``, and the
        entry's new moments (float64; ``moments`` unchanged)."""
        raise NotImplementedError

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """``start`` minus the step for the round's pseudo-gradient (module docstring);
        the new moments staged for `installed`.

        Raises:
            TrainingError: as FedAvg's.
        """
        average = super().aggregate(start, states, weights)
        out: State = {}
        staged: dict[str, Moments] = {}
        for key, value in average.items():
            if not value.is_floating_point():
                out[key] = value
                continue
            x = start[key].detach().to(torch.float64)
            gradient = x - value.to(torch.float64)
            moments = self._state.get(key) or {
                name: self.initial(name, gradient) for name in self.moments}
            step, staged[key] = self.move(gradient, moments)
            out[key] = (x - step).to(value.dtype)
        self._staged = staged
        return out

    def installed(self) -> None:
        """Keep the moments of the aggregate returned last."""
        if self._staged is not None:
            self._state.update(self._staged)
            self._staged = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``<moment>/<entry>`` for every entry stepped so far."""
        return {f"{name}/{key}": tensor.clone() for key, moments in self._state.items()
                for name, tensor in moments.items()}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the moments `state_dict` gave.

        Raises:
            ConfigError: a name that is not ``<moment>/<entry>`` of this strategy.
        """
        state: dict[str, Moments] = {}
        for name, tensor in tensors.items():
            moment, _, key = name.partition("/")
            if moment not in self.moments or not key:
                raise ConfigError(f"{type(self).__name__} keeps no state {name!r}")
            state.setdefault(key, {})[moment] = tensor.to(torch.float64, copy=True)
        self._state, self._staged = state, None


class FedAvgM(ServerOptimizer):
    """FedAvg with server momentum (module docstring): ``eta`` (server learning rate),
    ``beta`` (server momentum, in [0, 1)).

    Raises:
        ConfigError: a value out of range.
    """

    moments = ("v",)

    def __init__(self, eta: float = 1.0, beta: float = 0.9) -> None:
        super().__init__(eta)
        self.beta = _number("beta", beta, 0.0, 1.0)

    def move(self, gradient: torch.Tensor, moments: Moments
             ) -> tuple[torch.Tensor, Moments]:
        """v = beta v + g; step eta v."""
        v = moments["v"] * self.beta + gradient
        return self.eta * v, {"v": v}


class _Adaptive(ServerOptimizer):
    """Reddi et al.'s adaptive server optimizers (module docstring): ``eta``, ``beta1``
    and ``beta2`` in [0, 1), ``tau`` > 0 (the adaptivity; v starts at tau^2)."""

    moments = ("m", "v")

    def __init__(self, eta: float = 0.01, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 1e-3) -> None:
        super().__init__(eta)
        self.beta1 = _number("beta1", beta1, 0.0, 1.0)
        self.beta2 = _number("beta2", beta2, 0.0, 1.0)
        self.tau = _number("tau", tau, 0.0)
        if not self.tau > 0:
            raise ConfigError(f"tau must be a number > 0, got {tau!r}")

    def initial(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """m_{-1} = 0, v_{-1} = tau^2."""
        return torch.full_like(like, self.tau ** 2) if name == "v" else torch.zeros_like(like)

    def second(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """v_t from v_{t-1} and Delta_t^2 (each optimizer's own rule)."""
        raise NotImplementedError

    def move(self, gradient: torch.Tensor, moments: Moments
             ) -> tuple[torch.Tensor, Moments]:
        """Algorithm 2 of Reddi et al. with Delta_t = -g_t: x - eta m_g / (sqrt(v) + tau)
        equals x + eta m_Delta / (sqrt(v) + tau)."""
        m = moments["m"] * self.beta1 + gradient * (1 - self.beta1)
        v = self.second(moments["v"], gradient.square())
        return self.eta * m / (v.sqrt() + self.tau), {"m": m, "v": v}


class FedAdagrad(_Adaptive):
    """FedAdagrad (module docstring): v_t = v_{t-1} + Delta_t^2 (``beta2`` unused).

    Raises:
        ConfigError: a value out of range.
    """

    def second(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """v + Delta^2."""
        return v + delta_sq


class FedYogi(_Adaptive):
    """FedYogi (module docstring): v_t = v_{t-1} - (1 - beta2) Delta_t^2
    sign(v_{t-1} - Delta_t^2).

    Raises:
        ConfigError: a value out of range.
    """

    def second(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """Yogi's additive rule."""
        return v - (1 - self.beta2) * delta_sq * torch.sign(v - delta_sq)


class FedAdam(_Adaptive):
    """FedAdam (module docstring): v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2.

    Raises:
        ConfigError: a value out of range.
    """

    def second(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """Adam's exponential average."""
        return self.beta2 * v + (1 - self.beta2) * delta_sq
