"""Assertions on a run's result: exact sample accounting, and weights equal to another
run's (an undisturbed one: `run_undisturbed`). Each raises `AssertionError` saying what
differs, so that pytest shows it as the test's failure.

[Note: what a plan trains] In the star modes (fl, sl, sfl, pipar) device k, holding S_k
samples with N_k micro-batches of floor(B / N_k) (N_k = 1 but in pipar), trains
I_k = floor(S_k / (floor(B / N_k) N_k)) iterations an epoch (aiopipe.runtime.plan
[Note: iterations per epoch]). An epoch's rounds are P iterations each (P =
``aggregation_every``, or the longest I_k when 0): round r (from 1) gives device k
min(P, I_k - (r - 1) P) iterations (none once it has trained them all). A device counts a
round's samples only if it took part (was sampled, with ``devices_per_round``) and
finished it; a round it lost counts nothing, and no round counts twice.

Epochs and rounds are numbered as a person reads them (`EpochMetrics.epoch`, the log):
from 1, a round by its place in its epoch (round 1 of epoch 1 is the run's first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.runtime.systems.registry import BUILT_IN, find_system
from aiopipe.runtime.systems.star.coordinator import Star
from aiopipe.testing.fleet import open_fleet

__all__ = ["assert_exact_accounting", "assert_same_weights", "expected_samples",
           "run_undisturbed"]

#: Per device, the rounds it lost: (epoch, round within the epoch) pairs, both from 1.
Lost = Mapping[int, Iterable[tuple[int, int]]]


def expected_samples(config: RunConfig, epoch: EpochMetrics, device_id: int, *,
                     lost: Iterable[int] = ()) -> int:
    """The samples device ``device_id`` counts in ``epoch`` if it finishes every round of
    it in which it takes part but the rounds ``lost`` (round numbers within the epoch,
    the first is 1) ([Note: what a plan trains]; its N from the epoch's ``plan``).

    Raises:
        ConfigError: not a star mode, or ``epoch``'s plan does not name the device.
    """
    _check_mode(config)
    rounds = _rounds(config, epoch)
    per_iteration, iterations = _plan(config, epoch)[device_id]
    period = _period(config, epoch)
    skipped = set(lost)
    return sum(max(0, min(period, iterations - (r - 1) * period)) * per_iteration
               for r, members in enumerate(rounds, start=1)
               if device_id in members and r not in skipped)


def assert_exact_accounting(result: RunResult, *, lost: Lost | None = None) -> None:
    """Assert that every sample of ``result`` counts once, and no other: in each epoch,
    ``samples`` is the sum of ``device_samples``, each device counts what its plan trains
    in the rounds it took part in, less the rounds it lost ([Note: what a plan
    trains]), and the devices in ``devices_lost`` are among those that lost one.

    Args:
        result: a run of a star mode (fl, sl, sfl, pipar) with a fixed plan per epoch
            (no ``replan`` switching N in an epoch).
        lost: per device, the rounds it lost, as (epoch, round within the epoch) pairs
            counted from 1 as `EpochMetrics.epoch` and the log count them, e.g.
            ``{2: [(1, 1)]}``: device 2 lost the first round of the first epoch. A round
            that began while the device was down (and so went on without it) counts as
            lost too. Absent: none.

    Raises:
        AssertionError: the accounting differs; the message lists every difference.
        ConfigError: not a star mode, or ``lost`` names a device or round the run has
            not.
    """
    config = result.config
    _check_mode(config)
    lost_rounds = _lost_by_epoch(config, result.epochs, lost or {})
    problems: list[str] = []
    for epoch in result.epochs:
        e = epoch.epoch  # from 1, as ``lost`` names it
        if len(epoch.device_samples) != config.devices:
            problems.append(f"epoch {e}: device_samples has {len(epoch.device_samples)} "
                            f"entries for {config.devices} devices")
            continue
        if epoch.samples != sum(epoch.device_samples):
            problems.append(f"epoch {e}: samples is {epoch.samples}, the devices' sum "
                            f"{sum(epoch.device_samples)} ({tuple(epoch.device_samples)})")
        for k, counted in enumerate(epoch.device_samples):
            rounds = sorted(lost_rounds.get((e, k), ()))
            want = expected_samples(config, epoch, k, lost=rounds)
            if counted != want:
                full = expected_samples(config, epoch, k)
                why = f", less round(s) {rounds} it lost" if rounds else ""
                problems.append(f"epoch {e}: device {k} counted {counted} samples, expected "
                                f"{want} (its plan trains {full} in its rounds{why})")
        unexpected = sorted(set(epoch.devices_lost) - {k for (x, k) in lost_rounds if x == e})
        if unexpected:
            problems.append(f"epoch {e}: devices_lost names {unexpected}, which were not "
                            "expected to lose a round")
    if problems:
        raise AssertionError("sample accounting differs:\n  " + "\n  ".join(problems))


def assert_same_weights(got: RunResult | nn.Module, want: RunResult | nn.Module, *,
                        atol: float = 0.0, rtol: float = 0.0) -> None:
    """Assert that two models (or two runs' final global models, ``RunResult.model``) hold
    the same tensors: bit for bit by default, else within ``atol + rtol * |want|``
    element by element (as `torch.isclose`).

    Raises:
        AssertionError: the keys, a shape or values differ; the message names each
            tensor that differs, how many of its values and by how much at most.
    """
    got_state = _state(got)
    want_state = _state(want)
    problems: list[str] = []
    if list(got_state) != list(want_state):
        only_got = sorted(set(got_state) - set(want_state))
        only_want = sorted(set(want_state) - set(got_state))
        problems.append(f"different tensors: only in the first {only_got}, only in the "
                        f"second {only_want}")
    for key in [k for k in want_state if k in got_state]:
        a, b = got_state[key], want_state[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(a.shape)} against {tuple(b.shape)}")
            continue
        if atol == 0 and rtol == 0:
            close = a == b
        else:
            close = torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol)
        if not bool(close.all()):
            diff = (a.double() - b.double()).abs()
            problems.append(f"{key}: {int((~close).sum())} of {a.numel()} values differ, by "
                            f"up to {float(diff.max()):.3g}")
    if problems:
        raise AssertionError("the weights differ:\n  " + "\n  ".join(problems))


async def run_undisturbed(config: RunConfig, **options: Any) -> RunResult:
    """``config`` run in a fleet of its own, with no fault: what a disturbed run in a
    fleet made with the same ``options`` (`open_fleet`'s) is compared with."""
    async with open_fleet(config, **options) as fleet:
        return await fleet.train()


def _state(model: RunResult | nn.Module) -> dict[str, torch.Tensor]:
    module = model.model if isinstance(model, RunResult) else model
    return {key: value.detach().cpu() for key, value in module.state_dict().items()}


def _check_mode(config: RunConfig) -> None:
    if find_system(config.mode) is not Star:
        modes = [mode for mode in BUILT_IN if find_system(mode) is Star]
        raise ConfigError(f"sample accounting knows the modes {', '.join(modes)}, "
                          f"not {config.mode}")


def _plan(config: RunConfig, epoch: EpochMetrics) -> dict[int, tuple[int, int]]:
    """Per device: (samples per iteration, iterations per epoch)."""
    plans: dict[int, tuple[int, int]] = {}
    for entry in epoch.plan:
        k = int(entry["device"])
        n = int(entry.get("parallel_batches", 1))  # (1 but in pipar)
        per_iteration = (config.batch_size // n) * n
        plans[k] = (per_iteration, config.device_samples_of(k) // per_iteration)
    missing = sorted(set(range(config.devices)) - set(plans))
    if missing:
        raise ConfigError(f"epoch {epoch.epoch}'s plan names no device {missing}")
    return plans


def _period(config: RunConfig, epoch: EpochMetrics) -> int:
    return config.aggregation_every or max(i for _, i in _plan(config, epoch).values())


def _rounds(config: RunConfig, epoch: EpochMetrics) -> list[tuple[int, ...]]:
    """Each round's devices: those sampled, or every device."""
    if config.devices_per_round:
        return [tuple(r) for r in epoch.sampled]
    longest = max(i for _, i in _plan(config, epoch).values())
    return [tuple(range(config.devices))] * math.ceil(longest / _period(config, epoch))


def _lost_by_epoch(config: RunConfig, epochs: Iterable[EpochMetrics],
                   lost: Lost) -> dict[tuple[int, int], set[int]]:
    """``lost`` as (epoch, device) -> rounds, checked against the run."""
    rounds = {e.epoch: len(_rounds(config, e)) for e in epochs}
    out: dict[tuple[int, int], set[int]] = {}
    for k, pairs in lost.items():
        if not 0 <= k < config.devices:
            raise ConfigError(f"lost names device {k}; the run has {config.devices}")
        for epoch, round_no in pairs:
            if not 1 <= round_no <= rounds.get(epoch, 0):
                raise ConfigError(f"lost names round {round_no} of epoch {epoch}, which the "
                                  "run has not (both count from 1)")
            out.setdefault((epoch, k), set()).add(round_no)
    return out
