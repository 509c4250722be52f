"""The options of fl, sl, sfl and PiPar: how a round's device models become the global
model (robust aggregation, outliers), the devices' differential privacy, sampling per
round, re-planning, and the server's concurrent passes (sfl and pipar, which hold a
server replica per device). Light: a config's checks load it."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiopipe.config_values import (
    AGGREGATIONS,
    LOCAL_OPTIMIZERS,
    OUTLIERS,
    PRIVACY_METHODS,
    above,
    fail,
)
from aiopipe.entrypoints import is_entry_point
from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.registry import SystemOptions

__all__ = ["AUTO", "AUTO_CANDIDATES", "FL", "PIPAR", "SECURE_AGGREGATIONS", "SFL", "SL",
           "AutoOptions", "ReplicaOptions", "StarOptions", "devices_to_trim", "server_lanes_of",
           "star_options", "untrimmed_warning"]


@dataclass(frozen=True, slots=True)
class StarOptions:
    """The options of fl and sl (and, with `ReplicaOptions`, of sfl and pipar).

    Attributes:
        aggregation: how a round's device models become the global model: "fedavg"
            (weighted by samples, PiPar Eq. 3), or a robust one that bounds what a few
            devices can do: "fedmedian" (coordinate-wise median), "trimmed-mean"
            (dropping ``trim_fraction`` of the highest and of the lowest values per
            coordinate), "krum" (the model nearest its neighbours, for at most
            ``byzantine_devices`` bad devices; needs devices >= that + 3), "multi-krum"
            (the mean of the m best-scored by Krum), server optimizers on the round's
            pseudo-gradient ("fedavgm", "fedadam", "fedyogi", "fedadagrad"), "fedprox"
            (FedAvg, with the proximal term on the devices), "dp-fedavg" (central
            differential privacy: aiopipe.strategies.central_dp), or ``module:Class``:
            a strategy of the user's own (aiopipe.strategies).
        aggregation_options: the strategy's constructor's keyword arguments
            ([Note: strategy options] in aiopipe.strategies.loading).
        trim_fraction: see ``aggregation``. A trimmed mean that would trim nothing from
            a whole round (floor(trim_fraction x devices a round) = 0) is refused with
            the number of devices it needs.
        outliers: what to do with a device whose update (its whole model, its server
            replica included, minus the round's starting model) is more than
            ``outlier_limit`` times the round's median update norm: "keep", "clip"
            (scaled down to the median's norm: it moves the aggregate no further than a
            typical device, in its own direction) or "drop" (left out of the
            aggregation); clipped or dropped devices are named in the log and in
            ``EpochMetrics.updates_refused``.
        outlier_limit: see ``outliers``.
        privacy: differential privacy on the devices (PiPar §5.6.2): "none", "classic"
            (Gaussian noise on the device's model half before it is uploaded) or
            "pixeldp" (a noise layer before the device's first layer: Gaussian noise on
            every training input), aiopipe.runtime.privacy; or "dp-sgd" (the device's
            units trained by DP-SGD through Opacus, with an accountant's epsilon per
            device: aiopipe.runtime.dp_sgd). Central DP at the server is an
            aggregation, "dp-fedavg" (aiopipe.strategies.central_dp).
        privacy_noise: the noise's standard deviation (weights' units for classic,
            inputs' for pixeldp: synthetic and normalised data have unit variance).
        dp_noise_multiplier: DP-SGD's sigma: the noise's standard deviation over the
            clipping norm.
        dp_max_grad_norm: DP-SGD's clipping norm C of each sample's gradient.
        dp_delta: the delta at which the run's epsilon is reported (DP-SGD's and
            dp-fedavg's).
        replan: with "auto" split points or micro-batch counts, re-estimate at every
            round boundary from live measurements (each device's compute and link
            speeds) and switch plans when the estimate improves enough. Off by default:
            on really shaped links between processes (bench/shaped.py, vgg5) every
            switch was estimated to help and made the epochs longer (docs/systems/pipar.md).
        replan_threshold: the relative improvement of the estimated remaining time a
            new plan needs before the coordinator switches to it (0.1 = 10%).
        secure_aggregation: fl, sfl and pipar: the devices' uploads are summed by
            SecAgg+ (aiopipe.secagg; needs the extra ``aiopipe[secagg]``): the server
            learns only the sum of the devices' weighted halves, devices lost
            mid-protocol are recovered up to a threshold. Only for rules that need the
            average alone (`SECURE_AGGREGATIONS`), with ``outliers = "keep"``.
        secure_aggregation_clip: the bound on a device's weighted value per coordinate
            (its weight, samples over the round's most, times the parameter; the
            fixed-point encoding's range): larger values are clipped. The sum's error
            per coordinate is at most n / (2 scale), with scale = ((2^31 - 1) / n - 1) /
            clip for n devices (aiopipe.secagg.fixed_point).
        local_optimizer: what a device's optimizer (and, in sfl and pipar, its server
            replica's) starts each round from: "fresh", nothing (textbook FedAvg, as
            Flower's and the papers': SGD's momentum starts at zero every round), or
            "kept", the state the device's last round left, held between its rounds as
            the optimizer's state alone ([Note: a round's local optimizer] in
            aiopipe.runtime.systems.star.keeping). Between its rounds a device holds no
            model; with "kept", its momentum.
    """

    aggregation: str = "fedavg"
    aggregation_options: Mapping[str, Any] = field(default_factory=dict)
    trim_fraction: float = 0.2
    outliers: str = "keep"
    outlier_limit: float = 10.0
    privacy: str = "none"
    privacy_noise: float = 0.01
    dp_noise_multiplier: float = 1.0
    dp_max_grad_norm: float = 1.0
    dp_delta: float = 1e-5
    replan: bool = False
    replan_threshold: float = 0.1
    secure_aggregation: bool = False
    secure_aggregation_clip: float = 100.0
    local_optimizer: str = "fresh"


@dataclass(frozen=True, slots=True)
class ReplicaOptions(StarOptions):
    """The options of sfl and pipar, whose server holds a replica per device: the star's
    and the server's concurrent passes.

    Attributes:
        server_lanes: passes of different devices' server replicas the server runs at
            once (PiPar §3.2.3 Fig. 3c): its compute threads, for a server with that
            many cores or a GPU; 1 runs every pass in turn. The planner plans with it
            ([Note: server lanes]); each device's own passes stay in order.
    """

    server_lanes: int = 1

#: What every star mode takes.
_KEYS = {
    "aggregation": "how device models are combined: fedavg (default), fedmedian, "
                   "trimmed-mean, krum, multi-krum (these bound what a few bad devices can "
                   "do), fedavgm, fedadam, fedyogi, fedadagrad (a server optimizer on the "
                   "round's pseudo-gradient), fedprox (FedAvg with a proximal term on the "
                   "devices), dp-fedavg (central differential privacy: clipped updates, "
                   "noised sum, epsilon accounted) or module:Class, a strategy of your own",
    "aggregation_options": "the strategy's keyword arguments, as key=value,key=value "
                           "(fedadam: eta=0.01,beta1=0.9,beta2=0.99,tau=0.001; fedavgm: "
                           "eta=1,beta=0.9; fedprox: mu=0.01; multi-krum: keep=m; dp-fedavg: "
                           "noise_multiplier=1,clip=1,clipping=fixed|adaptive)",
    "trim_fraction": "trimmed-mean: the fraction of models trimmed at each end",
    "outliers": "a device update far above the round's median: keep (default), clip or "
                "drop it",
    "outlier_limit": "how many times the round's median update norm is an outlier",
    "privacy": "differential privacy on the devices: classic (noise on the uploaded model "
               "half), pixeldp (noise on every training input) or dp-sgd (per-sample "
               "clipping and noise through Opacus, with epsilon accounted)",
    "privacy_noise": "the privacy noise's standard deviation (classic, pixeldp)",
    "dp_noise_multiplier": "dp-sgd: the noise's standard deviation over the clipping norm",
    "dp_max_grad_norm": "dp-sgd: the clipping norm of each sample's gradient",
    "dp_delta": "the delta at which epsilon is reported (dp-sgd, dp-fedavg)",
    "replan": 'with "auto" plans, re-plan between rounds from live measurements '
              "(experimental: off by default)",
    "replan_threshold": "re-plan when the estimated epoch would be this fraction shorter",
    "secure_aggregation": "fl, sfl, pipar: sum the devices' uploads by SecAgg+, so that the "
                          "server learns only their sum (FedAvg and server optimizers on "
                          "the average; needs aiopipe[secagg])",
    "secure_aggregation_clip": "secure aggregation: the bound on a weighted value per "
                               "coordinate (fixed-point range; larger values are clipped)",
    "local_optimizer": "what a device's optimizer starts each round from: fresh (default: "
                       "textbook FedAvg, momentum from zero) or kept (the state its last "
                       "round left, held between its rounds)",
}
#: What the modes that hold a server replica per device add.
_REPLICA_KEYS = {
    "server_lanes": "server passes of different devices' replicas run at once (threads; "
                    "for a server with that many cores or a GPU)",
}


def check(config: Any) -> None:
    """The star's options: known aggregation, outliers and privacy methods, a trimmed
    mean that trims, server lanes >= 1."""
    options = config.options_as(StarOptions)
    set_ = object.__setattr__
    if options.aggregation not in AGGREGATIONS and not is_entry_point(options.aggregation):
        raise fail("aggregation", options.aggregation,
                   f"one of {', '.join(AGGREGATIONS)} or module:Class")
    _check_dp(config, options)  # (dp_delta first: the strategy is built with it)
    _check_strategy(config, options)
    trim = options.trim_fraction
    if isinstance(trim, bool) or not isinstance(trim, int | float) or not 0 <= trim < 0.5:
        raise fail("trim_fraction", trim, "a number in [0, 0.5)")
    set_(options, "trim_fraction", float(trim))
    if (options.aggregation in ("krum", "multi-krum")
            and config.devices < config.byzantine_devices + 3):
        raise fail("byzantine_devices", config.byzantine_devices,
                   f"at most devices - 3 ({config.devices - 3}) for "
                   f"{options.aggregation}")
    if options.outliers not in OUTLIERS:
        raise fail("outliers", options.outliers, f"one of {', '.join(OUTLIERS)}")
    set_(options, "outlier_limit", above("outlier_limit", options.outlier_limit, 1))
    if options.privacy not in PRIVACY_METHODS:
        raise fail("privacy", options.privacy, f"one of {', '.join(PRIVACY_METHODS)}")
    if options.local_optimizer not in LOCAL_OPTIMIZERS:
        raise fail("local_optimizer", options.local_optimizer,
                   f"one of {', '.join(LOCAL_OPTIMIZERS)}")
    set_(options, "privacy_noise", above("privacy_noise", options.privacy_noise, 0))
    if not isinstance(options.replan, bool):
        raise fail("replan", options.replan, "true or false")
    threshold = options.replan_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not (
        math.isfinite(threshold) and 0 <= threshold < 1
    ):
        raise fail("replan_threshold", threshold, "a number in [0, 1)")
    set_(options, "replan_threshold", float(threshold))
    if isinstance(options, ReplicaOptions):
        lanes = options.server_lanes
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise fail("server_lanes", lanes, "an int >= 1")
    _check_trim(config, options)
    _check_secure(config, options)


#: The aggregations that need only the devices' weighted average (FedAvg, and server
#: optimizers stepping on the round's mean pseudo-gradient), which secure aggregation
#: serves; the others need each device's update.
SECURE_AGGREGATIONS = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")


def _check_secure(config: Any, options: StarOptions) -> None:
    """Secure aggregation is a bool, its clip a finite number > 0; refused with the
    reason where the run cannot use it."""
    if not isinstance(options.secure_aggregation, bool):
        raise fail("secure_aggregation", options.secure_aggregation, "true or false")
    clip = options.secure_aggregation_clip
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not (
            math.isfinite(clip) and clip > 0):
        raise fail("secure_aggregation_clip", clip, "a finite number > 0")
    object.__setattr__(options, "secure_aggregation_clip", float(clip))
    if not options.secure_aggregation:
        return
    why = ""
    if config.mode == "sl":
        why = "sl aggregates nothing: each device starts from the last one's weights"
    elif options.aggregation not in SECURE_AGGREGATIONS:
        why = (f'aggregation "{options.aggregation}" needs each device\'s update; secure '
               f"aggregation gives the server only their sum (it serves "
               f"{', '.join(SECURE_AGGREGATIONS)})")
    elif options.outliers != "keep":
        why = (f'outliers "{options.outliers}" needs each device\'s update norm; secure '
               "aggregation gives the server only their sum")
    elif config.round_size(config.devices) < 2:
        why = "a sum of one device's update is that update: it needs 2 devices a round"
    elif importlib.util.find_spec("cryptography") is None:
        why = "it needs the cryptography package: pip install 'aiopipe[secagg]'"
    if why:
        raise ConfigError(f"config key 'secure_aggregation': refused: {why}")


def _check_dp(config: Any, options: StarOptions) -> None:
    """DP-SGD's and central DP's values, and what they cannot be combined with."""
    set_ = object.__setattr__
    for key in ("dp_noise_multiplier", "dp_max_grad_norm"):
        set_(options, key, above(key, getattr(options, key), 0))
    delta = options.dp_delta
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 < delta < 1:
        raise fail("dp_delta", delta, "a number in (0, 1)")
    set_(options, "dp_delta", float(delta))
    central = options.aggregation == "dp-fedavg"
    if options.privacy == "dp-sgd":
        from aiopipe.runtime.privacy_accounting import require_opacus

        require_opacus('privacy "dp-sgd"')
        if central:
            raise fail("privacy", "dp-sgd", 'one of DP-SGD and aggregation "dp-fedavg" '
                       "(a run reports one guarantee: per sample of a device, or per "
                       "device)")
    if not central:
        return
    if config.mode == "sl":
        raise fail("aggregation", "dp-fedavg", "an aggregation of sl's (sl averages "
                   "nothing: each device starts from the last one's weights)")
    if options.outliers != "keep":
        raise fail("outliers", options.outliers, '"keep" with aggregation "dp-fedavg" '
                   "(it clips every update itself; screening by the round's median norm "
                   "would make one device's update decide about another's)")


def _check_strategy(config: Any, options: StarOptions) -> None:
    """``aggregation_options`` is a table; a strategy that is not plain FedAvg is built
    once, so that a bad ``module:Class`` or argument is refused now, in one line
    (torch loads only then)."""
    given = options.aggregation_options
    if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
        raise fail("aggregation_options", given, "a table of the strategy's keyword "
                   "arguments")
    object.__setattr__(options, "aggregation_options", dict(given))
    if options.aggregation == "fedavg" and not given:
        return
    from aiopipe.strategies.loading import make_strategy  # torch-bound: only when needed

    make_strategy(config)


def star_options(config: Any) -> StarOptions:
    """A star run's options; the star's defaults for a system of a user's that reuses
    the star's halves with options of its own."""
    options = config.options
    return options if isinstance(options, StarOptions) else StarOptions()


def server_lanes_of(config: Any) -> int:
    """The server's concurrent passes in a star run (1 where it holds no replicas)."""
    options = config.options
    return options.server_lanes if isinstance(options, ReplicaOptions) else 1


def untrimmed_warning(config: Any, n: int) -> str:
    """What to warn of when a trimmed mean of ``n`` models trims nothing ("" when it
    trims, or is not the run's aggregation): the config refuses that for a whole round,
    a round that lost devices can still."""
    options = star_options(config)
    trim = options.trim_fraction
    if options.aggregation != "trimmed-mean" or math.floor(trim * n) > 0:
        return ""
    return (f"a round of {n} update{'s' if n != 1 else ''}: the trimmed mean trims nothing "
            f"(floor({trim:g} x {n}) = 0; it needs {devices_to_trim(trim)})")


def devices_to_trim(trim: float) -> int:
    """The fewest models of which a trimmed mean with fraction ``trim`` (in (0, 0.5))
    drops one at each end: the least n with floor(trim x n) >= 1. 0 for a ``trim`` of 0
    (no count of models is trimmed)."""
    if not trim > 0:
        return 0
    n = max(1, math.ceil(1 / trim) - 1)
    while math.floor(trim * n) < 1:  # (1 / trim may round either way)
        n += 1
    return n


def _check_trim(config: Any, options: StarOptions) -> None:
    """A trimmed mean must trim something from a whole fleet's round (a round that
    lost devices and trims nothing is warned about: `Star`)."""
    if options.aggregation != "trimmed-mean":
        return
    trim, size = options.trim_fraction, config.round_size(config.devices)
    need = devices_to_trim(trim)
    if not need:
        raise fail("trim_fraction", trim, "a fraction > 0 with aggregation "
                   "\"trimmed-mean\" (0 trims nothing: that is an unweighted mean)")
    if size < need:
        least = math.ceil(1000 / size) / 1000  # shown as is: floor(least x size) >= 1
        fits = (f", or trim_fraction >= {least:g}" if size >= 3
                else " (a trimmed mean needs at least 3)")
        raise fail("trim_fraction", trim, f"at least {need} devices a round to trim "
                   f"any (floor({trim:g} x {size}) = 0: nothing would be trimmed){fits}")


#: Why the other systems' runs keep them at their defaults.
_ELSEWHERE = {
    "privacy": "it is for fl, sl, sfl and pipar",
    "dp_noise_multiplier": "DP-SGD is for fl, sl, sfl and pipar",
    "dp_max_grad_norm": "DP-SGD is for fl, sl, sfl and pipar",
    "dp_delta": "DP-SGD and dp-fedavg are for fl, sl, sfl and pipar",
    "server_lanes": "the server runs one replica per device only in sfl and pipar",
    "secure_aggregation": "it sums device uploads for FedAvg in fl, sfl and pipar; this "
                          "mode has no such sum",
    "secure_aggregation_clip": "it is for fl, sfl and pipar with secure_aggregation",
}

FL = SystemOptions(StarOptions, _KEYS, check, elsewhere=_ELSEWHERE, samples_devices=True,
                   runs_train_hook=True)
SL = SystemOptions(StarOptions, _KEYS, check, elsewhere=_ELSEWHERE, samples_devices=True,
                   runs_train_hook=True)
SFL = SystemOptions(ReplicaOptions, {**_KEYS, **_REPLICA_KEYS}, check, elsewhere=_ELSEWHERE,
                    samples_devices=True, runs_train_hook=True)
PIPAR = SystemOptions(ReplicaOptions, {**_KEYS, **_REPLICA_KEYS}, check,
                      elsewhere=_ELSEWHERE, samples_devices=True, runs_train_hook=True)


#: The systems ``mode = "auto"`` may choose (aiopipe.scheduler.auto.STAR_MODES).
AUTO_CANDIDATES = ("fl", "sfl", "pipar")


@dataclass(frozen=True, slots=True)
class AutoOptions(ReplicaOptions):
    """The options of ``mode = "auto"``: the star's, which the chosen system runs with,
    and the candidates.

    Attributes:
        candidates: the systems to choose among ([Note: choosing the system] in
            aiopipe.scheduler.auto), a non-empty subset of `AUTO_CANDIDATES`.
        rechoose: after the first round, try each other system that may be faster for
            a round (close ones one more round each), and run on with the fastest as
            measured ([Note:
            re-choosing the system] in aiopipe.runtime.systems.star.rechoose).
    """

    candidates: tuple[str, ...] = AUTO_CANDIDATES
    rechoose: bool = True


def _check_auto(config: Any) -> None:
    """The star's options, and candidates among `AUTO_CANDIDATES`."""
    check(config)
    options = config.options_as(AutoOptions)
    given = options.candidates
    if (isinstance(given, str) or not isinstance(given, list | tuple) or not given
            or any(c not in AUTO_CANDIDATES for c in given)):
        raise fail("candidates", given, f"a non-empty list of {', '.join(AUTO_CANDIDATES)}")
    object.__setattr__(options, "candidates", tuple(dict.fromkeys(given)))
    if not isinstance(options.rechoose, bool):
        raise fail("rechoose", options.rechoose, "true or false")


AUTO = SystemOptions(AutoOptions, {**_KEYS, **_REPLICA_KEYS, "candidates": (
    'mode auto: the systems it chooses among by their predicted epoch (default: fl, sfl, '
    'pipar)'), "rechoose": (
    "mode auto: after the first round, try each other system the round's speeds predict "
    "may be faster for a round (systems measured within a fifth of the fastest: one more "
    "round each), and run on with the fastest as measured (default: true)")},
    _check_auto, elsewhere={
        **_ELSEWHERE, "candidates": "it is mode auto's", "rechoose": "it is mode auto's"},
    samples_devices=True, runs_train_hook=True)
