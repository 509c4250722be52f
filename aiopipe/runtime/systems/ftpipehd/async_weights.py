"""A stage's weight versions in FTPipeHD's asynchronous pipeline (rules:
aiopipe/scheduler/async_pipeline.py).

`StageWeights` keeps what one stage needs of its history: the weights just after each
recent update (``W(j)``), for the forwards that vertical sync sends to an older version
and for aggregation; and a batch's stashed weights from its forward until its backward.
A forward computes with `torch.func.functional_call` on the version's tensors, so no
module is copied or reloaded; the backward runs the forward's own graph and applies SGD
(learning rate, momentum: torch's rule, dampening 0) to the base: the previous
version, or the aggregate of the last ``k`` versions when one is due.

A round's state travels whole: the coordinator sends each stage its weights and their
momentum buffers (named ``MOMENTUM`` + the parameter's name) and takes both back, so a
round that is replayed after a fault starts from exactly what its first attempt started
from, and parameters that move to another device keep their momentum.

Frozen parameters (``requires_grad`` false: a frozen base, the layers under adapters)
are no part of a version: a forward reads them from the module, no update steps them,
no momentum is kept for them, and neither a round's state nor a chain snapshot carries
them (every device holds them: [Note: frozen bases] in
aiopipe/runtime/systems/star/coordinator.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from aiopipe.errors import RemoteProtocolError
from aiopipe.models import without_frozen
from aiopipe.models.crossing import joined, leaves
from aiopipe.protocol import TensorData, state_to_wire
from aiopipe.runtime.factories import Loss, Metric
from aiopipe.runtime.momentum import MOMENTUM
from aiopipe.runtime.stage import (
    Sent,
    StageWork,
    Value,
    check_output,
    checked_gradient,
    input_gradients,
)
from aiopipe.scheduler.async_pipeline import aggregates_before, forward_weights, version_of

__all__ = ["AsyncStageWork", "ChainSnapshot", "StageWeights"]

class StageWeights:
    """Stage ``stage`` of ``stages``: its module, the versions it still needs, its
    stashes (module docstring).

    Args:
        module: the stage's units; its parameters are the initial weights (version 0).
        lr, momentum: SGD's.
        aggregate_every: m: aggregate every ``m × k`` updates (0: never).
    """

    def __init__(self, module: nn.Module, stages: int, stage: int, *, lr: float,
                 momentum: float = 0.0, aggregate_every: int = 1) -> None:
        self.module, self.stages, self.stage = module, stages, stage
        self.k = stages - stage
        self.lr, self.momentum, self.aggregate_every = lr, momentum, aggregate_every
        #: W(j): the trainable parameters just after update j (module docstring)
        self.versions: dict[int, dict[str, torch.Tensor]] = {-1: self._trainable()}
        self.applied = -1  # the last update applied
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        #: batch -> (its input's leaves, the weights its forward used, its output's leaves)
        self.stashes: dict[int, tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor],
                                      tuple[torch.Tensor, ...]]] = {}

    def restart(self) -> None:
        """The module's parameters are version 0 again (a new round: the pipeline was
        flushed); stashes are dropped, the momentum kept (until the round's own is loaded)."""
        self.versions = {-1: self._trainable()}
        self.applied = -1
        self.stashes.clear()

    def _trainable(self) -> dict[str, torch.Tensor]:
        """A copy of the module's trainable parameters (the frozen ones are no part of a
        version: module docstring)."""
        return {n: p.detach().clone() for n, p in self.module.named_parameters()
                if p.requires_grad}

    def version(self, update: int) -> int:
        """The paper's version number of ``W(update)``."""
        return version_of(self.stages, self.stage, update, self.aggregate_every)

    def forward(self, batch: int, inputs: Value) -> tuple[torch.Tensor, ...]:
        """Batch ``batch``'s forward with ``W(batch − n)`` (vertical sync); its input, the
        weights and the graph are stashed for its backward. Returns the output (in the
        graph: the last stage takes its loss from it).

        Raises:
            KeyError: that version is gone (the stage was driven out of order).
        """
        used = self.versions[forward_weights(self.stages, batch)]
        weights = {n: t.detach().requires_grad_(True) for n, t in used.items()}
        taken = tuple(t.detach().requires_grad_(self.stage > 0 and t.is_floating_point())
                      for t in leaves(inputs))
        output = leaves(functional_call(self.module, weights, (joined(taken),)))
        self.stashes[batch] = (taken, weights, output)
        return output

    def backward(self, batch: int, grad_output: tuple[torch.Tensor, ...] | None = None, *,
                 loss: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | None:
        """Batch ``batch``'s backward on its stashed weights (``loss`` at the last stage,
        else the gradients of the output's floating-point leaves, checked with
        `checked_gradient`), then its update: ``W(batch)``. Updates must come in batch
        order. Returns the gradients of the input's floating-point leaves (None at stage
        0), checked finite before the
        update is applied (so an input whose gradient is refused leaves the weights as
        they were).

        Raises:
            ValueError: an update out of order, or neither ``loss`` nor a gradient.
            RemoteProtocolError: the input's gradients are not finite.
        """
        if batch != self.applied + 1:
            raise ValueError(f"stage {self.stage}: update {batch} after {self.applied}")
        inputs, weights, output = self.stashes[batch]
        if loss is not None:
            outputs, given = [loss], None
        elif grad_output is not None:
            pairs = checked_gradient(grad_output, output)  # the stash kept if refused
            outputs, given = [o for o, _ in pairs], [g for _, g in pairs]
        else:
            raise ValueError("a backward needs the loss or the output's gradient")
        del self.stashes[batch]
        for t in inputs:
            t.grad = None
        targets = [*weights.values(), *(t for t in inputs if t.requires_grad)]
        if targets and any(o.requires_grad for o in outputs):  # (else all frozen)
            torch.autograd.backward(outputs, given, inputs=targets)
        grad_input = None
        if self.stage > 0:
            grad_input = input_gradients(inputs)
        self._apply(batch, {n: w.grad if w.grad is not None else torch.zeros_like(w)
                            for n, w in weights.items()})
        return grad_input

    def _apply(self, update: int, grads: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            base = self._base(update)
            new: dict[str, torch.Tensor] = {}
            for name, g in grads.items():
                if self.momentum:
                    buf = self.momentum_buffers.get(name)
                    buf = g.clone() if buf is None else buf.mul_(self.momentum).add_(g)
                    self.momentum_buffers[name] = buf
                    g = buf
                new[name] = base[name] - self.lr * g
        self.versions[update] = new
        self.applied = update
        self._prune()

    def _base(self, update: int) -> dict[str, torch.Tensor]:
        if not aggregates_before(self.stages, self.stage, update, self.aggregate_every):
            return self.versions[update - 1]
        recent = [self.versions[j] for j in range(update - self.k, update)]
        return {name: torch.stack([v[name] for v in recent]).mean(dim=0)
                for name in recent[0]}

    def _prune(self) -> None:
        # a forward still to come is of a batch after the last update, so it asks for
        # W(applied + 1 − n) or later; an aggregation for the last k <= n: keep those
        keep = forward_weights(self.stages, self.applied + 1)
        for j in [j for j in self.versions if j < keep]:
            del self.versions[j]

    def current(self) -> dict[str, Any]:
        """The latest weights, ``W(applied)`` (a copy)."""
        return {n: t.clone() for n, t in self.versions[self.applied].items()}


#: A stage's state after a round's first ``batches`` batches (FTPipeHD's chain
#: replication): (batches, its state dict and momentum on the wire, loss_sum, correct).
ChainSnapshot = tuple[int, dict[str, TensorData], float, float]


class AsyncStageWork(StageWork):
    """A stage of FTPipeHD's asynchronous pipeline as the stage executor drives it: a round
    (``global_replication_every`` batches) is one iteration whose micro-batches are its
    whole batches (the 1F1B action list with ``k_p = S − p``), each backward applies its own update
    through `StageWeights`, and the closing STEP writes the latest weights into the
    module (what the round returns). Inputs are checked as in `StageWork`.

    [Note: chain snapshots] Every ``chain_every`` batches of a round but its last, the
    stage snapshots its state as it would be had the round ended there: the weights
    just after that batch's update, their momentum, and the module's buffers (batch
    norm's running statistics) as that batch's forward left them: the forwards of later
    batches, already run by then, are not in it. Played again from there, a round
    computes exactly what the rounds it would split into compute (the device sends the
    snapshots on: `take_snapshots`).

    Args:
        module, first, last, num_classes, loss, metric: as `StageWork`'s.
        stages, stage: the pipeline's length and this stage's place.
        lr, momentum, aggregate_every: as `StageWeights`'.
        chain_every: batches between chain snapshots (0: none).
    """

    def __init__(self, module: nn.Sequential, *, first: bool, last: bool, num_classes: int,
                 loss: Loss, metric: Metric | None, stages: int, stage: int, lr: float,
                 momentum: float, aggregate_every: int, chain_every: int = 0) -> None:
        optimizer = torch.optim.SGD(module.parameters(), lr=lr)  # unused: StageWeights steps
        super().__init__(module, optimizer, first=first, last=last, parallel_batches=1,
                         num_classes=num_classes, loss=loss, metric=metric)
        self.weights = StageWeights(module, stages, stage, lr=lr, momentum=momentum,
                                    aggregate_every=aggregate_every)
        self._losses: dict[int, torch.Tensor] = {}
        self.chain_every = chain_every
        self._round_batches = 0
        #: a chain point's buffers, from its forward until its update
        self._buffers_at: dict[int, dict[str, torch.Tensor]] = {}
        self._snapshots: list[ChainSnapshot] = []

    def clear(self) -> None:
        """A new round: the module's weights, just loaded, are version 0 again (the
        momentum buffers come with the round: `load_momentum`)."""
        self.weights.restart()
        self._losses.clear()
        self._buffers_at.clear()
        self._snapshots.clear()

    def plan_snapshots(self, batches: int) -> None:
        """The round has ``batches`` batches: snapshot after every ``chain_every`` of them
        but the last (the round's end returns the state anyway)."""
        self._round_batches = batches

    def _chain_point(self, batch: int) -> bool:
        done = batch + 1
        return self.chain_every > 0 and done % self.chain_every == 0 and (
            done < self._round_batches)

    def take_snapshots(self) -> list[ChainSnapshot]:
        """The chain snapshots made since the last call ([Note: chain snapshots])."""
        taken, self._snapshots = self._snapshots, []
        return taken

    def _snapshot(self, batch: int) -> None:
        weights = self.weights.versions[batch]
        buffers = self._buffers_at.pop(batch)
        state = {name: (weights[name] if name in weights else buffers[name])
                 for name in without_frozen(self.module.state_dict(), self.module)}
        state = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
        for name, buf in self.weights.momentum_buffers.items():
            state[MOMENTUM + name] = buf.detach().to("cpu", copy=True)
        self._snapshots.append((batch + 1, state_to_wire(state), float(self.loss_sum),
                                float(self.correct)))

    def load_momentum(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """The round's momentum buffers (by parameter name; copies are kept).

        Raises:
            RemoteProtocolError: they are not this stage's parameters' buffers.
        """
        params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        if self.weights.momentum and set(buffers) != set(params):
            raise RemoteProtocolError("a round's momentum buffers are not its stage's "
                                      "parameters'")
        for name, buf in buffers.items():
            if buf.shape != params[name].shape:
                raise RemoteProtocolError(f"momentum buffer {name} is {tuple(buf.shape)}, "
                                          f"its parameter {tuple(params[name].shape)}")
        self.weights.momentum_buffers = {n: b.to(params[n].device, copy=True)
                                         for n, b in buffers.items()}

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The stage's state dict less its frozen parameters, and its momentum buffers
        (module docstring)."""
        state = without_frozen(super().trained_state(), self.module)
        for name, buf in self.weights.momentum_buffers.items():
            state[MOMENTUM + name] = buf.detach().to("cpu", copy=True)
        return state

    def forward(self, iteration: int, micro_batch: int, received: Sent | None = None
                ) -> Sent | None:
        """Batch ``micro_batch``'s forward with the weights vertical sync gives it.

        Raises:
            RemoteProtocolError: a received input fails [Note: hostile inputs].
        """
        x, labels, inputs = self._inputs((iteration, micro_batch), received)
        out = self.weights.forward(micro_batch, x)
        if not self.last:
            check_output(out, inputs)
        if self._chain_point(micro_batch):
            self._buffers_at[micro_batch] = {n: b.detach().clone()
                                             for n, b in self.module.named_buffers()}
        self.peak_live = max(self.peak_live, len(self.weights.stashes))
        if self.last:
            self._losses[micro_batch] = self._loss(joined(out), labels)
            return None
        return tuple(o.detach().cpu() for o in out), labels.cpu()

    def backward(self, iteration: int, micro_batch: int,
                 gradient: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, ...] | None:
        """Batch ``micro_batch``'s backward on its stashed weights and its update; the
        gradient of the input to send back (None on the first stage).

        Raises:
            RemoteProtocolError: the gradient is not finite, or does not fit the output.
        """
        if self.last:
            grad_input = self.weights.backward(micro_batch, loss=self._losses.pop(micro_batch))
        elif gradient is None:
            raise ValueError("a backward before the last stage needs a gradient")
        else:
            grad_input = self.weights.backward(
                micro_batch, tuple(g.to(self.device) for g in gradient))
        if self._chain_point(micro_batch):
            self._snapshot(micro_batch)
        return grad_input

    def step(self) -> None:
        """The round is over (every update applied): the module takes the latest weights."""
        with torch.no_grad():
            params = dict(self.module.named_parameters())
            for name, value in self.weights.versions[self.weights.applied].items():
                params[name].copy_(value)
