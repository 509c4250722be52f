"""What a star run's differential privacy has spent: DP-SGD's per device (each device's
steps, at its sampling rate B / n_k, aiopipe.runtime.dp_sgd) or central DP's per run
(the strategy's releases, aiopipe.strategies.central_dp), by Opacus's accountant
(aiopipe.runtime.privacy_accounting). The coordinator's `Star` keeps one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from aiopipe import models
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import DevicePlan
from aiopipe.runtime.privacy_accounting import PrivacySpent, StepLedger, private_units_refusal
from aiopipe.runtime.systems.star.options import star_options

__all__ = ["StarPrivacy"]

#: The checkpoint's entry of DP-SGD's ledger.
LEDGER_KEY = "privacy/steps"


class StarPrivacy:
    """A star run's privacy accounting (module docstring): ``strategy`` is the run's
    (its ``privacy_spent`` is central DP's, if it has one); with DP-SGD, ``model``'s
    units that devices may train are checked (`check_units`).

    Raises:
        ConfigError: see `check_units`.
    """

    def __init__(self, config: Any, strategy: object, model: torch.nn.Sequential) -> None:
        options = star_options(config)
        self.devices = config.devices
        self.strategy = strategy
        self.ledger = (StepLedger(options.dp_noise_multiplier, options.dp_delta)
                       if options.privacy == "dp-sgd" else None)
        if self.ledger is not None:
            check_units(model, device_units(config, models.unit_count(model)))

    def started(self, device: int, iterations: int, plan: DevicePlan, samples: int) -> None:
        """Device ``device`` is sent a round of ``iterations`` DP-SGD steps of ``plan``'s
        batch N B' out of its ``samples``."""
        if self.ledger is not None and samples > 0:
            rate = min(1.0, plan.parallel_batches * plan.micro_batch_size / samples)
            self.ledger.add(device, iterations, rate)

    def spent(self) -> PrivacySpent | None:
        """What has been spent so far (None: the run accounts no privacy).

        Raises:
            ConfigError: Opacus is not installed.
        """
        if self.ledger is not None:
            return self.ledger.spent(self.devices)
        central = getattr(self.strategy, "privacy_spent", None)
        if central is None:
            return None
        epsilon, delta = central()
        return PrivacySpent(epsilon, delta, {str(k): epsilon for k in range(self.devices)},
                            "device")

    def tensors(self) -> dict[str, torch.Tensor]:
        """DP-SGD's ledger for a checkpoint (central DP's is the strategy's state)."""
        return {} if self.ledger is None else {LEDGER_KEY: self.ledger.as_tensor()}

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Go on from a checkpoint's ledger."""
        if self.ledger is not None and LEDGER_KEY in tensors:
            self.ledger.load(tensors[LEDGER_KEY])


def device_units(config: Any, units: int) -> int:
    """The most units a device of the run may hold: all in fl, else the largest split
    point given, all but the last with "auto" (the planner may choose any)."""
    given = config.split_point
    points = given if isinstance(given, list | tuple) else [given]
    if config.mode == "fl":
        return units
    if any(not isinstance(p, int) for p in points):
        return units - 1
    return max(int(p) for p in points)


def check_units(model: torch.nn.Sequential, units: int) -> None:
    """DP-SGD's devices' units (the first ``units``) are ones Opacus takes per-sample
    gradients of: checked before any device trains (a device would fail its rounds).

    Raises:
        ConfigError: they hold a layer Opacus cannot train privately (batch norm mixes
            a batch's samples: use group or layer norm).
    """
    reason = private_units_refusal(models.split(model, units)[0])  # (options: Opacus is in)
    if reason:
        raise ConfigError(f'privacy "dp-sgd": Opacus cannot train the devices\' units '
                          f"1..{units} privately: {reason}")
