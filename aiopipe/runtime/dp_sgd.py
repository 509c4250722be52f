"""DP-SGD on a device's units (Abadi et al. 2016, "Deep Learning with Differential
Privacy", Algorithm 1), with Opacus's per-sample gradients: ``privacy = "dp-sgd"`` in
fl, sl, sfl and pipar.

Theory of operation. `DpSgdWork` is the device's `StageWork` with Opacus's
``GradSampleHooks`` on its units: every backward, whether from the stage's own loss (fl)
or from the activation gradient the server sent (sl, sfl, pipar), leaves each
parameter's per-sample gradients in ``grad_sample``. Right after each micro-batch's
backward (in the compute thread) the stage turns them into per-sample gradients of each
sample's loss, g_i, clips each to the norm C over all the stage's trainable parameters
together, g_i * min(1, C / (||g_i|| + 1e-6)) (Opacus's DPOptimizer's factor), and adds
them to a sum; the non-private ``.grad`` autograd accumulated is dropped. At the step:

    grad = (sum_i clip(g_i) + N(0, (sigma C)^2 I)) / B

B the iteration's batch (N micro-batches of B'), as Opacus's DPOptimizer with
``expected_batch_size = B``; then the run's train hook (FedProx's term: it reads no
data) and the optimizer's step.

Scale. The last stage backpropagates a micro-batch's mean loss divided by N
(aiopipe.runtime.stage), so the hooks, run with ``loss_reduction = "sum"``, give
grad(l_i) / (B' N); the stage multiplies by B' N, the rows of the micro-batch times N.
A train hook whose ``loss`` returns something else than the loss it is given would break
that scale (FedProx's does not: it works on the gradients, after the noise).

Virtual time charges the run's cost table: the per-sample gradients' extra compute
(Opacus's hooks, the clipping) is not in it.

[Note: micro-batches and Opacus's stack] Opacus keeps each layer's forward inputs on a
stack and pairs a backward with the latest forward (one batch, forward then backward).
PiPar forwards N micro-batches before the first backward, so `DpSgdWork` takes each
micro-batch's inputs off the layers after its forward and puts them back, with Opacus's
forward counters, just before its backward; each backward therefore sees its own
micro-batch. The stage never recomputes forwards ([Note: recomputed activations]): a
forward again would stack inputs twice.

Noise is drawn from `aiopipe.runtime.privacy.round_generator` (run seed, device, round)
at `DpSgdWork.begin_round`: a run is reproducible. Accounting: each step is a sampled
Gaussian mechanism of multiplier sigma and rate B / n (n the device's samples): the
coordinator gives each device's steps to the accountant (aiopipe.runtime.
privacy_accounting; [Note: sampling assumed by the accountant]).

What DP-SGD protects: the device's units' updates, which it uploads. Outside this
guarantee: the activations and labels a device sends each micro-batch (sl, sfl, pipar)
and the server half trained on them; the round's loss and correct count the device
reports, and its held-out accuracy, sent as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aiopipe.errors import ConfigError
from aiopipe.models.crossing import Value, joined, leaves
from aiopipe.runtime.privacy import round_generator
from aiopipe.runtime.privacy_accounting import private_units_refusal, require_opacus
from aiopipe.runtime.stage import Sent, StageWork

__all__ = ["DpSgdWork", "clip_factors"]

#: Opacus's DPOptimizer's guard against a zero norm.
_EPS = 1e-6


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Per sample, what its gradient is multiplied by: min(1, C / (norm + 1e-6))."""
    return (max_norm / (norms + _EPS)).clamp(max=1.0)


class DpSgdWork(StageWork):
    """A stage trained by DP-SGD (module docstring): ``noise_multiplier`` sigma,
    ``max_grad_norm`` C; the rest as `StageWork`.

    Raises:
        ConfigError: Opacus is not installed, or the units hold a layer Opacus cannot
            take per-sample gradients of (batch norm mixes a batch's samples: use group
            or layer norm).
    """

    def __init__(self, module: nn.Sequential, optimizer: torch.optim.Optimizer, *,
                 noise_multiplier: float, max_grad_norm: float, seed: int, device_id: int,
                 **kwargs: Any) -> None:
        super().__init__(module, optimizer, **kwargs)
        require_opacus('privacy "dp-sgd"')
        from opacus.grad_sample import GradSampleHooks

        reason = private_units_refusal(module)
        if reason:
            raise ConfigError(f'privacy "dp-sgd": Opacus cannot train these units '
                              f"privately: {reason}")
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.seed, self.device_id = seed, device_id
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction="sum",
                                      strict=True)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._stash: dict[tuple[int, int], list[tuple[nn.Module, list[Any]]]] = {}
        self._sum: list[torch.Tensor] | None = None
        self._generator = round_generator(seed, device_id, 0)
        #: the iteration's batch B (the step's divisor)
        self.batch_size = 1
        #: steps taken since the stage was built, and per-sample gradients clipped
        self.steps = 0
        self.clipped = 0

    @property
    def recompute(self) -> bool:
        """Never ([Note: micro-batches and Opacus's stack])."""
        return False

    @recompute.setter
    def recompute(self, value: bool) -> None:
        """Ignored: a forward again would stack Opacus's inputs twice."""

    def begin_round(self, round_no: int, batch_size: int) -> None:
        """A round begins: its noise's generator, the iteration's batch B."""
        self._generator = round_generator(self.seed, self.device_id, round_no)
        self.batch_size = batch_size
        self._sum = None

    def clear(self) -> None:
        """Forget the micro-batches in flight and the sum of clipped gradients too."""
        super().clear()
        self._stash.clear()
        self._sum = None
        for module in self.module.modules():
            if hasattr(module, "activations"):
                setattr(module, "activations", [])  # noqa: B010 (Opacus's attribute)
        for p in self._params:  # (a backward stopped midway leaves Opacus's state)
            setattr(p, "grad_sample", None)  # noqa: B010
            setattr(p, "_forward_counter", 0)  # noqa: B010
            if hasattr(p, "_current_grad_sample"):
                delattr(p, "_current_grad_sample")

    def _inputs(self, key: tuple[int, int], received: Sent | None
                ) -> tuple[Value, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """`StageWork`'s inputs; the first stage's floating ones as leaves that require
        grad: Opacus's full backward hooks on the first layer then see an input gradient
        (torch warns of a hook without one), which costs one input-sized gradient."""
        x, labels, inputs = super()._inputs(key, received)
        if self.first:
            x = joined([t.detach().requires_grad_() if t.is_floating_point() else t
                        for t in leaves(x)])
        return x, labels, inputs

    def forward(self, iteration: int, micro_batch: int, received: Sent | None = None
                ) -> Sent | None:
        """`StageWork.forward`, then the layers' stacked inputs kept aside for this
        micro-batch's backward ([Note: micro-batches and Opacus's stack])."""
        out = super().forward(iteration, micro_batch, received)
        kept = []
        for module in self.module.modules():
            stacked = getattr(module, "activations", None)
            if stacked:
                kept.append((module, list(stacked)))
                stacked.clear()
                _count_forwards(module, -len(kept[-1][1]))
        self._stash[(iteration, micro_batch)] = kept
        return out

    def backward(self, iteration: int, micro_batch: int,
                 gradient: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, ...] | None:
        """`StageWork.backward` with the micro-batch's inputs back on the layers; then its
        per-sample gradients clipped and summed (module docstring)."""
        for module, stacked in self._stash.pop((iteration, micro_batch), []):
            setattr(module, "activations", stacked)  # noqa: B010 (Opacus's attribute)
            _count_forwards(module, len(stacked))
        result = super().backward(iteration, micro_batch, gradient)
        self._clip_and_add()
        return result

    def _clip_and_add(self) -> None:
        samples = [getattr(p, "grad_sample", None) for p in self._params]
        for p in self._params:
            p.grad = None  # autograd's (non-private) sum is not used
            setattr(p, "grad_sample", None)  # noqa: B010 (Opacus's attribute)
        rows = next((s.shape[0] for s in samples if isinstance(s, torch.Tensor)), 0)
        if not rows:  # nothing trainable was reached
            return
        scale = float(rows * self.parallel_batches)
        per_sample = [s.reshape(rows, -1) * scale if isinstance(s, torch.Tensor)
                      else torch.zeros(rows, p.numel(), device=p.device)
                      for s, p in zip(samples, self._params, strict=True)]
        norms = torch.cat(per_sample, dim=1).norm(dim=1)
        factors = clip_factors(norms, self.max_grad_norm)
        self.clipped += int((factors < 1).sum())
        sums = [(factors @ g).reshape(p.shape)
                for g, p in zip(per_sample, self._params, strict=True)]
        if self._sum is None:
            self._sum = sums
        else:
            for total, more in zip(self._sum, sums, strict=True):
                total.add_(more)

    def step(self) -> None:
        """The noised mean of the clipped gradients as each parameter's ``.grad``, then
        `StageWork.step` (the train hook, the optimizer)."""
        sums = self._sum or [torch.zeros_like(p) for p in self._params]
        sigma = self.noise_multiplier * self.max_grad_norm
        with torch.no_grad():
            for p, total in zip(self._params, sums, strict=True):
                noise = torch.randn(p.shape, generator=self._generator, dtype=total.dtype)
                p.grad = (total + sigma * noise.to(total.device)) / self.batch_size
        self._sum = None
        self.steps += 1
        super().step()


def _count_forwards(module: nn.Module, change: int) -> None:
    """Move Opacus's per-parameter count of forwards awaiting their backward."""
    for p in module.parameters():
        if p.requires_grad:
            setattr(p, "_forward_counter",  # noqa: B010 (Opacus's attribute)
                    getattr(p, "_forward_counter", 0) + change)
