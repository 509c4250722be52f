"""The torch side of one stage: its units, its optimizer, and what flows in and out.

A `StageWork` computes; it never sends. Each method runs in the node's compute thread
(`aiopipe.runtime.compute.Compute`) and returns what the stage executor must send on:
a forward returns the activation (and labels) for the next stage, a backward the
gradient with respect to the stage's input for the previous one (STYLE item 3: compute
returns transfers, the executor moves bytes).

Positions: the first stage (0) reads its micro-batches from local data; a later stage
takes its input from the activation it received. The last stage computes the loss (the
run's loss, by default the micro-batch's mean cross-entropy, divided by N, so that N
accumulated micro-batch gradients are the gradient of the whole batch's mean loss:
PiPar Eq. 26; a member of a data-parallel group that computes a ``fraction`` of each
micro-batch's rows multiplies that by the fraction, so that the group's gradients summed
are the whole micro-batch's) and counts the round's loss and correct predictions. A
stage that is both (a whole model: FL) does both.

[Note: recomputed activations] A stage before the last keeps each micro-batch's
autograd graph from its forward until its gradient comes back: for a device of vgg5 at
P = 2 with N = 2, 6.5 MiB, and in a simulation of a thousand devices all training at
once, 6.5 GB. With ``recompute`` (set by a device that is charged virtual time: the
wall time it costs is not the simulation's) the stage keeps only the micro-batch's input
and the generator's state, drops the graph once the activation is out, and forwards the
micro-batch again, with the same state, when its gradient arrives. CPU kernels are
deterministic, so the output and the gradients are the first forward's bit for bit (a
test compares whole runs). Not for a module with buffers (`recomputable`: batch norm
would count the micro-batch twice), nor where memory is measured (Asteroid's budgets),
nor on a GPU.

Inputs from another node are checked before they touch the weights ([Note: hostile
inputs]): labels in range, finite values, a finite loss, finite outputs of a middle
stage (before they are sent on) and finite gradients; what fails raises
`StageInputError` (a `RemoteProtocolError` that says which neighbour's input it was:
the device names that neighbour to the coordinator, aiopipe.runtime.judge), and the
stage's gradients from that pass are dropped. A middle stage checks its own output
because a value out of range for the model overflows there: sent on, the NaN would be
the next stage's evidence against this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from aiopipe.errors import RemoteProtocolError
from aiopipe.models.crossing import Value, joined, leaves
from aiopipe.protocol import TensorData, to_torch
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.factories import Loss, Metric, accuracy, cross_entropy, scored
from aiopipe.runtime.judge import all_finite
from aiopipe.runtime.memory import saved_bytes, state_bytes
from aiopipe.scheduler.actions import Action

__all__ = ["Batch", "Expected", "Sent", "ServerStage", "StageInputError", "StageWork",
           "TrainHook", "Value", "check_output", "check_tensors", "checked_gradient", "expected_of",
           "input_gradients", "recomputable"]


class StageInputError(RemoteProtocolError):
    """What a neighbouring stage sent cannot be computed with ([Note: hostile inputs]):
    the previous stage's activation or labels (``from_next`` false), or the next stage's
    gradient (true). The device names that neighbour (`NeighbourFaultError`)."""

    def __init__(self, message: str, *, from_next: bool = False) -> None:
        super().__init__(message)
        self.from_next = from_next

    def __reduce__(self) -> tuple[Any, ...]:
        return _stage_input_error, (str(self), self.from_next)


def _stage_input_error(message: str, from_next: bool) -> StageInputError:
    return StageInputError(message, from_next=from_next)


#: A stage's tensors as they must be: name -> (dtype name, shape).
Expected = Mapping[str, tuple[str, tuple[int, ...]]]

#: Reads micro-batch ``n`` of iteration ``i``: inputs and labels (the first stage's data).
Batch = Callable[[int, int], tuple[Value, torch.Tensor]]

#: What a stage sends on: the leaves of its output and the labels.
Sent = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(slots=True)
class _Saved:
    """What a micro-batch's backward needs, kept from its forward."""

    #: the stage's output leaves, or the loss on the last stage (None: recomputed from
    #: ``x``)
    output: tuple[torch.Tensor, ...] | None
    #: the received activation's leaves (the floating ones require grad), later stages
    inputs: tuple[torch.Tensor, ...] | None
    #: with `StageWork.recompute`: the forward's input and the generator's state before it
    x: Value | None = None
    rng: torch.Tensor | None = None


class TrainHook(Protocol):
    """[Note: train hooks] What a run's ``train_hook`` adds to a stage's training
    (FedProx's proximal term, gradient clipping, SCAFFOLD's corrections). It sees the
    round's global weights: `StageWork.start_round` keeps a copy of the stage's
    trainable parameters as the round's weights were loaded (``work.round_weights``),
    with the strategy's settings for the round (``work.round_settings``).

    - `loss`: on the last stage, each micro-batch's loss as it is backpropagated (the
      micro-batch's mean divided by N) -> the loss to backpropagate;
    - `before_step`: on every stage, before the optimizer step, with the iteration's
      gradients accumulated (``work.module``'s ``.grad``): adjust them in place.
    """

    def loss(self, work: StageWork, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate instead of ``loss``."""
        ...

    def before_step(self, work: StageWork) -> None:
        """Adjust the accumulated gradients before the step."""
        ...


def recomputable(module: nn.Module) -> bool:
    """Whether recomputing ``module``'s forward gives the graph the first forward had:
    it holds no buffers (batch norm's running statistics would be updated twice); the
    global generator's draws (dropout) are replayed ([Note: recomputed activations])."""
    return next(module.buffers(), None) is None


class StageWork:
    """Forward, backward and step of one stage over micro-batches.

    Args:
        module: the stage's units (an ``nn.Sequential`` sharing the model's modules).
        optimizer: steps ``module``'s parameters.
        first: the stage reads data (``batch``) instead of received activations.
        last: the stage computes the loss.
        parallel_batches: N, the micro-batches per iteration (the loss is divided by it).
        num_classes: integer labels must lie in 0..num_classes-1 (0: no classes).
        loss: the run's loss (the last stage's), the mean over a micro-batch.
        metric: the run's metric (the last stage's accuracy; None: the loss alone).

    Its ``batch`` is the first stage's data, set per round with `use_data`.
    """

    def __init__(self, module: nn.Sequential, optimizer: torch.optim.Optimizer, *,
                 first: bool, last: bool, parallel_batches: int, num_classes: int,
                 loss: Loss = cross_entropy, metric: Metric | None = accuracy) -> None:
        self.module = module
        self.optimizer = optimizer
        self.loss = loss
        self.metric = metric
        #: where the stage computes (its parameters' torch device); what it takes in and
        #: gives out stays on the CPU, as on the wire
        self.device = next(module.parameters(), torch.empty(0)).device
        self.first = first
        self.last = last
        self.parallel_batches = parallel_batches
        self.num_classes = num_classes
        self.batch: Batch | None = None
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._labels: dict[tuple[int, int], torch.Tensor] = {}
        #: the round's loss and accuracy summed over samples (last stage; `scored`)
        self.loss_sum = 0.0
        self.correct = 0.0
        #: most micro-batches whose activations were alive at once (forwarded, not yet
        #: backwarded): the memory a schedule costs
        self.peak_live = 0
        #: the fraction of each micro-batch's rows this stage computes (a member of a
        #: data-parallel group: its share; 1 otherwise)
        self.fraction = 1.0
        #: measure what the micro-batches in flight hold (`aiopipe.runtime.memory`)
        self.measure_memory = False
        self._held: dict[tuple[int, int], int] = {}
        #: most bytes the micro-batches in flight held at once this round (measured)
        self.peak_held = 0
        #: [Note: recomputed activations] keep each micro-batch's input, not its graph,
        #: and forward it again at its backward (not on the last stage)
        self.recompute = False
        #: [Note: train hooks] the run's hook (None: none), the round's starting
        #: trainable parameters and the strategy's settings for the round
        self.hook: TrainHook | None = None
        self.round_weights: dict[str, torch.Tensor] = {}
        self.round_settings: Mapping[str, Any] = {}

    @property
    def live(self) -> int:
        """Micro-batches forwarded and not yet backwarded."""
        return len(self._saved)

    def reset_totals(self) -> None:
        """Start counting a new round's loss, predictions and peak."""
        self.loss_sum, self.correct, self.peak_live, self.peak_held = 0.0, 0.0, 0, 0

    def start_round(self, hook: TrainHook | None, settings: Mapping[str, Any]) -> None:
        """[Note: train hooks] The round's weights are loaded: train with ``hook``,
        keeping a copy of them (its trainable parameters) and the round's ``settings``."""
        self.hook, self.round_settings = hook, dict(settings)
        self.round_weights = {} if hook is None else {
            name: p.detach().clone() for name, p in self.module.named_parameters()
            if p.requires_grad}

    def peak_memory(self) -> int:
        """The round's peak of what training held, measured: the stage's weights, their
        gradients and the optimizer's state, and the most the micro-batches in flight
        held at once (0 when not measured)."""
        if not self.measure_memory:
            return 0
        return state_bytes(self.module, self.optimizer) + self.peak_held

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What the device returns at the round's end: a CPU copy of the stage's state."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def current_state(self) -> dict[str, torch.Tensor]:
        """The stage's state on the CPU, sharing the stage's memory there (a copy from a
        GPU): valid until the stage changes."""
        return {k: v.detach().to("cpu") for k, v in self.module.state_dict().items()}

    def clear(self) -> None:
        """Forget every micro-batch in flight (a dropped round) and their gradients."""
        self._saved.clear()
        self._labels.clear()
        self._held.clear()
        self.optimizer.zero_grad(set_to_none=True)

    def forward(self, iteration: int, micro_batch: int, received: Sent | None = None
                ) -> Sent | None:
        """Forward one micro-batch; the activation's leaves and the labels to send on
        (None on the last stage, which keeps the loss for its backward).

        ``received``: the activation's leaves and labels from the previous stage (later
        stages).

        Raises:
            RemoteProtocolError: a received input fails [Note: hostile inputs].
        """
        key = (iteration, micro_batch)
        x, labels, inputs = self._inputs(key, received)
        if self.recompute and not self.last:
            rng = torch.get_rng_state()
            out = self._through(x, labels)  # its graph goes when this returns
            check_output(out, inputs)
            self._saved[key] = _Saved(None, inputs, x, rng)
            self.peak_live = max(self.peak_live, len(self._saved))
            return tuple(o.detach().cpu() for o in out), labels.cpu()
        if self.measure_memory:
            out, held = saved_bytes(partial(self._through, x, labels),
                                    self.module.parameters(), list(leaves(x)))
            self._held[key] = held
            self.peak_held = max(self.peak_held, sum(self._held.values()))
        else:
            out = self._through(x, labels)
        if not self.last:
            check_output(out, inputs)
        self._saved[key] = _Saved(out, inputs)
        self._labels[key] = labels
        self.peak_live = max(self.peak_live, len(self._saved))
        if self.last:
            return None
        return tuple(o.detach().cpu() for o in out), labels.cpu()

    def _through(self, x: Value, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stage's output leaves for ``x`` (the last stage's: the loss, alone)."""
        out = self.module(x)
        if not self.last:
            return leaves(out)
        loss = self._loss(out, labels)
        return (loss,) if self.hook is None else (self.hook.loss(self, loss),)

    def backward(self, iteration: int, micro_batch: int,
                 gradient: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, ...] | None:
        """Backward one micro-batch; the gradients w.r.t. the stage's input to send back,
        one per floating-point leaf (None on the first stage).

        ``gradient``: w.r.t. the stage's output, one per floating-point leaf, from the
        next stage (all but the last).

        Raises:
            RemoteProtocolError: the gradient does not match the output, or the pass gives
                non-finite input gradients.
        """
        key = (iteration, micro_batch)
        saved = self._saved.pop(key)
        self._labels.pop(key, None)
        self._held.pop(key, None)
        if self.last:
            assert saved.output is not None  # the last stage never recomputes
            if saved.output[0].requires_grad:  # (else nothing before it trains)
                torch.autograd.backward(saved.output[0])
        else:
            if gradient is None:
                raise ValueError("a backward before the last stage needs a gradient")
            out = saved.output if saved.output is not None else self._again(saved)
            try:
                pairs = checked_gradient(tuple(g.to(self.device) for g in gradient), out)
            except RemoteProtocolError:
                self.optimizer.zero_grad(set_to_none=True)
                raise
            if pairs:  # (else a frozen first stage: nothing to train)
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if saved.inputs is None:
            return None
        try:
            return input_gradients(saved.inputs)
        except RemoteProtocolError:
            self.optimizer.zero_grad(set_to_none=True)
            raise

    def _again(self, saved: _Saved) -> tuple[torch.Tensor, ...]:
        """The stage's output for a micro-batch forwarded with `recompute`, with its graph:
        the forward again, on the same input and generator state."""
        assert saved.x is not None
        assert saved.rng is not None
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(saved.rng)
            return leaves(self.module(saved.x))

    def forward_backward(self, iteration: int, micro_batch: int,
                         received: Sent | None = None) -> tuple[torch.Tensor, ...] | None:
        """Forward, loss and backward of one micro-batch on the last stage, as one item
        (PiPar's server pass); the gradient w.r.t. the input.

        Raises:
            RemoteProtocolError: as `forward` and `backward`.
        """
        self.forward(iteration, micro_batch, received)
        return self.backward(iteration, micro_batch)

    def step(self) -> None:
        """Apply the accumulated gradients (adjusted by the hook: [Note: train hooks])
        and clear them."""
        if self.hook is not None:
            self.hook.before_step(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _inputs(self, key: tuple[int, int], received: Sent | None
                ) -> tuple[Value, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        if self.first:
            if self.batch is None:
                raise ValueError("the first stage has no data for this round")
            x, labels = self.batch(*key)
            return joined([t.to(self.device) for t in leaves(x)]), labels.to(self.device), None
        if received is None:
            raise ValueError("a later stage's forward needs the received activation")
        activation, labels = received
        # [Note: hostile inputs] the previous stage may be another party's device
        if self.num_classes and not labels.is_floating_point() and labels.numel() and (
                int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise StageInputError(f"labels outside 0..{self.num_classes - 1}")
        if labels.is_floating_point() and not all_finite(labels):
            raise StageInputError("labels hold NaN or Inf")
        if not all(all_finite(t) for t in activation if t.is_floating_point()):
            raise StageInputError("activation holds NaN or Inf")
        inputs = tuple(t.detach().to(self.device).requires_grad_(t.is_floating_point())
                       for t in activation)
        return joined(inputs), labels.to(self.device), inputs

    def _loss(self, logits: Value, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss(logits, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"the loss must be one number (a micro-batch's mean), got "
                             f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        # finite inputs can still be too large for the model: refuse them before they
        # reach the weights (and, through FedAvg, every device's)
        if not torch.isfinite(loss):
            raise StageInputError("activation gives a NaN or Inf loss: its values are "
                                      "out of range")
        loss_sum, correct = scored(logits, labels, loss, self.metric)
        self.loss_sum += loss_sum
        self.correct += correct
        if self.fraction != 1.0:
            return loss * self.fraction / self.parallel_batches
        return loss / self.parallel_batches


def check_output(out: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...] | None
                 ) -> None:
    """A middle stage's output, before it is sent on: non-finite from a received (and
    judged finite) input means the input was out of range for the model, the previous
    stage's doing; passed on, the next stage would blame this one ([Note: hostile
    inputs]).

    Raises:
        StageInputError: it is not finite and came from a received input.
    """
    if inputs is not None and not all(all_finite(o) for o in out if o.is_floating_point()):
        raise StageInputError("activation gives NaN or Inf outputs: its values are out "
                              "of range")


def checked_gradient(gradient: tuple[torch.Tensor, ...], output: tuple[torch.Tensor, ...]
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``gradient``, received for ``output``'s floating-point leaves, once it fits them
    and is finite ([Note: hostile inputs]); paired with the leaves it flows into (those
    that require grad: a leaf computed from nothing trainable takes none).

    Raises:
        RemoteProtocolError: it does not.
    """
    floating = [o for o in output if o.is_floating_point()]
    if len(gradient) != len(floating):
        raise StageInputError(f"{len(gradient)} gradient tensors for an activation of "
                              f"{len(floating)} floating-point tensors", from_next=True)
    for g, o in zip(gradient, floating, strict=True):
        if g.shape != o.shape or g.dtype != o.dtype:
            raise StageInputError(
                f"gradient of shape {tuple(g.shape)} {g.dtype} for an activation of "
                f"shape {tuple(o.shape)} {o.dtype}", from_next=True)
        if not all_finite(g):
            raise StageInputError("gradient holds NaN or Inf", from_next=True)
    return [(o, g) for o, g in zip(floating, gradient, strict=True) if o.requires_grad]


def input_gradients(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The gradients of a stage's received floating-point leaves to send back (on the
    CPU; zeros for a leaf the stage's output does not depend on), once they are finite.

    Raises:
        RemoteProtocolError: they are not: the received activation was out of range.
    """
    out = []
    for t in inputs:
        if not t.is_floating_point():
            continue
        grad = t.grad if t.grad is not None else torch.zeros_like(t)
        if not all_finite(grad):
            raise StageInputError("activation gives NaN or Inf gradients: its values are "
                                  "out of range")
        out.append(grad.cpu())
    if not out:
        raise RemoteProtocolError("the stage's input has no floating-point value to "
                                  "take a gradient")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ServerStage:
    """A stage the coordinator runs for one device in a round (PiPar's server half): its
    torch side, its assignment (what arriving activations are checked against) and what
    its compute actions are charged (virtual time)."""

    work: StageWork
    assignment: Assignment
    costs: Callable[[Action], float] | None = None


def check_tensors(tensors: Mapping[str, TensorData], expected: Expected, what: str) -> None:
    """``tensors`` are exactly ``expected``, floating ones finite.

    Raises:
        RemoteProtocolError: naming ``what`` and the first tensor that is not.
    """
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(expected))[:3]
        raise RemoteProtocolError(f"{what} does not hold its stage's tensors (missing "
                                  f"{missing}, not the stage's {extra})")
    for name, tensor in tensors.items():
        if (tensor.dtype, tensor.shape) != expected[name]:
            dtype, shape = expected[name]
            raise RemoteProtocolError(f"{what}: {name} is {tensor.dtype} {tensor.shape}, "
                                      f"the stage has {dtype} {shape}")
        if tensor.dtype.startswith(("float", "bfloat")) and not bool(
                all_finite(to_torch(tensor))):
            raise RemoteProtocolError(f"{what}: {name} holds NaN or Inf")


def expected_of(tensors: Mapping[str, TensorData]) -> Expected:
    """What tensors like ``tensors`` must be (names, dtypes, shapes)."""
    return {name: (t.dtype, t.shape) for name, t in tensors.items()}
