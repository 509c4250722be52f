"""(epsilon, delta) of a run's differential privacy, from Opacus's RDP accountant.

A run's private steps are sampled Gaussian mechanisms: DP-SGD's device steps (noise
multiplier sigma, a device's batch of B of its n samples: rate q = B / n) and central
DP's rounds (noise multiplier z, a round's m of the N devices: rate q = m / N, 1 when
every device trains every round). Their composition is what an accountant bounds;
nothing here computes a bound itself: `epsilon` hands the history of (noise multiplier,
sampling rate, steps) to ``opacus.accountants.RDPAccountant`` (Mironov et al. 2019,
"Renyi Differential Privacy of the Sampled Gaussian Mechanism", with Opacus's orders
and its conversion to (epsilon, delta)), so the figure a run reports is the one a user
gets by calling the accountant with the same history (``tests/runtime/
test_runtime_dp.py``).

[Note: sampling assumed by the accountant] The RDP analysis of the sampled Gaussian
mechanism assumes Poisson sampling (each sample, or device, in a step independently
with probability q). aiopipe's devices read fixed-size batches of a shuffled epoch
order, and its rounds draw a fixed number of devices without replacement
(aiopipe.runtime.sampling). The figure is therefore the Poisson-sampling accountant's
for q = B / n (or m / N), the approximation Opacus, TensorFlow Privacy and TFF report
for shuffled batches; it is not a proof for the shuffling the loader does.

Opacus is the optional extra ``aiopipe[dp]``; it is imported when a figure is asked for,
so a run without differential privacy never loads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from aiopipe.errors import ConfigError

__all__ = ["PrivacySpent", "Step", "StepLedger", "epsilon", "private_units_refusal",
           "require_opacus"]

#: (noise multiplier, sampling rate, steps): ``steps`` sampled Gaussian mechanisms.
Step = tuple[float, float, int]


def require_opacus(what: str) -> None:
    """Import Opacus, or refuse ``what`` in one line.

    Raises:
        ConfigError: Opacus is not installed (``pip install 'aiopipe[dp]'``).
    """
    try:
        import opacus  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs Opacus: pip install 'aiopipe[dp]'") from None


def private_units_refusal(module: torch.nn.Module) -> str:
    """Why Opacus cannot take per-sample gradients of ``module``'s layers ("" when it
    can), in one sentence (batch norm mixes a batch's samples: group or layer norm
    do not). Needs Opacus (`require_opacus`)."""
    from opacus.validators import ModuleValidator

    problems = ModuleValidator.validate(module, strict=False)
    # (Opacus's messages run to a paragraph: its first sentence)
    return str(problems[0]).split(". ")[0].rstrip(".") if problems else ""


def epsilon(history: Sequence[Step], delta: float) -> float:
    """The epsilon of the composition of ``history`` at ``delta``, by Opacus's RDP
    accountant (0.0 for no steps; inf where the accountant finds no finite bound).

    Raises:
        ConfigError: Opacus is not installed, or a step is out of range (noise
            multiplier <= 0, rate outside (0, 1], negative steps), or delta outside (0, 1).
    """
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")
    kept: list[Step] = []
    for sigma, rate, steps in history:
        if not (sigma > 0 and math.isfinite(sigma)) or not 0 < rate <= 1 or steps < 0:
            raise ConfigError(f"a private step needs noise multiplier > 0, a sampling rate "
                              f"in (0, 1] and steps >= 0, got ({sigma!r}, {rate!r}, "
                              f"{steps!r})")
        if steps:
            kept.append((float(sigma), float(rate), int(steps)))
    if not kept:
        return 0.0
    require_opacus("differential privacy's accounting")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = kept
    return float(accountant.get_epsilon(delta))


@dataclass(frozen=True, slots=True)
class PrivacySpent:
    """What a run's differential privacy has spent so far: the run's (epsilon, delta)
    and each device's epsilon (keys: device ids as strings), neighbouring datasets
    differing by one ``unit``: "sample" (DP-SGD: one of a device's samples; the run's
    epsilon is the largest device's) or "device" (central DP: one device's whole data;
    every device's epsilon is the run's)."""

    epsilon: float
    delta: float
    device_epsilon: Mapping[str, float]
    unit: str


class StepLedger:
    """The DP-SGD steps each device has been given (every iteration of every round it
    was sent, completed or not: a round lost midway is counted whole, an upper bound
    on what it took), at its sampling rate B / n, for noise multiplier ``sigma``."""

    def __init__(self, sigma: float, delta: float) -> None:
        self.sigma, self.delta = sigma, delta
        #: per device: sampling rate -> steps
        self.steps: dict[int, dict[float, int]] = {}

    def add(self, device: int, steps: int, rate: float) -> None:
        """Device ``device`` is sent ``steps`` steps at sampling rate ``rate``."""
        if steps:
            by_rate = self.steps.setdefault(device, {})
            by_rate[rate] = by_rate.get(rate, 0) + steps

    def spent(self, devices: int) -> PrivacySpent:
        """Each of ``devices``' epsilon (0 for one never sent a step) and the largest.

        Raises:
            ConfigError: Opacus is not installed.
        """
        each = {str(k): epsilon([(self.sigma, rate, n) for rate, n in
                                 sorted(self.steps.get(k, {}).items())], self.delta)
                for k in range(devices)}
        return PrivacySpent(max(each.values(), default=0.0), self.delta, each, "sample")

    def as_tensor(self) -> torch.Tensor:
        """The ledger as rows (device, rate, steps), for a checkpoint."""
        rows = [(float(k), rate, float(n)) for k, by_rate in sorted(self.steps.items())
                for rate, n in sorted(by_rate.items())]
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)

    def load(self, rows: torch.Tensor) -> None:
        """Take back what `as_tensor` gave (a resumed run goes on counting)."""
        self.steps = {}
        for device, rate, steps in rows.tolist():
            self.add(int(device), int(steps), float(rate))
