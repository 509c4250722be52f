"""What a device trains with: its data and the run's model, and the stage each round
assigns it (built from them, or the last one reused).

Opened once per run, after the device's `Plan` (in the compute thread): the data (the
device's own, or an emulated fleet's shard), the run's initial model for the plan's input
shape and classes (`aiopipe.runtime.factories.model_template`, shared by the devices of
one process: [Note: shared templates]), and what the device announces of them (`Ready`).
Each round, `assign` takes the round's `RoundStart`: a checked `Assignment`, and the
stage's torch side with the round's weights: a copy of the template's units on the
device's torch device, built when the device first trains (or changes stage), so that a
device that is not sampled holds no weights at all.

[Note: a redone round] When the server restarts from its checkpoint, it starts again
from the round after the checkpoint, with that round's number and the weights of its
start. That may be the round it was in, or the one before: checkpoints are written
while the next round runs ([Note: background checkpoints]). The weights come in the
`RoundStart`; the device's optimizer state (SGD's momentum) does not, so the device
keeps a copy of it from the start of each of its rounds among the last `KEPT_ROUNDS`
(by the round's number: an older one can no longer be redone) and, given a round it
has started before, starts it from that copy: the redone rounds then compute what the
undisturbed ones did (DESIGN §7: recovery is exact). A stage whose optimizer starts
each round fresh (``StageRules.fresh_optimizer``) keeps none: its rounds start from
nothing either way. Between its rounds a star's device holds no stage at all ([Note: a
round's local optimizer] in aiopipe.runtime.systems.star.keeping): `put_aside`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from aiopipe import data as datasets
from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.errors import RemoteProtocolError
from aiopipe.models.crossing import Crossing, Value
from aiopipe.protocol import (
    EvalRequest,
    EvalResult,
    Plan,
    Ready,
    Replica,
    RoundStart,
    state_from_wire,
)
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.evaluation import evaluated
from aiopipe.runtime.factories import (
    Loss,
    Metric,
    ModelTemplate,
    make_loss,
    make_metric,
    make_optimizer,
    model_template,
    optimizer_states,
)
from aiopipe.runtime.judge import cut_scales
from aiopipe.runtime.momentum import load_momentum, split_momentum
from aiopipe.runtime.plan import device_data
from aiopipe.runtime.profiling import host_fingerprint
from aiopipe.runtime.stage import Batch, StageWork, TrainHook
from aiopipe.strategies.loading import make_train_hook
from aiopipe.wording import plural

__all__ = ["KEPT_ROUNDS", "Holdings", "StageRules", "load_stage_state"]

#: Rounds whose starting optimizer state a device keeps ([Note: a redone round]).
KEPT_ROUNDS = 3

log = logging.getLogger("aiopipe.device")


@dataclass(frozen=True, slots=True)
class StageRules:
    """What a system's stage keeps between rounds (`Holdings.assign`).

    ``whole_batches``: a round's iteration is one whole batch, the stage's weights
    versioned per batch (FTPipeHD: every backward applies its update, and virtual time
    charges it so: `Assignment.charges`); ``keeps_weights``: a device sent no tensors keeps
    the stage's weights from the last round; ``replays``: a round played again starts
    from the weights and optimizer state its first attempt started from (Asteroid);
    ``measures_memory``: the stage measures the bytes it holds (budgets are checked);
    ``wraps_epoch``: a micro-batch past the epoch's end goes round it again (an epoch
    that keeps its batches after a re-plan); ``new_work``: builds the stage's work
    (None: a `StageWork` with the run's optimizer); ``prepare``: readies the work for a
    round after its weights are loaded (the momentum sent, whether it kept its weights);
    ``fresh_optimizer``: each round's optimizer starts with no state; ``sets_aside``: the
    stage is dropped after each round, its optimizer's state kept alone unless fresh
    ([Note: a round's local optimizer] in aiopipe.runtime.systems.star.keeping).
    """

    whole_batches: bool = False
    keeps_weights: bool = False
    replays: bool = False
    measures_memory: bool = False
    wraps_epoch: bool = False
    new_work: Callable[[torch.nn.Sequential, Assignment, Holdings], StageWork] | None = None
    prepare: Callable[[StageWork, Assignment, Mapping[str, torch.Tensor], bool],
                      None] | None = None
    fresh_optimizer: bool = False
    sets_aside: bool = False


@dataclass(slots=True)
class Holdings:
    """A device's data and model (module docstring). Build it with `open`."""

    config: RunConfig
    plan: Plan
    dataset: datasets.Dataset
    #: the run's initial model, shared by the devices of this process
    template: ModelTemplate
    #: where the device's stages compute
    torch_device: torch.device
    loss: Loss
    metric: Metric | None
    #: what crosses each cut per sample: the model's input, then after each unit
    crossings: tuple[Crossing, ...]
    #: the device's own held-out data, on which it evaluates the global model
    held_out: datasets.Dataset | None = None
    #: [Note: a redone round] the rounds last started (at most `KEPT_ROUNDS`): their
    #: stage's units, and its optimizer's state when each started
    round_starts: dict[int, tuple[tuple[int, int], dict[str, Any]]] = field(
        default_factory=dict)
    #: [Note: a round's local optimizer] the optimizer's state the last round left, by
    #: parameter name, while the stage is set aside between rounds (None: none kept)
    aside: dict[str, dict[str, Any]] | None = None
    #: asteroid: the stage's state as the last round with weights began (a replay of it
    #: that keeps the stage starts from there: [Note: kept weights])
    start_state: dict[str, torch.Tensor] | None = None
    #: the run's train hook (fl, sl, sfl, pipar; [Note: train hooks] in
    #: aiopipe.runtime.stage), given the round's weights as each round's are loaded
    train_hook: TrainHook | None = None

    @classmethod
    def open(cls, config: RunConfig, plan: Plan, own: datasets.Dataset | None,
             torch_device: torch.device, held_out: datasets.Dataset | None = None
             ) -> Holdings:
        """Open the data (``own``, else this device's shard of the run's dataset) and
        build the run's model (compute thread).

        Raises:
            ConfigError: the data cannot be opened or the model cannot be built.
        """
        torch.set_num_threads(config.torch_threads)
        dataset = own if own is not None else device_data(config, plan.device_id)
        template = model_template(config, datasets.DataKind(plan.inputs, plan.target[0],
                                                            plan.num_classes))
        holdings = cls(config, plan, dataset, template, torch_device, make_loss(config),
                       make_metric(config), template.crossings, held_out)
        holdings.train_hook = make_train_hook(config)
        return holdings

    @property
    def units(self) -> int:
        """The model's split units."""
        return models.unit_count(self.template.model)

    def model_copy(self, first: int = 0, stop: int | None = None) -> torch.nn.Sequential:
        """A trainable copy of the initial model's units ``first .. stop - 1`` (all by
        default) on the device's torch device."""
        stop = self.units if stop is None else stop
        units = models.units_of(self.template.model, first, stop)
        return copy.deepcopy(units).to(self.torch_device)

    def ready(self) -> Ready:
        """What the device announces: its data and the digest of the model it built."""
        kind = datasets.kind_of(self.dataset)
        return Ready(len(self.dataset), kind.inputs, (kind.target,), kind.classes,
                     self.template.digest, host_fingerprint(),
                     len(self.held_out) if self.held_out else 0)

    def evaluate(self, request: EvalRequest) -> EvalResult:
        """The global model of ``request`` on the held-out data: samples, summed loss and
        summed accuracy (`evaluated`: on a copy of the model: the stage in training keeps its
        weights). Compute thread.

        Raises:
            RemoteProtocolError: the tensors are not the run's model.
        """
        held = self.held_out
        if held is None:
            raise RemoteProtocolError("an evaluation request to a device without held-out "
                                      "data")
        model = self.model_copy()
        try:
            model.load_state_dict(state_from_wire(request.tensors))
        except RuntimeError as exc:
            raise RemoteProtocolError(f"evaluation weights do not fit the model: "
                                      f"{str(exc).splitlines()[0]}") from None
        loss_sum, correct = evaluated(model, held, self.loss, self.metric,
                                      step=self.config.batch_size)
        return EvalResult(request.epoch, len(held), max(loss_sum, 0.0), correct)

    def cut_scales(self, rows: int) -> tuple[tuple[float, float], ...]:
        """Per unit i: the largest magnitude of the activation that enters it and of the
        loss's gradient with respect to that activation, for the run's initial model on
        the first ``rows`` samples of the device's own data, computed as training
        computes (train mode: batch norm normalises by the batch, as the stages' will;
        on a copy, so no statistics of the run change; the random numbers it draws,
        dropout's, are given back). The arrival judge's priors ([Note: judging
        arrivals]). Compute thread.
        """
        x, y = self.dataset.batch(range(min(max(rows, 2), len(self.dataset))))
        return cut_scales(self.model_copy(), self.loss, x, y)

    def assign(self, message: RoundStart, previous: Assignment | None,
               work: StageWork | None, backup: Replica | None = None,
               rules: StageRules = StageRules()) -> tuple[Assignment, StageWork]:
        """The round's assignment and its stage: ``work`` with the round's weights, or a
        new stage when the assignment changed (the optimizer state of the parameters it
        keeps carries over, see aiopipe.runtime.systems.star.replan [Note: switching]). ``backup``:
        Asteroid's own snapshot of the stage to start from when sent no weights
        (aiopipe.runtime.systems.ftpipehd.chain [Note: stage backups]). ``rules``: what the
        system's stage keeps between rounds. Compute thread.

        Raises:
            RemoteProtocolError: the assignment cannot be this run's.
        """
        name = f"device{self.plan.device_id}"
        asynchronous = rules.whole_batches
        assignment = Assignment.from_round_start(
            message, units=self.units, batch_size=self.config.batch_size,
            crossings=self.crossings, me=name, target=self.plan.target[0],
            whole_batches=asynchronous)
        kept_stage = (previous is not None and work is not None
                      and assignment.same_stage(previous, whole_batches=asynchronous))
        if not kept_stage:
            module = self.model_copy(assignment.first_unit, assignment.stop_unit)
            kept = (optimizer_states(work.module, work.optimizer) if work is not None
                    else self.aside)  # (the stage set aside: its optimizer's state)
            self.aside = None
            if previous is not None and work is not None:
                log.info("%s: round %d switches to units %d..%d of stage %d, %s", name,
                         message.round + 1, assignment.first_unit, assignment.stop_unit - 1,
                         assignment.stage, plural(assignment.parallel_batches, "micro-batch"))
            if rules.new_work is not None:
                work = rules.new_work(module, assignment, self)
            else:
                work = StageWork(
                    module, make_optimizer(module, self.config, previous=kept),
                    first=assignment.stage == 0, last=assignment.last,
                    parallel_batches=assignment.parallel_batches,
                    num_classes=self.plan.num_classes, loss=self.loss, metric=self.metric)
        assert work is not None
        # [Note: kept weights] FTPipeHD sends no tensors to a device that holds its stage
        # from the last round: it keeps its weights and momentum; Asteroid none to one
        # that holds its stage in a round played again: it takes them as they were at
        # that round's start
        # a stage with nothing that travels (its parameters all frozen, no buffers) is
        # sent no tensors either way: it loads nothing, as it holds all it needs
        replayed = rules.replays
        travels = bool(models.without_frozen(work.module.state_dict(), work.module))
        keep = rules.keeps_weights and not message.tensors and (kept_stage or travels)
        if keep and not kept_stage:
            raise RemoteProtocolError(f"round {message.round + 1} asks {name} to keep weights "
                                      "it does not hold")
        momentum: dict[str, torch.Tensor] = {}
        if not keep:
            state, momentum = split_momentum(state_from_wire(message.tensors))
            load_stage_state(work.module, state, f"round {message.round + 1}")
            del state
            _let_go_of_weights(message)
        elif replayed and backup is not None and kept_stage:
            state, momentum = split_momentum(state_from_wire(backup.tensors))
            load_stage_state(work.module, state, "the stage's backup")
        elif replayed:
            self._restart(work, name, message.round)
        if momentum and rules.prepare is None:
            # the momentum sent: a pipeline's, every round (the coordinator holds it, so
            # that a round played again starts from it); Asteroid's from a backup point
            load_momentum(work, momentum)
        elif replayed and kept_stage and previous is not None and (
                previous.epoch, previous.first_iteration) == (message.epoch,
                                                             message.first_iteration):
            self._restart_optimizer(work, assignment)  # the round again, as it began
        if replayed:  # where this attempt starts: a replay from here restarts from it
            self.start_state = copy.deepcopy(work.module.state_dict())
        work.clear()
        work.fraction = assignment.share / assignment.micro_batch_size
        work.measure_memory = rules.measures_memory
        if rules.prepare is not None:
            rules.prepare(work, assignment, momentum, keep)
        work.reset_totals()
        work.start_round(self.train_hook, message.sync.get("strategy", {}))
        if rules.fresh_optimizer:  # [Note: a round's local optimizer]
            work.optimizer.state.clear()
            self.round_starts.clear()  # a round starts from nothing, again or not
        else:
            self._note_start(work, assignment, message.round)
        return assignment, work

    def _note_start(self, work: StageWork, assignment: Assignment, round_no: int) -> None:
        """[Note: a redone round] A round started again begins where it began before;
        note where this one begins."""
        units = (assignment.first_unit, assignment.stop_unit)
        start = self.round_starts.get(round_no)
        if start is not None and start[0] == units:
            work.optimizer.load_state_dict(copy.deepcopy(start[1]))
        for gone in [r for r in self.round_starts
                     if r >= round_no or r <= round_no - KEPT_ROUNDS]:
            del self.round_starts[gone]  # what came after is undone; too old to redo
        self.round_starts[round_no] = (units, copy.deepcopy(work.optimizer.state_dict()))
        while len(self.round_starts) > KEPT_ROUNDS:
            del self.round_starts[min(self.round_starts)]

    def put_aside(self, work: StageWork, *, keep_optimizer: bool) -> None:
        """[Note: a round's local optimizer] The device's round is over and ``work``, its
        stage, is dropped: keep its optimizer's state alone (by parameter name, the
        optimizer's own tensors: not copied) when ``keep_optimizer``, else nothing. The
        next round builds its stage again from it."""
        self.aside = optimizer_states(work.module, work.optimizer) if keep_optimizer else None

    def _restart(self, work: StageWork, name: str, round_no: int) -> None:
        """Asteroid's replay of a round on a kept stage: its weights and buffers as the
        round's first attempt began with them (its optimizer: `_restart_optimizer`).

        Raises:
            RemoteProtocolError: this device holds no such start.
        """
        if self.start_state is None:
            raise RemoteProtocolError(f"round {round_no + 1} asks {name} to keep weights it "
                                      "does not hold")
        work.module.load_state_dict(self.start_state)

    def _restart_optimizer(self, work: StageWork, assignment: Assignment) -> None:
        """The optimizer's state as the round this device started last began (Asteroid
        plays a round again from its start)."""
        latest = max(self.round_starts, default=None)
        if latest is not None and self.round_starts[latest][0] == (assignment.first_unit,
                                                                    assignment.stop_unit):
            work.optimizer.load_state_dict(copy.deepcopy(self.round_starts[latest][1]))

    def batches(self, assignment: Assignment, rules: StageRules = StageRules()) -> Batch:
        """The round's micro-batches: micro-batch n of iteration i in the epoch's order
        (PiPar Algorithm 1); in FTPipeHD's rounds of whole batches, batch i + n of the
        epoch (the round's one iteration is numbered by its first batch). A member of a
        data-parallel group reads its share of rows of each micro-batch from its own
        data: the next ``share`` samples of its epoch's order, going round it again when
        an epoch re-planned after a loss needs more of them."""
        order = datasets.epoch_order(np.arange(len(self.dataset)), epoch=assignment.epoch,
                                     seed=self.config.seed)
        per_iteration = 1 if rules.whole_batches else assignment.parallel_batches
        return partial(_micro_batch, self.dataset, order, assignment.share, per_iteration,
                       rules.wraps_epoch)


def _micro_batch(dataset: datasets.Dataset, order: np.ndarray, micro: int, parallel: int,
                 wrap: bool, iteration: int, n: int) -> tuple[Value, torch.Tensor]:
    """Samples ``micro`` of ``order`` for micro-batch n of ``iteration``; with ``wrap``
    (Asteroid, whose epoch keeps its batches after a re-plan), going round ``order``
    again past its end."""
    first = iteration * micro * parallel + n * micro
    if wrap:
        return dataset.batch(np.take(order, np.arange(first, first + micro), mode="wrap"))
    return dataset.batch(order[first:first + micro])


def load_stage_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor],
                     what: str) -> None:
    """Load ``state`` into a stage: every tensor of the stage but its frozen parameters,
    which a system may leave out ([Note: frozen bases] in
    aiopipe/runtime/systems/star/coordinator.py: the stage holds them already).

    Raises:
        RemoteProtocolError: ``state`` lacks another tensor of the stage, or holds one
            the stage does not have.
    """
    missing, unexpected = module.load_state_dict(state, strict=False)
    lacking = sorted(set(missing) - models.frozen_parameters(module))
    if lacking or unexpected:
        raise RemoteProtocolError(f"{what} does not match the stage: "
                                  f"{'lacks ' + ', '.join(lacking) if lacking else ''}"
                                  f"{'; ' if lacking and unexpected else ''}"
                                  f"{'holds ' + ', '.join(unexpected) if unexpected else ''}")


def _let_go_of_weights(message: RoundStart) -> None:
    """The round's weights are in the stage now: let ``message``'s frame go, which its
    tensors (views into it) would keep through the round (the weights' size again, for
    every device in a round: 2.2 MiB each for vgg5, 220 MiB for a round of 100 devices
    of a simulated population). ``message`` is this device's own, decoded from its
    frame; nothing reads its tensors after they are loaded."""
    if isinstance(message.tensors, dict):
        message.tensors.clear()
