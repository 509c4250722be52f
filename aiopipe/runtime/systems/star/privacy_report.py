"""What a star run's differential privacy has spent: DP-SGD's per device (each device's
steps, at its sampling rate B / n_k, aiopipe.runtime.dp_sgd) or central DP's per run
(the strategy's releases, aiopipe.strategies.central_dp), by Opacus's accountant
(aiopipe.runtime.privacy_accounting). The coordinator's `Star` keeps one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aiopipe import models
from aiopipe.errors import ConfigError
from aiopipe.runtime.plan import DevicePlan
from aiopipe.runtime.privacy_accounting import PrivacySpent, StepLedger
from aiopipe.runtime.systems.star.options import star_options

__all__ = ["StarPrivacy"]

#: The checkpoint's entry of DP-SGD's ledger.
LEDGER_KEY = "privacy/steps"


class StarPrivacy:
    """A star run's privacy accounting (module docstring): ``strategy`` is the run's
    (its ``privacy_spent`` is central DP's, if it has one)."""

    def __init__(self, config: Any, strategy: object) -> None:
        options = star_options(config)
        self.devices = config.devices
        self.strategy = strategy
        self.ledger = (StepLedger(options.dp_noise_multiplier, options.dp_delta)
                       if options.privacy == "dp-sgd" else None)

    def check_units(self, model: torch.nn.Sequential, plans: Sequence[DevicePlan]) -> None:
        """With DP-SGD, the devices' units are ones Opacus takes per-sample gradients
        of (checked here, before any device trains: a device would fail its rounds).

        Raises:
            ConfigError: a device's units hold a layer Opacus cannot train privately
                (batch norm mixes a batch's samples: use group or layer norm).
        """
        if self.ledger is None:
            return
        from opacus.validators import ModuleValidator  # (the options checked it is there)

        for split_point in sorted({plan.split_point for plan in plans}):
            problems = ModuleValidator.validate(models.split(model, split_point)[0],
                                                strict=False)
            if problems:
                reason = _first_sentence(problems[0])
                raise ConfigError(f'privacy "dp-sgd": Opacus cannot train the devices\' '
                                  f"units 1..{split_point} privately: {reason}")

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


def _first_sentence(problem: object) -> str:
    """Opacus's reason, to its first sentence (its messages run to a paragraph)."""
    return str(problem).split(". ")[0].rstrip(".")
