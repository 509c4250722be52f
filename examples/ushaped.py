"""U-shaped split learning: a training system of your own, written with aiopipe.systems.

The model's units are cut twice. A device runs the first units, [0, P1), and the last,
[P2, Q): its inputs, its labels and the loss never leave it. The coordinator runs the
middle, [P1, P2). P1 is the run's ``split_point``; the device keeps the last
``tail_units`` units (the classifier; an option of its own, default 1). Devices take
turns, as in split learning ("sl"): each starts from the weights the previous one
left, and the coordinator keeps one middle model that every turn trains. With plain
SGD that is plain SGD on the devices' batches in turn order
(tests/examples/test_examples_ushaped.py checks it). Option ``schedule = "parallel"``
runs every device at once instead, as pipar does ([Note: parallel schedule]).

One iteration, N micro-batches, GPipe over three stages::

    device, stage 0 --activation (labels zeroed)--> coordinator, stage 1 --activation-->
    device, stage 2 (the loss) --gradient--> stage 1 --gradient--> stage 0

The two halves:

- `UShaped`, the coordinator's: per turn, a `RoundStart` that assigns the device stage
  0 and carries stage 2's units and actions in ``sync["ushaped"]``, with both stages'
  weights in its tensors (a unit's weights keep its index in their names: "4.weight");
  the coordinator's own middle stage (`ServerStage`) for the turn; the trained device
  stages, returned in the `RoundResult`, loaded into the global model, whose middle the
  coordinator trained in place.
- `UShapedDevice`, the device's: both stages, each run by a `StageExecutor` over the
  node's one inbox and compute queue, side by side in every iteration. Labels stay on
  the device: stage 0's activations go up with zeros for labels, and the true ones are
  put back on the activations that come down for stage 2.

[Note: parallel schedule] With ``schedule = "parallel"`` the devices do not take
turns: every device of the round trains at once from the same global model, as in
pipar (PiPar's concurrency across devices: each device's three-stage pipeline runs
beside the others', the coordinator's one compute queue serving every middle), each
against its own replica of the middle (made once per device, loaded with the global
middle at each round start; its optimizer's state kept, as the device keeps its
stages'). After the round the global model is the sample-weighted average of each
device's whole model (its two stages and its middle replica), as pipar's FedAvg; a
device lost mid-round is left out of it. Within a device the schedule stays GPipe over
the three stages (not PiPar's two-stage order), and N is the run's, not planned.

[Note: gradient noise] The labels stay on the device, but the gradient the tail sends
up (of the loss with respect to the middle's output) still leaks them: its direction
clusters by label (Li et al., ICLR 2022; `aiopipe.attacks.label_inference`, measured by
bench/label_inference.py). Option ``gradient_noise`` (sigma) adds isotropic Gaussian
noise to that gradient before it leaves: each sample's row gets noise of expected norm
sigma times the micro-batch's largest row norm (scaled to the batch's gradients, in the
spirit of Li et al.'s isotropic-noise baseline; its exact scale there is not checked).
The noise is drawn from a generator seeded
by (the run's seed, ``noise_seed``, the device id, the epoch, iteration and
micro-batch): a run is reproducible, and a gradient re-sent after a reconnection carries
the same noise. The coordinator trains its middle on the noisy gradient; the device's
own stages train on the exact one.

Left out: checkpoints (a U-shaped run does not resume), and what a broken connection
loses mid-iteration (the coordinator re-sends no activation it passed down: such a
turn can stall).

Run it from this directory (real processes over websockets)::

    python -m aiopipe --mode ushaped:UShaped --devices 3 --epochs 2

or simulate it: ``aiopipe.simulate(RunConfig(mode="ushaped:UShaped", ...))`` with
this directory on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import numpy
import torch

from aiopipe import ConfigError, RemoteProtocolError, RunConfig, models
from aiopipe.systems import (
    COORDINATOR,
    HEADER_SLACK_BYTES,
    Action,
    Activation,
    Assignment,
    Delivery,
    DeviceContext,
    DeviceHalf,
    DeviceProfile,
    Gradient,
    Handler,
    Hello,
    Identity,
    Message,
    RoundResult,
    Rounds,
    RoundStart,
    ServerStage,
    Setup,
    StageExecutor,
    StageWork,
    SystemDefaults,
    SystemOptions,
    TensorData,
    check_schedule,
    crossing_bytes,
    gpipe,
    make_optimizer,
    state_from_wire,
    state_to_wire,
    to_tensor_data,
    to_torch,
    unit_crossings,
    with_transfers,
)

__all__ = ["UShaped", "UShapedDevice"]

#: The key of a `RoundStart`'s ``sync`` that describes the device's second stage.
SECOND_STAGE = "ushaped"


def _actions(n: int) -> tuple[tuple[Action, ...], ...]:
    """One iteration's actions of stages 0, 1 and 2: GPipe over N micro-batches."""
    schedule = with_transfers(gpipe(3, n))
    check_schedule(schedule)
    return schedule.actions


def _text(actions: Sequence[Action]) -> str:
    return " ".join(map(str, actions))


# -- the device half --------------------------------------------------------------------


class _ToCoordinator:
    """A device stage's route to the coordinator's middle stage: an activation goes up
    with zeros for labels (the true ones wait for it to come back down); a gradient
    goes up as it is."""

    node = COORDINATOR

    def __init__(self, half: UShapedDevice) -> None:
        self.half = half

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        node = self.half.node
        key = (message.epoch, message.iteration, message.micro_batch)
        if isinstance(message, Activation):
            self.half.labels[key] = message.labels
            zeros = torch.zeros(message.labels.shape, dtype=torch.int64)
            message = dataclasses.replace(message, labels=to_tensor_data(zeros))
            node.delivery.sent(message)  # re-sent after a reconnection, until its gradient
        else:
            options = node.config.options_as(UShapedOptions)
            if options.gradient_noise > 0:
                message = with_noise(message, options.gradient_noise, (
                    node.config.seed, options.noise_seed, node.device_id, *key))
        node.peer.post(message, name, epoch=key[0], iteration=key[1], micro_batch=key[2],
                       ready_at=ready_at)


def with_noise(message: Gradient, sigma: float, seed: Sequence[int]) -> Gradient:
    """``message`` with isotropic Gaussian noise added to its gradient ([Note: gradient
    noise]): each row (sample) gets noise whose expected norm is ``sigma`` times the
    largest row norm of the micro-batch, drawn from a generator seeded by ``seed``."""
    tensors = [to_torch(t) for t in message.tensors]
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats:
        return message
    rows = floats[0].shape[0]
    flat = torch.cat([t.reshape(rows, -1).to(torch.float64) for t in floats], dim=1)
    largest = float(torch.linalg.vector_norm(flat, dim=1).max())
    std = sigma * largest / flat.shape[1] ** 0.5
    state = numpy.random.SeedSequence([int(s) for s in seed]).generate_state(1, numpy.uint64)
    generator = torch.Generator().manual_seed(int(state[0]))
    noisy = []
    for t in tensors:
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * std
            t = (t.to(torch.float64) + noise).to(t.dtype)
        noisy.append(to_tensor_data(t))
    return dataclasses.replace(message, tensors=tuple(noisy))


class UShapedDevice(DeviceHalf):
    """The device's half (module docstring): stages 0 and 2 of every round."""

    def __init__(self, node: DeviceContext) -> None:
        super().__init__(node)
        #: the true labels of the activations sent up, until they come back down
        self.labels: dict[tuple[int, int, int], TensorData] = {}
        #: the stages built, by (first unit, stop unit, N): kept between rounds
        self.works: dict[tuple[int, int, int], StageWork] = {}
        self.running = False
        #: stage 2's data path (stage 0's is the node's own)
        self.upper = Delivery(node.inbox, coordinator=COORDINATOR, rules=self.arrivals,
                              batch_size=1, running=lambda: self.running,
                              judge=lambda: node.judge)

    def handlers(self) -> Mapping[type[Message], Handler]:
        """Activations come down for stage 2: with their labels put back."""
        return {Activation: self._activation}

    def _activation(self, sender: str, message: Activation) -> None:
        key = (message.epoch, message.iteration, message.micro_batch)
        labels = self.labels.pop(key, None)
        if sender != COORDINATOR or labels is None:
            raise RemoteProtocolError(f"{sender} sent activation {key}, whose input this "
                                      "device never sent up")
        self.upper.deliver(sender, dataclasses.replace(message, labels=labels))

    async def run_round(self, start: RoundStart) -> int:
        """Both stages, iteration by iteration; then the trained stages and the report.

        Raises:
            TrainingError: the coordinator failed the round or ended the run.
            RemoteProtocolError: the round is not a U-shaped one of this run.
        """
        node = self.node
        mark = len(node.recorder.slices)
        node.inbox.reopen()
        self.labels.clear()
        (low, lower), (high, upper) = await node.compute.call(partial(self._stages, start))
        node.assignment, node.work = low, lower
        node.delivery.start_round(low)
        self.upper.start_round(high)
        self.upper.run_id = node.run_id
        lower.batch = node.holdings.batches(low)
        route, me = _ToCoordinator(self), Identity(node.run_id, node.name)
        executors = [
            StageExecutor(lower, node.compute, stage=0, actions=low.actions, identity=me,
                          inbox=node.inbox, previous=None, next=route,
                          costs=low.charges(node.costs)),
            StageExecutor(upper, node.compute, stage=2, actions=high.actions, identity=me,
                          inbox=node.inbox, previous=route, next=None,
                          costs=high.charges(node.costs))]
        self.running = True
        try:
            for iteration in range(start.first_iteration,
                                   start.first_iteration + start.iterations):
                if node.ended is not None:
                    raise node.ended
                version = low.version_of(iteration)
                try:
                    async with asyncio.TaskGroup() as tasks:
                        for executor in executors:
                            tasks.create_task(executor.run(start.epoch, iteration, version))
                except BaseExceptionGroup as group:  # the first stage's error says why
                    raise group.exceptions[0] from None
                node.delivery.iteration_done()
        finally:
            self.running = False
        samples = start.iterations * low.micro_batch_size * low.parallel_batches
        weights = await node.compute.call(
            lambda: state_to_wire({**lower.trained_state(), **upper.trained_state()}))
        result = RoundResult(start.round, samples, float(upper.loss_sum), float(upper.correct),
                             weights)
        await node.report(result, mark, upper)
        return samples

    def _stages(self, start: RoundStart) -> list[tuple[Assignment, StageWork]]:
        """Stages 0 and 2 of ``start``'s round with its weights (compute thread).

        Raises:
            RemoteProtocolError: ``start`` does not describe them.
        """
        node, holdings = self.node, self.node.holdings
        second = start.sync.get(SECOND_STAGE)
        if not isinstance(second, Mapping) or set(second) != {"first_unit", "actions"}:
            raise RemoteProtocolError(f"round {start.round + 1} describes no second stage")
        tail = dataclasses.replace(start, stage=2, first_unit=second["first_unit"],
                                   stop_unit=holdings.units, actions=second["actions"])
        weights = state_from_wire(start.tensors)
        stages = []
        for message in (start, tail):
            assignment = Assignment.from_round_start(
                message, units=holdings.units, batch_size=node.config.batch_size,
                crossings=holdings.crossings, me=node.name,
                target=holdings.plan.target[0])
            first, stop = assignment.first_unit, assignment.stop_unit
            work = self.works.get((first, stop, assignment.parallel_batches))
            if work is None:
                module = holdings.model_copy(first, stop)
                work = self.works[first, stop, assignment.parallel_batches] = StageWork(
                    module, make_optimizer(module, node.config), first=assignment.stage == 0,
                    last=assignment.last, parallel_batches=assignment.parallel_batches,
                    num_classes=holdings.plan.num_classes, loss=holdings.loss,
                    metric=holdings.metric)
            own = set(work.module.state_dict())
            try:
                work.module.load_state_dict({k: v for k, v in weights.items() if k in own})
            except RuntimeError as exc:
                raise RemoteProtocolError(f"round {start.round + 1}'s weights do not fit "
                                          f"units {first}..{stop - 1}: "
                                          f"{str(exc).splitlines()[0]}") from None
            work.clear()
            work.reset_totals()
            stages.append((assignment, work))
        return stages


# -- the coordinator half ---------------------------------------------------------------


def _check(config: Any) -> None:
    """One split point for every device and micro-batch counts of their own, no "auto"
    (the star's planner plans two-stage splits)."""
    if not isinstance(config.split_point, int):
        raise ConfigError("config key 'split_point': U-shaped runs take one int")
    for k in range(config.devices):
        if not isinstance(config.device_parallel_batches(k), int):
            raise ConfigError("config key 'parallel_batches': U-shaped runs take ints")
    options = config.options_as(UShapedOptions)
    tail = options.tail_units
    if isinstance(tail, bool) or not isinstance(tail, int) or tail < 1:
        raise ConfigError(f"config key 'tail_units': got {tail!r}, expected an int >= 1")
    if options.schedule not in ("turns", "parallel"):
        raise ConfigError(f"config key 'schedule': got {options.schedule!r}, expected "
                          "'turns' or 'parallel'")
    noise = options.gradient_noise
    if isinstance(noise, bool) or not isinstance(noise, int | float) or not noise >= 0 or (
            noise == float("inf")):
        raise ConfigError(f"config key 'gradient_noise': got {noise!r}, expected a finite "
                          "number >= 0")
    seed = options.noise_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"config key 'noise_seed': got {seed!r}, expected an int >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class UShapedOptions:
    """U-shaped split learning's own options (a config file's ``[ushaped]`` table)."""

    tail_units: int = 1
    schedule: str = "turns"
    gradient_noise: float = 0.0
    noise_seed: int = 0


class UShaped(SystemDefaults):
    """The coordinator's half (module docstring)."""

    device_half: ClassVar[type[DeviceHalf]] = UShapedDevice
    recovers_lost_devices: ClassVar[bool] = True  # a lost device's turn is undone
    options: ClassVar[SystemOptions] = SystemOptions(
        UShapedOptions,
        keys={"tail_units": "units at the model's end that run on the device, after the "
                            "coordinator's (the classifier: 1)",
              "schedule": "\"turns\" (devices one after another, as sl) or "
                          "\"parallel\" (every device at once, a middle replica each, "
                          "FedAvg after the round, as pipar)",
              "gradient_noise": "Gaussian noise on the gradient the device's tail sends "
                                "the coordinator, per sample, as a multiple of the "
                                "micro-batch's largest per-sample norm (0: none)",
              "noise_seed": "seed of that noise, with the run's seed (0)"},
        check=_check)
    serves_stages = True  # the middle (not resumable: `SystemDefaults`)

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """B / N for each device's N."""
        return sorted({config.batch_size // int(config.device_parallel_batches(k))
                       for k in range(config.devices)})

    def __init__(self, setup: Setup) -> None:
        self.setup, self.config, self.model = setup, setup.config, setup.model
        self.units = models.unit_count(self.model)
        split = self.config.split_point
        if not isinstance(split, int):  # (the options' check says so first)
            raise ConfigError("config key 'split_point': U-shaped runs take one int")
        self.tail_units = self.config.options_as(UShapedOptions).tail_units
        self.cuts = (split, self.units - self.tail_units)
        if not 1 <= self.cuts[0] < self.cuts[1] < self.units:
            raise ConfigError(f"config key 'split_point': {self.cuts[0]} leaves no middle "
                              f"for the coordinator (units {self.cuts[0]}..{self.cuts[1] - 1}"
                              f" of {self.units}; the device keeps the last {self.tail_units})")
        # the coordinator's middle shares the global model's units: it trains them in place
        self.middle = models.units_of(self.model, *self.cuts)
        self.optimizer = make_optimizer(self.middle, self.config)
        self.shapes = unit_crossings(self.model, setup.data.inputs)
        self.samples: list[int] = []
        #: per device, its middle replica and its optimizer (parallel schedule)
        self.replicas: dict[int, tuple[torch.nn.Sequential, torch.optim.Optimizer]] = {}

    def _n(self, k: int) -> int:
        return int(self.config.device_parallel_batches(k))

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Keep the devices' sample counts.

        Raises:
            ConfigError: a device holds fewer samples than one iteration.
        """
        self.samples = list(samples)
        for k in range(self.config.devices):
            if self.iterations(k) < 1:
                raise ConfigError(f"device {k} holds {samples[k]} samples, fewer than one "
                                  f"batch ({self.config.batch_size})")

    def iterations(self, device_id: int) -> int:
        micro = self.config.batch_size // self._n(device_id)
        return self.samples[device_id] // (micro * self._n(device_id))

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per device: its units (its first stage's, and in words its last stage's and
        the coordinator's), its N."""
        p1, p2 = self.cuts
        return [{"device": k, "units": [0, p1], "parallel_batches": self._n(k),
                 "schedule": f"and units {p2}-{self.units - 1}; the server {p1}-{p2 - 1}"}
                for k in range(len(self.samples))]

    def refuse_hello(self, hello: Hello) -> str:
        return ""

    def peer_keys(self, device_id: int) -> dict[str, str]:
        return {}

    def frame_limit(self) -> int:
        """The whole model's state, the largest activation of a batch, a round report."""
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        batch = self.config.batch_size
        activation = max(crossing_bytes(c) for c in self.shapes) * batch
        slices = max((self.iterations(k) * (8 * self._n(k) + 4) + 16
                      for k in range(len(self.samples))), default=16)
        return int(max(state_bytes, activation + 8 * batch) + HEADER_SLACK_BYTES
                   + 256 * len(state) + 128 * slices + 4096)

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """The devices' turns, in order: each trains from the weights the last one left;
        or, with ``schedule = "parallel"``, every device at once ([Note: parallel
        schedule])."""
        if self.config.options_as(UShapedOptions).schedule == "parallel":
            return await self._parallel(rounds, round_no, epoch, first, work, participants)
        done: dict[int, RoundResult] = {}
        for k in participants:
            start = await rounds.compute.call(
                partial(self._round_start, k, round_no, epoch, first, work[k]))
            before = await rounds.compute.call(self._middle_state)
            rounds.copy_checkpoint()
            result = await rounds.play(k, start, self._server_stage(k, start))
            if result is None:  # lost mid-turn: the middle forgets its part of the turn
                await rounds.compute.call(partial(self._load_middle, before))
                continue
            state = state_from_wire(result.tensors)
            await rounds.compute.call(partial(self.model.load_state_dict, state, strict=False))
            done[k] = result
        return done

    def _round_start(self, k: int, round_no: int, epoch: int, first: int,
                     iterations: int) -> RoundStart:
        """Device k's turn: stage 0 assigned, stage 2 in ``sync``, both stages' weights
        (compute thread)."""
        p1, p2 = self.cuts
        n = self._n(k)
        device = {**models.units_of(self.model, 0, p1).state_dict(),
                  **models.units_of(self.model, p2, self.units).state_dict()}
        tensors = state_to_wire({key: v.detach().clone() for key, v in device.items()})
        lower, _, upper = _actions(n)
        return RoundStart(round_no, epoch, first, iterations, tensors, 0, 3, 0, p1, n,
                          self.config.batch_size // n, epoch * self.iterations(k) + first,
                          _text(lower), sync={SECOND_STAGE: {"first_unit": p2,
                                                             "actions": _text(upper)}})

    async def _parallel(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Every device's round at once, each against its own replica of the middle;
        then the sample-weighted average of the devices' whole models ([Note: parallel
        schedule])."""
        starts = {k: await rounds.compute.call(
            partial(self._round_start, k, round_no, epoch, first, work[k]))
            for k in participants}
        for k in participants:
            await rounds.compute.call(partial(self._load_replica, k))
        rounds.copy_checkpoint()
        try:
            async with asyncio.TaskGroup() as tasks:
                played = {k: tasks.create_task(rounds.play(
                    k, starts[k], self._server_stage(k, starts[k], *self.replicas[k])))
                    for k in participants}
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        done = {k: result for k, task in played.items() if (result := task.result()) is not None}
        if done:  # a device lost mid-round is left out of the average
            await rounds.compute.call(partial(self._average, done))
        return done

    def _load_replica(self, k: int) -> None:
        """Device k's middle replica, made once, loaded with the global middle (its
        optimizer's state kept across rounds, as the device keeps its stages')."""
        if k not in self.replicas:
            middle = copy.deepcopy(self.middle)
            self.replicas[k] = (middle, make_optimizer(middle, self.config))
        middle, optimizer = self.replicas[k]
        middle.load_state_dict(self.middle.state_dict())
        optimizer.zero_grad(set_to_none=True)

    def _average(self, done: Mapping[int, RoundResult]) -> None:
        """The global model: each entry the sample-weighted mean of the devices' trained
        stages and their middle replicas (FedAvg over whole models, as pipar's)."""
        total = sum(result.samples for result in done.values())
        merged: dict[str, torch.Tensor] = {}
        for k, result in done.items():
            state = {**state_from_wire(result.tensors), **self.replicas[k][0].state_dict()}
            for key, value in state.items():
                share = value.to(torch.float64) * (result.samples / total)
                merged[key] = merged[key] + share if key in merged else share
        current = self.model.state_dict()
        self.model.load_state_dict({key: merged[key].to(current[key].dtype)
                                    if current[key].is_floating_point()
                                    else current[key] for key in merged}, strict=False)

    def _server_stage(self, k: int, start: RoundStart, middle: torch.nn.Sequential | None = None,
                      optimizer: torch.optim.Optimizer | None = None) -> ServerStage:
        """The coordinator's middle stage for device k's turn (or, parallel, round: on
        its replica)."""
        p1, p2 = self.cuts
        n = start.parallel_batches
        work = StageWork(self.middle if middle is None else middle,
                         self.optimizer if optimizer is None else optimizer, first=False,
                         last=False, parallel_batches=n, num_classes=self.setup.data.classes)
        assignment = Assignment(
            "server", start.round, start.epoch, start.first_iteration, start.iterations,
            1, 3, p1, p2, n, start.micro_batch_size, start.version, _actions(n)[1], {},
            self.shapes[p1 - 1], self.shapes[p2 - 1], target=self.setup.data.target)
        costs = self.setup.server_costs or self.setup.cost_table
        return ServerStage(work, assignment, assignment.charges(costs))

    def _middle_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return (copy.deepcopy(self.middle.state_dict()),
                copy.deepcopy(self.optimizer.state_dict()))

    def _load_middle(self, state: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
        """The middle as a turn began, with no gradient left of the turn's backwards."""
        self.middle.load_state_dict(state[0])
        self.optimizer.load_state_dict(state[1])
        self.optimizer.zero_grad(set_to_none=True)
