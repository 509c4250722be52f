"""Strategies: how the devices' updates of a round become the global model, as objects
behind a small protocol (`Strategy`), and the device-side hook a strategy may need
(`TrainHook`).

A run names its strategy as ``aggregation`` (fl, sfl, pipar; a table of the run's
system, ``[fl]``): a built-in name or ``module:Class``, a strategy of the user's own,
built with ``aggregation_options`` as keyword arguments ([Note: strategy options] in
aiopipe.strategies.loading). Built in: FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad
(server optimizers on the pseudo-gradient: aiopipe.strategies.server_optimizers),
FedMedian, TrimmedMean, Krum, MultiKrum, FedProx (aiopipe.strategies.builtin), DpFedAvg
(central differential privacy: aiopipe.strategies.central_dp). A run's
``train_hook`` (``module:factory``) adds to the devices' training
([Note: train hooks] in aiopipe.runtime.stage); FedProx's `ProximalHook` is one.
"""

from aiopipe.runtime.stage import TrainHook
from aiopipe.strategies.base import Settings, State, Stateless, Strategy, uploaded_aggregate
from aiopipe.strategies.builtin import FedAvg, FedMedian, FedProx, Krum, MultiKrum, TrimmedMean
from aiopipe.strategies.central_dp import DpFedAvg
from aiopipe.strategies.hooks import ProximalHook
from aiopipe.strategies.loading import (
    BUILT_IN_STRATEGIES,
    build_strategy,
    make_strategy,
    make_train_hook,
    strategy_class,
)
from aiopipe.strategies.server_optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
)

__all__ = [
    "BUILT_IN_STRATEGIES",
    "DpFedAvg",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedMedian",
    "FedProx",
    "FedYogi",
    "Krum",
    "MultiKrum",
    "ProximalHook",
    "ServerOptimizer",
    "Settings",
    "State",
    "Stateless",
    "Strategy",
    "TrainHook",
    "TrimmedMean",
    "build_strategy",
    "make_strategy",
    "make_train_hook",
    "strategy_class",
    "uploaded_aggregate",
]
