"""A run's strategy and train hook, from its config: a built-in name or the user's own
``module:Class`` (aiopipe.entrypoints), with the constructor's keyword arguments.

[Note: strategy options] A strategy's options are its constructor's keyword arguments,
given as the star systems' ``aggregation_options`` table (``[fl]`` ... ``aggregation =
"fedadam"``, ``aggregation_options = {eta = 0.03, tau = 0.01}``; ``--aggregation-options
eta=0.03,tau=0.01``), the same for a built-in strategy and for a user's. Two come from
the run where the constructor takes them and the table does not name them: ``trim``
(``trim_fraction``) and ``byzantine`` (``byzantine_devices``). An argument the
constructor does not take, or a value it refuses, is one `ConfigError` line when the
config is checked (the class is loaded and built once there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from aiopipe.entrypoints import is_entry_point, load_entry_point
from aiopipe.errors import AiopipeError, ConfigError
from aiopipe.runtime.stage import TrainHook
from aiopipe.strategies.base import Strategy
from aiopipe.strategies.builtin import FedAvg, FedMedian, FedProx, Krum, MultiKrum, TrimmedMean
from aiopipe.strategies.central_dp import DpFedAvg
from aiopipe.strategies.server_optimizers import FedAdagrad, FedAdam, FedAvgM, FedYogi

__all__ = ["BUILT_IN_STRATEGIES", "build_strategy", "make_strategy", "make_train_hook",
           "strategy_class"]

#: The built-in strategies by ``aggregation`` name (aiopipe.config_values.AGGREGATIONS).
BUILT_IN_STRATEGIES: dict[str, type[Any]] = {
    "fedavg": FedAvg, "fedmedian": FedMedian, "trimmed-mean": TrimmedMean, "krum": Krum,
    "multi-krum": MultiKrum, "fedavgm": FedAvgM, "fedadam": FedAdam, "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad, "fedprox": FedProx, "dp-fedavg": DpFedAvg,
}


def strategy_class(aggregation: str) -> Callable[..., Any]:
    """The class (or factory) ``aggregation`` names.

    Raises:
        ConfigError: neither a built-in name nor a loadable ``module:Class``.
    """
    found = BUILT_IN_STRATEGIES.get(aggregation)
    if found is not None:
        return found
    if not is_entry_point(aggregation):
        raise ConfigError(f"config key 'aggregation': got {aggregation!r}, expected one of "
                          f"{', '.join(BUILT_IN_STRATEGIES)} or module:Class")
    try:
        return load_entry_point(aggregation, what="aggregation")
    except ConfigError as exc:
        raise ConfigError(f"config key 'aggregation': {exc}") from None


def build_strategy(aggregation: str, options: Mapping[str, Any], *, trim: float = 0.2,
                   byzantine: int = 1, run: Mapping[str, Any] | None = None) -> Strategy:
    """The strategy ``aggregation`` names, built with ``options`` ([Note: strategy
    options]); ``run``: more of the run's values, each passed where the constructor
    declares it and ``options`` does not name it (``seed``, ``population``,
    ``per_round``, ``delta``: central DP's, aiopipe.strategies.central_dp).

    Raises:
        ConfigError: it cannot be loaded or built, or it is not a `Strategy`.
    """
    cls = strategy_class(aggregation)
    arguments = dict(options)
    try:
        declared = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        declared = {}  # type: ignore[assignment]
    for name, value in (("trim", trim), ("byzantine", byzantine), *(run or {}).items()):
        if name in declared and name not in arguments:
            arguments[name] = value
    try:
        strategy = cls(**arguments)
    except AiopipeError as exc:
        raise ConfigError(f"config key 'aggregation_options': {aggregation}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"config key 'aggregation_options': {aggregation}"
                          f"({', '.join(f'{k}={v!r}' for k, v in arguments.items())}) "
                          f"failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(strategy, Strategy):
        missing = [name for name in ("configure_round", "aggregate", "installed",
                                     "state_dict", "load_state_dict")
                   if not callable(getattr(strategy, name, None))]
        raise ConfigError(f"config key 'aggregation': {aggregation} is not a strategy "
                          f"(it lacks {', '.join(missing)}; subclass "
                          "aiopipe.strategies.FedAvg or Stateless)")
    return strategy


def make_strategy(config: Any) -> Strategy:
    """The run's strategy (a star run's ``aggregation`` and ``aggregation_options``).

    Raises:
        ConfigError: see `build_strategy`.
    """
    options = config.options
    run = {"seed": config.seed, "population": config.devices,
           "per_round": config.round_size(config.devices),
           "delta": getattr(options, "dp_delta", 1e-5)}
    return build_strategy(getattr(options, "aggregation", "fedavg"),
                          getattr(options, "aggregation_options", {}),
                          trim=getattr(options, "trim_fraction", 0.2),
                          byzantine=config.byzantine_devices, run=run)


def make_train_hook(config: Any) -> TrainHook | None:
    """The run's train hook: ``train_hook``'s factory called with no arguments, else the
    one its strategy's class declares (``train_hook``, built with ``mu`` from FedProx's
    options), else None.

    Raises:
        ConfigError: the factory cannot be loaded or called, or what it returns is no
            hook (no ``loss`` and ``before_step``).
    """
    spec = config.train_hook
    arguments: dict[str, Any] = {}
    if not spec:
        options = config.options
        aggregation = getattr(options, "aggregation", "fedavg")
        spec = getattr(strategy_class(aggregation), "train_hook", "")
        if not spec:
            return None
        if aggregation == "fedprox" and "mu" in getattr(options, "aggregation_options", {}):
            arguments["mu"] = options.aggregation_options["mu"]
    factory = load_entry_point(spec, what="train_hook")
    try:
        hook = factory(**arguments)
    except AiopipeError:
        raise
    except Exception as exc:
        raise ConfigError(f"train_hook {spec!r} failed: {type(exc).__name__}: {exc}"
                          ) from None
    if not (callable(getattr(hook, "loss", None)) and callable(getattr(hook, "before_step",
                                                                       None))):
        raise ConfigError(f"train_hook {spec!r} returned {type(hook).__name__}, which has "
                          "no loss(work, loss) and before_step(work)")
    return hook  # type: ignore[no-any-return]
