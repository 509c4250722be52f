"""The star systems' plans (PiPar §IV-B..D): each device's split point P and
micro-batch count N, resolved from the config or chosen by the planner
(`aiopipe.scheduler.select_plans`) when they are "auto", and the resolved (P, N, B')
per device ([Note: iterations per epoch] in aiopipe.runtime.plan)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import DevicePlan, declared_devices, model_profile
from aiopipe.runtime.sampling import sampled_devices
from aiopipe.runtime.systems.star.options import AutoOptions, server_lanes_of
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile

__all__ = ["candidate_parallel_batches", "choose_plans", "choose_system", "device_plans",
           "first_plans", "micro_batch_sizes", "needs_planner", "profile_key", "resolve_auto",
           "system_config", "with_plans"]


def device_plans(config: RunConfig, units: int, samples: list[int]) -> list[DevicePlan]:
    """Resolve (P, N, B') and iterations per epoch for every device.

    ``units`` is the model's number of split units Q, ``samples[k]`` device k's sample
    count. "auto" values must have been resolved by the planner before this is called.

    Raises:
        ConfigError: a split point outside 1..Q-1, N > B, or a device with too few samples
            for one iteration.
    """
    plans = []
    for k in range(config.devices):
        p_value = config.device_split_point(k)
        n_value = config.device_parallel_batches(k)
        if config.mode == "fl":
            p, n = units, 1
        else:
            if not isinstance(p_value, int):
                raise ConfigError('split_point "auto" must be resolved by the planner first')
            if not 1 <= p_value < units:
                raise ConfigError(f"config key 'split_point': got {p_value} for device {k}, "
                                  f"expected 1..{units - 1} (the model has {units} units)")
            p = p_value
            if config.mode == "pipar":
                if not isinstance(n_value, int):
                    raise ConfigError('parallel_batches "auto" must be resolved by the '
                                      "planner first")
                n = n_value
            else:
                n = 1
        if n > config.batch_size:
            raise ConfigError(f"config key 'parallel_batches': got {n} for device {k}, "
                              f"expected at most batch_size ({config.batch_size})")
        micro = config.batch_size // n
        iterations = samples[k] // (micro * n)
        if iterations < 1:
            raise ConfigError(f"device {k} holds {samples[k]} samples, fewer than one "
                              f"iteration ({micro * n}); raise samples_per_device")
        plans.append(DevicePlan(k, p, n, micro, iterations))
    return plans


def needs_planner(config: RunConfig) -> bool:
    """Whether the config asks for "auto" P or N in a mode that uses them, or for the
    system itself (mode auto)."""
    if config.mode == "auto":
        return True
    if config.mode == "fl":
        return False
    return config.split_point == "auto" or (
        config.mode == "pipar" and config.parallel_batches == "auto")


def choose_plans(config: RunConfig, profile: ModelProfile,
                 devices: list[DeviceProfile], *, speed_band: float | None = None,
                 members: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The planner's (P_k, N_k) for an "auto" ``config`` (see `resolve_auto`);
    ``speed_band`` as `select_plans` takes it (None: its default). ``members``: the
    devices ``devices`` profiles, in order, when not the whole fleet (the devices of a
    sampled round, [Note: plans per round] in aiopipe.runtime.systems.star).

    Candidates: every split point 1..Q-1 for "auto" P, else the configured ones; for
    "auto" N the divisors of B, else the configured ones (N = 1 outside pipar); each
    device's ``device_memory_mb`` budget applies.

    Raises:
        ConfigError: no plan fits (e.g. a device with fewer samples than one iteration,
            or a memory budget no plan meets).
    """
    from aiopipe.scheduler import select_plans
    from aiopipe.scheduler.select import SPEED_BAND

    fleet = range(config.devices) if members is None else members
    split_points = (list(range(1, profile.units)) if config.split_point == "auto"
                    else sorted({int(config.device_split_point(k)) for k in fleet}))
    return select_plans(profile, devices, config.batch_size, split_points=split_points,
                        parallel_batches=candidate_parallel_batches(config),
                        memory_budget_bytes=[config.device_memory_bytes_of(k)
                                             for k in fleet],
                        aggregation_every=config.aggregation_every,
                        speed_band=SPEED_BAND if speed_band is None else speed_band)


def with_plans(config: RunConfig, chosen: list[tuple[int, int]]) -> RunConfig:
    """``config`` with per-device split points (and, in pipar, micro-batch counts)."""
    return config.replace(split_point=tuple(p for p, _ in chosen),
                          parallel_batches=tuple(n for _, n in chosen)
                          if config.mode == "pipar" else config.parallel_batches)


def resolve_auto(config: RunConfig, model: nn.Sequential, in_shape: tuple[int, ...],
                 samples: list[int], costs: CostTable) -> RunConfig:
    """Replace "auto" split points / micro-batch counts with the planner's choice.

    The planner (`aiopipe.scheduler.select_plans`) minimizes the fleet's estimated epoch
    time from ``costs`` (server-side seconds per unit; a device's compute is modelled as
    that times its ``device_slowdown``), the network preset's bandwidths and the model's
    activation and state sizes. "auto" N is chosen among the divisors of B.

    Raises:
        ConfigError: no plan fits (e.g. a device with fewer samples than one iteration).
    """
    profile = model_profile(model, in_shape, costs, server_lanes=server_lanes_of(config))
    return with_plans(config, choose_plans(config, profile, declared_devices(config, samples)))


def candidate_parallel_batches(config: RunConfig) -> list[int]:
    """The micro-batch counts N the run may use: PiPar's configured ones, or for
    "auto" the divisors of B (every micro-batch has B/N samples and an epoch sees every
    sample; mode auto, for its pipar candidate); 1 in fl, sl and sfl."""
    if config.mode not in ("pipar", "auto"):
        return [1]
    if config.parallel_batches == "auto" or config.mode == "auto":
        return [n for n in range(1, config.batch_size + 1) if config.batch_size % n == 0]
    value = config.parallel_batches
    return sorted(set(value)) if isinstance(value, tuple) else [int(value)]


def micro_batch_sizes(config: RunConfig) -> list[int]:
    """Batch sizes to measure costs at: B' = B/N for every N the planner may pick."""
    return sorted({config.batch_size // n for n in candidate_parallel_batches(config)})


def choose_system(config: RunConfig, profile: ModelProfile, devices: Sequence[DeviceProfile]
                  ) -> tuple[RunConfig, list[tuple[int, int]], str, str]:
    """Mode auto's choice ([Note: choosing the system] in aiopipe.scheduler.auto): the run
    config of the fastest candidate (its plans left "auto", for the planner between
    rounds), the plans the estimate chose for the whole fleet (the planner's own), the
    one-line reason, and the table of every candidate.

    Raises:
        ConfigError: no candidate fits the fleet.
    """
    from aiopipe.scheduler.auto import choose_system as fastest
    from aiopipe.scheduler.auto import estimate_systems, explain, summary

    options = config.options_as(AutoOptions)
    estimates = estimate_systems(
        profile, devices, config.batch_size, modes=options.candidates,
        memory_budget_bytes=[config.device_memory_bytes_of(k) for k in range(config.devices)],
        aggregation_every=config.aggregation_every)
    chosen = fastest(estimates)
    return (system_config(config, chosen.mode), list(chosen.plans),
            summary(estimates, chosen), explain(estimates, chosen))


def system_config(auto: RunConfig, mode: str) -> RunConfig:
    """Mode auto's ``auto`` config as the run config of candidate ``mode``: the star's
    options kept, the plans left "auto" (for the planner between rounds)."""
    from aiopipe.runtime.systems.registry import options_of

    values = options_of(mode).values
    options = auto.options_as(AutoOptions)
    kept = {f.name: getattr(options, f.name) for f in dataclasses.fields(values)}
    return auto.replace(mode=mode, options=values(**kept), split_point="auto",
                        parallel_batches="auto" if mode == "pipar" else 1)


def first_plans(config: RunConfig, profile: ModelProfile,
                live: Sequence[DeviceProfile]) -> list[tuple[int, int]]:
    """The plans before the first round: the whole fleet's; sampled per round, those
    of the first round's likely draw (all alive), each other device taking the plan
    of a drawn device with its profile, else the first drawn device's ([Note: plans
    per round] in aiopipe.runtime.systems.star.coordinator)."""
    if not config.devices_per_round:
        return choose_plans(config, profile, list(live))
    drawn = sampled_devices(config.seed, 0, 0, range(config.devices),
                            config.round_size(config.devices))
    plans = choose_plans(config, profile, [live[k] for k in drawn], members=drawn)
    chosen = dict(zip(drawn, plans, strict=True))
    by_profile = {profile_key(live[k]): plan for k, plan in chosen.items()}
    return [chosen.get(k) or by_profile.get(profile_key(device), plans[0])
            for k, device in enumerate(live)]


def profile_key(device: DeviceProfile) -> tuple[object, ...]:
    """What makes two devices' profiles alike for the planner (its table by identity:
    a `CostTable` does not hash)."""
    return device.slowdown, device.uplink, device.downlink, device.samples, id(device.costs)

