"""fl, sl, sfl and pipar: K two-stage pipelines that share the coordinator's node.

Placement: device k runs stage 0, units 1..P_k, on its own data; the coordinator runs
stage 1, units P_k+1..Q, on device k's replica of the server half (one per device in
a round, all on the coordinator's one compute queue: aiopipe.runtime.systems.star.replicas [Note:
replicas while training]). FL is the degenerate case P_k = Q:
one stage, the whole model on the device, nothing on the coordinator.

Schedules (`aiopipe.scheduler.schedule.pipar`): the device forwards its N micro-batches
back to back, then backwards them in order, then steps; the coordinator's stage does each
micro-batch's forward, loss and backward as one item as its activation arrives, then
steps the replica. SFL and SL are PiPar with N = 1.

Per round (an epoch, or ``aggregation_every`` iterations):
- fl / sfl / pipar: every device gets its stage of the global model and trains it; the
  coordinator serves activations; when every device's result is in, it rebuilds
  M_k = M^s_k (+) M^c_k per device, aggregates them by the run's strategy (FedAvg
  weighted by samples, PiPar Eq. 3, by default: aiopipe.strategies), splits back (Eq. 4);
- sl: devices take turns; each starts from the previous one's weights.
With "auto" split points or micro-batch counts, the plans are chosen here before
training ([Note: planning]) and, with ``replan``, reconsidered between rounds
(`aiopipe.runtime.systems.star.replan`); mode auto first chooses fl, sfl or pipar by
their predicted epochs ([Note: choosing the system] in aiopipe.scheduler.auto), then
tries each other system the first round's speeds say may be faster, a round each
([Note: re-choosing the system] in aiopipe.runtime.systems.star.rechoose). What is
decided between rounds is in aiopipe.runtime.systems.star.between_rounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.models.crossing import crossing_bytes
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.aggregation import (
    UpdateJudge,
    evaluation_probe,
    judged_aggregate,
    screen_updates,
    update_norms,
)
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.factories import make_loss, make_metric
from aiopipe.runtime.plan import (
    DevicePlan,
    cached_planning_costs,
    check_trainable,
    declared_devices,
    model_profile,
    unit_crossings,
)
from aiopipe.runtime.stage import ServerStage, StageWork
from aiopipe.runtime.systems.base import Rounds, Setup, SystemDefaults, planning_batch_sizes
from aiopipe.runtime.systems.star.between_rounds import BetweenRounds, SecondLook
from aiopipe.runtime.systems.star.device import StarDevice
from aiopipe.runtime.systems.star.options import (
    AutoOptions,
    server_lanes_of,
    star_options,
    untrimmed_warning,
)
from aiopipe.runtime.systems.star.planning import (
    choose_system,
    device_plans,
    first_plans,
    micro_batch_sizes,
    needs_planner,
    system_config,
    with_plans,
)
from aiopipe.runtime.systems.star.privacy_report import StarPrivacy
from aiopipe.runtime.systems.star.replan import Replan
from aiopipe.runtime.systems.star.replicas import ReplicaPool
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.actions import Action
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile
from aiopipe.scheduler.placement import star
from aiopipe.scheduler.schedule import check_schedule, pipar, with_transfers
from aiopipe.strategies import Settings, TrainHook, make_strategy, make_train_hook
from aiopipe.strategies import uploaded_aggregate as strategy_aggregate

if TYPE_CHECKING:
    from aiopipe.runtime.systems.star.secure import SecureRound

__all__ = ["Star"]

log = logging.getLogger("aiopipe.server")

#: Samples of the coordinator's test set an aggregate's loss is judged on ([Note: judging
#: updates]).
PROBE_SAMPLES = 32


class Star(BetweenRounds, SystemDefaults):
    """The star systems (module docstring); ``setup.config.mode`` says which."""

    resumable = True
    recovers_lost_devices = True  # a lost device's update is left out; the rest reweighted
    device_half = StarDevice
    links_devices = False
    round_iterations = 0  # aggregation_every's

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """B' = B/N for every N the planner may pick."""
        return micro_batch_sizes(config)

    def __init__(self, setup: Setup) -> None:
        config = setup.config
        self.setup = setup
        self.config = config
        self.serves_stages = config.mode != "fl"  # sl, sfl, pipar: the server half
        self.server_lanes = server_lanes_of(config)
        self.model = setup.model
        #: the global model's frozen parameters ([Note: frozen bases])
        self.frozen = models.frozen_parameters(self.model)
        self.units = models.unit_count(self.model)
        self.num_classes = setup.data.classes
        self.inputs = setup.data.inputs
        self.cost_table = setup.cost_table
        #: what the coordinator's own stages cost (its own table, or everyone's)
        self.server_costs = setup.server_costs or setup.cost_table
        self.loss = make_loss(config)
        self.metric = make_metric(config)
        self.samples: list[int] = []
        #: the config as given (mode "auto" stays so): what a resumed run is checked against
        self.given = config
        self.auto_config: RunConfig | None = config if needs_planner(config) else None
        self.second_look: SecondLook | None = None
        self.planned_keys: tuple[str, ...] = (
            ("split_point", "parallel_batches") if self.auto_config else ())
        # real clocks plan from the devices' own measurements; virtual time charges
        # (and plans with) the table it was given
        self.wants_profiles = (self.auto_config is not None and self.cost_table is None
                               and config.profile_devices)
        self.planning: ModelProfile | None = None
        self.live: list[DeviceProfile] = []
        self.replans: list[Replan] = []
        self.plans: list[DevicePlan] = []
        self.replicas = ReplicaPool(self.model, setup.torch_device, keeps=star_options(
            config).local_optimizer == "kept")  # [Note: a round's local optimizer]
        self.crossings = unit_crossings(self.model, self.inputs)
        self._schedules: dict[tuple[int, int], tuple[str, tuple[Action, ...]]] = {}
        #: devices whose update was refused, clipped or dropped since `refused_updates`
        self.refused: list[int] = []
        #: every update judged before it is averaged ([Note: judging updates])
        self.judge = UpdateJudge(config.scale_limit)
        #: aiopipe.strategies: the run's, its settings for the round; replicas' train hooks
        self.strategy = make_strategy(config)
        self.privacy = StarPrivacy(config, self.strategy, self.model)  # epsilon spent:
        self.privacy_spent = self.privacy.spent  # DP-SGD's or central DP's
        self.settings: Settings = {}
        self._hooks: defaultdict[int, TrainHook | None] = defaultdict(
            partial(make_train_hook, config))
        self._untrimmed: set[str] = set()  # trimmed means that trimmed nothing, warned of
        #: [Note: secure FedAvg]: the round's secure aggregation (None: plain uploads)
        self.secure: SecureRound | None = None
        if self.auto_config is None:  # refuse what cannot train before devices join
            check_trainable(self.model, self.inputs, device_plans(
                config, self.units, [config.batch_size] * config.devices), config)

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Plan for the devices' announced samples ([Note: planning]): with "auto", from
        the cost table (measured here when not given: real runs keep real time) and
        ``devices``, the devices' own profiles (else the declared ``device_slowdown``
        and ``network``); then the plans and placement.

        Raises:
            ConfigError: no plan fits, or a device holds fewer samples than one iteration.
        """
        config = self.auto_config or self.config
        self.samples = list(samples)
        if self.auto_config is not None:
            planning_costs = self.server_costs or cached_planning_costs(
                config, self.model, self.inputs, self.setup.test_set,
                sizes=planning_batch_sizes(config))
            self.planning = model_profile(self.model, self.inputs, planning_costs,
                                          server_lanes=self.server_lanes)
            self.live = (list(devices) if devices is not None
                         else declared_devices(config, self.samples,
                                               costs=self._device_costs()))
            chosen = None  # mode auto's fleet plans, searched once ([Note: choosing the system])
            if config.mode == "auto":
                options = config.options_as(AutoOptions)
                if options.rechoose and not config.devices_per_round:
                    self.second_look = SecondLook(config, options.candidates)
                config, chosen, line, table = choose_system(config, self.planning, self.live)
                log.info("%s\n%s", line, table)
                # a second look may move fl to a split system: its cuts are judged
                self.serves_stages = config.mode != "fl" or self.second_look is not None
                self.auto_config = config if config.mode != "fl" else None
            if self.auto_config is not None:
                config = with_plans(config, chosen if chosen and not config.devices_per_round
                                    else first_plans(config, self.planning, self.live))
        self.config = config
        self.plans = device_plans(config, self.units, self.samples)
        self.placement = star([p.split_point for p in self.plans], self.units)
        if self.auto_config is not None:
            check_trainable(self.model, self.inputs, self.plans, config)
        # [Note: judging updates]: the first round's starting model is this one; its
        # figures on the evaluation batch are measured now, while the fleet waits for
        # the plan, not in the first round's aggregation (a resumed run's checkpoint
        # makes the judge measure its model again, `restore`)
        self._probe_once()
        self.judge.loss_ceiling(self.model.state_dict())

    # -- what devices are told -----------------------------------------------------------

    def iterations(self, device_id: int) -> int:
        """Iterations per epoch of device ``device_id`` ([Note: iterations per epoch])."""
        return self.plans[device_id].iterations_per_epoch

    def frame_limit(self) -> int:
        """The whole model's state, the largest activation at batch size B, a round
        report's slices and a round's action list."""
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        batch = self.config.batch_size
        act = batch * (max(crossing_bytes(c) for c in self.crossings)
                       + crossing_bytes((self.setup.data.target,)))
        # a RoundReport carries the device's trace of the round: a few slices per
        # micro-batch, each well under 128 bytes as msgpack
        most = batch if self.auto_config or self.second_look else 0  # N after re-planning
        widest = max(max(p.parallel_batches, most) for p in self.plans)
        slices = max(p.iterations_per_epoch * (3 * widest + 2) + 16 for p in self.plans)
        actions = 16 * (4 * widest + 2)  # a RoundStart's action list
        return int(max(state_bytes, act) + HEADER_SLACK_BYTES + 256 * len(state)
                   + 128 * slices + actions)

    def _actions(self, plan: DevicePlan) -> tuple[str, tuple[Action, ...]]:
        """The device's action list (as text) and the coordinator's, for ``plan``."""
        key = (plan.split_point, plan.parallel_batches)
        found = self._schedules.get(key)
        if found is None:
            if plan.split_point == self.units:  # fl: the whole model on the device
                device: tuple[Action, ...] = (Action(0, "FB", 0), Action(0, "STEP"))
                server: tuple[Action, ...] = ()
            else:
                schedule = with_transfers(pipar(plan.parallel_batches))
                check_schedule(schedule)
                device, server = schedule.actions
            found = self._schedules[key] = (" ".join(map(str, device)), server)
        return found

    def round_start(self, device_id: int, round_no: int, epoch: int, first: int,
                    iterations: int, state: Mapping[str, Any]) -> RoundStart:
        """Device ``device_id``'s `RoundStart` with its stage's weights ``state``."""
        plan = self.plans[device_id]
        stages = self.placement.pipelines[device_id].stages
        return RoundStart(round_no, epoch, first, iterations, state, 0, len(stages),
                          stages[0].first_unit, stages[0].stop_unit, plan.parallel_batches,
                          plan.micro_batch_size, self._version(plan, epoch, first),
                          self._actions(plan)[0], sync={
                              **({"strategy": dict(self.settings)} if self.settings else {}),
                              **({"secagg": self.secure.settings()} if self.secure else {})})

    def server_stage(self, device_id: int, start: RoundStart) -> ServerStage | None:
        """The stage the coordinator runs for ``device_id`` this round (None in fl)."""
        plan = self.plans[device_id]
        stages = self.placement.pipelines[device_id].stages
        if len(stages) == 1:  # fl: the device runs the whole model
            return None
        replica, optimizer = self.replicas[device_id]
        p = stages[1].first_unit
        work = StageWork(replica, optimizer, first=False, last=True,
                         parallel_batches=plan.parallel_batches, num_classes=self.num_classes,
                         loss=self.loss, metric=self.metric)
        work.start_round(self._hooks[device_id], start.sync.get("strategy", {}))
        assignment = Assignment(
            "server", start.round, start.epoch, start.first_iteration, start.iterations, 1, 2,
            p, self.units, plan.parallel_batches, plan.micro_batch_size, start.version,
            self._actions(plan)[1], {}, self.crossings[p - 1], (),
            target=self.setup.data.target)
        return ServerStage(work, assignment, assignment.charges(self.server_costs))

    @staticmethod
    def _version(plan: DevicePlan, epoch: int, first: int) -> int:
        """Optimizer steps the device's weights have taken at iteration ``first``."""
        return epoch * plan.iterations_per_epoch + first

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Parallel rounds with FedAvg (fl, sfl, pipar), or turns (sl)."""
        done: dict[int, RoundResult] = {}
        self.round_began = rounds.clock.now()
        self.settings = self.strategy.configure_round(round_no)
        if self.config.mode == "sl":  # devices take turns on one chain of weights
            for k in participants:
                state = await rounds.compute.call(partial(self._prepare, k))
                rounds.copy_checkpoint()
                result = await self._play(rounds, k, round_no, epoch, first, work[k], state)
                if result is None:
                    await rounds.compute.call(partial(self.replicas.roll_back, [k]))
                else:
                    done[k] = result
                    await rounds.compute.run("agg", partial(self._adopt, k, result),
                                             cost=0.0 if self.cost_table else None,
                                             epoch=epoch)
                    await rounds.compute.call(partial(self.replicas.close, [k]))
            return done
        await self.plan_round(rounds, participants)
        if star_options(self.config).secure_aggregation:  # [Note: secure FedAvg]
            from aiopipe.runtime.systems.star.secure import SecureRound

            self.secure = SecureRound.of(self.config, round_no, self.plans, work, participants)
        halves: dict[int, dict[str, Any]] = {}  # a copy of each split point's half a round
        states = {k: await rounds.compute.call(partial(self._prepare, k, halves))
                  for k in participants}
        rounds.copy_checkpoint()  # after the RoundStarts: see [Note: background checkpoints]
        try:
            async with asyncio.TaskGroup() as tasks:
                played = {k: tasks.create_task(
                    self._play(rounds, k, round_no, epoch, first, work[k], states[k]))
                    for k in participants}
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        done = {k: res for k, t in played.items() if (res := t.result()) is not None}
        dropped = [k for k in participants if k not in done]
        if dropped:
            await rounds.compute.call(partial(self.replicas.roll_back, dropped))
        if done and self.secure is not None:
            from aiopipe.runtime.systems.star.secure import aggregate_securely

            done = await aggregate_securely(self, rounds, self.secure, done, epoch)
        elif done:
            cost = self.cost_table.aggregate_time(len(done)) if self.cost_table else None
            await rounds.compute.run("agg", partial(self._aggregate, done), cost=cost, epoch=epoch)
        await rounds.compute.call(partial(self.replicas.close, list(done)))
        return done

    def _device_costs(self) -> CostTable | None:
        """The declared devices' own table when the server has another (virtual time
        with the server measured apart), else None: the server's x their slowdown."""
        return self.cost_table if self.setup.server_costs is not None else None

    async def _play(self, rounds: Rounds, k: int, round_no: int, epoch: int, first: int,
                    iterations: int, state: Mapping[str, Any]) -> RoundResult | None:
        start = self.round_start(k, round_no, epoch, first, iterations, state)
        self.privacy.started(k, iterations, self.plans[k], self.samples[k])
        return await rounds.play(k, start, self.server_stage(k, start),
                                 returns={} if self.secure else None)

    def refused_updates(self) -> list[int]:
        """Devices whose update was refused ([Note: judging updates]), clipped or dropped
        since the last call."""
        refused, self.refused = sorted(set(self.refused)), []
        return refused

    def _prepare(self, k: int, halves: dict[int, dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
        """Device k's half of the global model, for its `RoundStart`; its replica of the
        other half, outside fl (compute thread). ``halves``: the round's halves by split
        point, shared by the devices of one split point (the global model does not
        change until the round is over, and a RoundStart's tensors are only read; a copy
        per device held a model's worth per drawn device through the round)."""
        split_point = self.plans[k].split_point
        if split_point < self.units:
            self.replicas.open(k, split_point, self.config)
        if halves is not None and split_point in halves:
            return halves[split_point]
        half = models.split(self.model, split_point)[0]
        frozen = models.frozen_parameters(half)  # [Note: frozen bases]: devices hold them
        state = state_to_wire({key: v.detach().clone() for key, v in half.state_dict().items()
                               if key not in frozen})
        if halves is not None:
            halves[split_point] = state
        return state

    def _whole_state(self, k: int, result: RoundResult, start: Mapping[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
        """Device k's whole model after the round: its half, its replica of the other
        half, and the frozen parameters as they were (they did not travel)."""
        returned = state_from_wire(result.tensors)
        if k in self.replicas:
            replica = {key: v.cpu() for key, v in self.replicas[k][0].state_dict().items()}
            returned = models.merge_states(returned, replica)
        return {**{key: start[key] for key in self.frozen if key not in returned},
                **returned}

    def _aggregate(self, results: Mapping[int, RoundResult]) -> None:
        """The devices whose round completed, judged ([Note: judging updates]), screened
        for outliers, aggregated as the run says (FedAvg by default, weighted by their
        samples), and installed if the aggregate passes the judge. A refused update's
        or an outlier's replica optimizer goes back to the round's start: what it learnt
        from its device is not kept either."""
        config = self.config
        start = self.model.state_dict()
        states = {k: self._whole_state(k, res, start) for k, res in results.items()}
        weights = {k: float(res.samples) for k, res in results.items()}
        norms = update_norms(states, start)
        scale = self.judge.scale(norms, start)[0]
        accepted = self._refuse(self.judge.refusals(norms, start), states)
        kept, outliers = screen_updates(accepted, start, action=star_options(config).outliers,
                                        limit=star_options(config).outlier_limit, norms=norms)
        for k, ratio in sorted(outliers.items()):
            log.warning("device %d's update is %.3g x the round's median: %s", k, ratio,
                        "dropped" if k not in kept else "clipped")
        self.replicas.roll_back(sorted(outliers))
        self.refused.extend(sorted(outliers))
        if not kept or sum(weights[k] for k in kept) == 0:
            return
        if (warning := untrimmed_warning(config, len(kept))) and warning not in self._untrimmed:
            self._untrimmed.add(warning)  # once per count of models
            log.warning("%s", warning)
        self._probe_once()
        state, left_out = judged_aggregate(
            kept, weights, norms, start, judge=self.judge, scale=scale,
            combine=lambda some: strategy_aggregate(self.strategy, start, some, weights,
                                                    self.frozen))
        self._refuse(left_out, kept)
        if state is None:
            log.warning("no aggregate of devices %s passes the judge: the model stays the "
                        "round's start", sorted(set(kept) - set(left_out)))
            self.replicas.roll_back(sorted(kept))
            return
        self.judge.accept(norms[k] for k in kept if k not in left_out)
        self.model.load_state_dict(state)
        self.judge.installed()
        self.strategy.installed()

    def _probe_once(self) -> None:
        """Give the judge the coordinator's evaluation batch (the first `PROBE_SAMPLES`
        of its test set), once, when it has one (compute thread, or before the run's
        rounds: `prepare`)."""
        test_set = self.setup.test_set
        if self.judge.probe is not None or test_set is None or not len(test_set):
            return
        batch = test_set.batch(range(min(PROBE_SAMPLES, len(test_set))))
        self.judge.probe = evaluation_probe(self.model, self.loss, batch)

    def _refuse(self, refusals: Mapping[int, str],
                states: Mapping[int, dict[str, torch.Tensor]]
                ) -> dict[int, dict[str, torch.Tensor]]:
        """``states`` without the refused devices', who are named (log, `refused`) and
        whose replicas go back to the round's start (compute thread)."""
        for k, reason in sorted(refusals.items()):
            log.warning("device %d's update is refused: %s", k, reason)
        self.replicas.roll_back(sorted(refusals))
        self.refused.extend(sorted(refusals))
        return {k: state for k, state in states.items() if k not in refusals}

    def _adopt(self, k: int, result: RoundResult) -> None:
        """SL: the next device starts from this device's weights, if the judge accepts
        them ([Note: judging updates]; else from the weights this device started from)."""
        start = self.model.state_dict()
        state = self._whole_state(k, result, start)
        norms = update_norms({k: state}, start)
        refusals = self.judge.refusals(norms, start)
        if not refusals:
            self._probe_once()
            problem = self.judge.aggregate_problem(state, start, self.judge.scale(norms, start)[0],
                                                   self.judge.loss_ceiling(start))
            refusals = {k: f"the model it hands on was refused: {problem}"} if problem else {}
        if self._refuse(refusals, {k: state}):
            self.judge.accept(norms.values())
            self.model.load_state_dict(state)
            self.judge.installed()

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The global model, each device's replica momentum (a replica starts every
        round from the global model: [Note: replicas while training]) and the strategy's
        state (``strategy/<name>``: a server optimizer's moments)."""
        whole = self.model.state_dict()
        tensors = {f"model/{k}": v.detach().clone() for k, v in whole.items()}
        tensors.update(self.replicas.checkpoint_tensors(
            [p.split_point for p in self.plans]))
        tensors.update({f"strategy/{k}": v for k, v in self.strategy.state_dict().items()})
        return {**tensors, **self.privacy.tensors()}

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Load a checkpoint's model, plans ("auto": the ones the run had re-chosen),
        replica momentum and strategy state."""
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        self.judge.forget()
        self.strategy.load_state_dict({k[9:]: v for k, v in tensors.items()
                                       if k.startswith("strategy/")})
        self.privacy.restore(tensors)
        planned = {"split_point": config["split_point"],
                   "parallel_batches": config["parallel_batches"]}
        if self.given.mode == "auto":  # the system and plans the checkpoint ran, no look
            mode = str(config["mode"])
            resumed = system_config(self.given, mode).replace(**planned)
            self.second_look = None
            self._switch_system(self.given, mode, [
                (p.split_point, p.parallel_batches)
                for p in device_plans(resumed, self.units, self.samples)])
        elif self.auto_config is not None:  # go on with the plans the run had (re-)chosen
            resumed = self.config.replace(**planned)
            self._switch_plans([(p.split_point, p.parallel_batches)
                                for p in device_plans(resumed, self.units, self.samples)])
        self.replicas.restore(tensors, [p.split_point for p in self.plans])

    def resumed_config(self, mode: str) -> RunConfig:
        """Mode auto: the run's config as it runs ``mode`` (one of its candidates), what
        its checkpoints hold ([Note: re-choosing the system]); else the run's own."""
        if (self.given.mode == "auto"
                and mode in self.given.options_as(AutoOptions).candidates):
            return system_config(self.given, mode)
        return self.config


# Note [frozen bases]
# ~~~~~~~~~~~~~~~~~~~
# A parameter with ``requires_grad`` false (a frozen base under a fine-tuned head or an
# adapter) never changes: no optimizer steps it. Every node builds the model alike (the
# digests agree), so every node holds it already, and in fl, sl, sfl and pipar it does
# not travel: a `RoundStart` leaves it out of the device's half, the device's upload
# leaves it out, and the stage loads what it was sent around it (`load_stage_state`,
# which refuses any other missing tensor). The coordinator aggregates the whole models
# with the frozen parameters as the round began (`_whole_state`); every built-in
# aggregation keeps equal tensors exact (FedAvg sums in float64; the median, the trimmed
# mean and Krum pick values), so a frozen base stays bit for bit, as
# tests/runtime/test_runtime_frozen_bases.py checks. The other systems do the same
# (tests/runtime/test_runtime_frozen_systems.py): the pipeline's, FTPipeHD's and
# Asteroid's stage states (`Pipeline._stage_state`, `stage_snapshot`), FTPipeHD's chain
# replicas and Asteroid's backups (`expected_tensors`), Asteroid's group gradients
# (`gradients_of`) and HADFL's ring chunks, averages and backups (`flat_state`) leave
# them out; FTPipeHD's hand-written SGD keeps no version or momentum of them, and
# Asteroid's planner counts no gradient or optimizer state for them (`HppModel`).
