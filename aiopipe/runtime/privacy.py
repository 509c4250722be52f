"""Differential privacy on the devices (PiPar §5.6.2): what a device adds noise to
before anything leaves it, in the star modes (fl, sl, sfl, pipar).

- **classic** (Abadi et al., as the paper applies it): Gaussian noise of standard
  deviation ``privacy_noise`` on every floating-point tensor of the device's model half
  before it is uploaded at a round's end (so the server never sees the trained weights
  as they are; FL uploads the whole model, so it adds the most noise);
- **pixeldp** (Lecuyer et al.): a noise layer before the device's first layer: Gaussian
  noise of standard deviation ``privacy_noise`` on every training input, so the
  activations sent cannot be turned back into the raw data. Applied in training only;
  the server evaluates the global model on clean inputs (a choice: PixelDP also noises
  predictions, for certified robustness, which is not what the paper uses it for).

The noise is drawn from a generator seeded by (run seed, device, round): a round played
again draws the same noise, and runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from aiopipe.models.crossing import Value, joined, leaves

__all__ = ["noisy_batch", "noisy_inputs", "noisy_state", "round_generator"]


def round_generator(seed: int, device_id: int, round_no: int) -> torch.Generator:
    """The noise of device ``device_id`` in round ``round_no`` (CPU generator)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + device_id) * 1_000_003
                                         + round_no)


def noisy_state(state: Mapping[str, torch.Tensor], sigma: float,
                generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``state`` with Gaussian noise of standard deviation ``sigma`` on every
    floating-point tensor (integer buffers as they are), in the state's order."""
    out = {}
    for name, value in state.items():
        if value.is_floating_point():
            noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            value = value + sigma * noise.to(value.device)
        out[name] = value
    return out


def noisy_inputs(x: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """PixelDP's noise layer: ``x`` plus Gaussian noise of standard deviation
    ``sigma``."""
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
    return x + sigma * noise.to(x.device)


def noisy_batch(batch: Callable[[int, int], tuple[Value, torch.Tensor]],
                sigma: float, generator: torch.Generator, iteration: int, n: int
                ) -> tuple[Value, torch.Tensor]:
    """Micro-batch n of ``iteration`` as ``batch`` loads it, through PixelDP's noise
    layer on each floating-point input (bind the first three with
    ``functools.partial``: a stage's ``batch``)."""
    x, labels = batch(iteration, n)
    return joined([noisy_inputs(t, sigma, generator) if t.is_floating_point() else t
                   for t in leaves(x)]), labels
