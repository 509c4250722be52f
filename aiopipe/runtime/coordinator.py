"""The coordinator: admits devices, drives rounds and epochs, evaluates and records.

It is the same for every system; what differs (placement, what devices are told, the
coordinator's own stages, how results become the model) is the `System` chosen once from
``config.mode`` (`aiopipe.runtime.systems`). Its parts, each one idea:
- `Admission` (aiopipe/runtime/admission.py): hellos, sessions, connections;
- `DeviceSession` (session.py): one device's connection, rounds, and the stage the
  coordinator runs for it;
- the announced fleet and its plan (fleet_plan.py), what the run is set up from
  (run_setup.py);
- the system's rounds, played through `SystemRounds` (system_rounds.py), and
  `after_round` (re-planning);
- `Checkpoints` (checkpoint.py): checkpoints written while training goes on; what
  they hold besides tensors, and resuming (resume.py);
- the epoch loop here: rounds, tallies and the metrics they become (epoch_figures.py),
  evaluation on the held-out test set; the coordinator's own failures
  (server_faults.py) and what a run that ends early keeps (endings.py).

In the split modes (PiPar's server) the coordinator is also a stage host: its compute
queue runs every device's server half; in a pipeline it runs no stage and is off the
data path.

[Note: the devices' data] The coordinator opens no training data. The run's kind of data
(the input shape and classes the model is built for) comes from ``config.dataset``'s
name (or, for a ``module:function``, from its test split), and the coordinator's
evaluation set is ``test_samples`` of that test split. Each device, once it has its
`Plan`, opens its own data and announces it (`Ready`); the coordinator checks it against
the run (`announce`), and once every device has, the system plans from the announced
sample counts (and, with "auto" on real clocks, from the devices' own profiles:
aiopipe.runtime.profiling [Note: device profiles]) before the first round (`_prepare`).
Until then each connection may carry frames up to `frame_cap` (run_setup.py); after,
the plan's limit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from aiopipe import models
from aiopipe.auth import new_run_secret
from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, PoisonedValueError, RefusedError, TrainingError
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import (
    TRAINING_FINISHED,
    Activation,
    EvalRequest,
    Gradient,
    Hello,
    Plan,
    Ready,
    Replica,
    RoundResult,
    RoundStart,
    state_to_wire,
)
from aiopipe.runtime.acknowledgements import Draws
from aiopipe.runtime.admission import Admission
from aiopipe.runtime.assignment import Assignment
from aiopipe.runtime.checkpoint import Checkpoints
from aiopipe.runtime.compute import Compute, resolve_torch_device, warm_up_torch
from aiopipe.runtime.endings import finite_state, keep_unfinished
from aiopipe.runtime.epoch_figures import (
    add_round,
    busy_by_kind,
    epoch_metrics,
    link_bytes,
    new_tally,
    peer_bytes,
    privacy_status,
    served_in_epoch,
)
from aiopipe.runtime.evaluation import held_out_accuracy, test_accuracy
from aiopipe.runtime.exclusion import Exclusions
from aiopipe.runtime.factories import build_model, make_loss, make_metric
from aiopipe.runtime.fleet_plan import (
    announcement_refusal,
    fleet_profiles,
    log_fleet_plan,
    shared_announcement,
)
from aiopipe.runtime.judge import ArrivalJudge
from aiopipe.runtime.resume import checkpoint_meta, read_resumable
from aiopipe.runtime.resume import epoch_from as _epoch_from  # (tests import it here)
from aiopipe.runtime.run_setup import check_tables, cut_priors, evaluation_data, frame_cap
from aiopipe.runtime.server_faults import ServerFaults
from aiopipe.runtime.startup import Startup
from aiopipe.runtime.system_rounds import SystemRounds
from aiopipe.runtime.systems.base import Setup, System, system_for
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link
from aiopipe.wording import plural

__all__ = ["Coordinator"]

log = logging.getLogger("aiopipe.server")

#: The latest changes ``/status`` lists (re-plans, recoveries, HADFL's rounds).
STATUS_CHANGES = 50

#: `Bye.reason` when the server's run is cancelled (Ctrl-C of ``python -m aiopipe.server``).
INTERRUPTED = "the server was interrupted"


class Coordinator:
    """Coordinator (and, in the split modes, stage host) of one run.

    Args:
        config: the run; "auto" plans are resolved by the system, and ``self.config`` is
            the resolved config that devices receive.
        clock: the node's clock.
        cost_table: charge compute from this table (virtual-time simulation); also what
            planners plan with. Without it, "auto" measures one on this machine.
        join_timeout: seconds to wait for every device to say hello.
        progress: called with each finished epoch's metrics.
        checkpoint_dir: write a checkpoint there after every round (atomically).
        resume: continue from the checkpoint in ``checkpoint_dir``; the config must be
            the one it was written for.
        torch_device: where the coordinator's own stages compute (PiPar's server halves):
            "auto", "cpu", "cuda" or "cuda:N" (`resolve_torch_device`).
        server_cost_table: with ``cost_table``, charge the coordinator's own stages
            from this table instead (the server's hardware measured apart, e.g. a GPU's:
            `bench/gpu_costs.py`); the devices keep ``cost_table``.
        rest_idle_links: rest the link of each device in no round of a run that samples
            devices ([Note: idle links rest]): `aiopipe.simulate` does, a `Server` not.

    Raises:
        ConfigError: the config cannot run, or there is no checkpoint to resume from.
    """

    def __init__(self, config: RunConfig, *, clock: Clock, cost_table: CostTable | None = None,
                 join_timeout: float = 300.0,
                 progress: Any = None, checkpoint_dir: Path | None = None,
                 resume: bool = False, torch_device: str = "cpu",
                 server_cost_table: CostTable | None = None,
                 rest_idle_links: bool = False) -> None:
        warm_up_torch()
        torch.set_num_threads(config.torch_threads)  # as every device does
        self.clock = clock
        self.startup = Startup(clock)  # [Note: startup figures]
        self.cost_table = cost_table
        self.join_timeout = join_timeout
        self.progress = progress
        # [Note: the devices' data] the run's kind of data, from the dataset's name (or
        # its test split); training data is the devices' own
        self.data, self.test_set = evaluation_data(config)
        self.loss, self.metric = make_loss(config), make_metric(config)
        model = build_model(config, num_classes=self.data.classes, in_shape=self.data.in_shape)
        check_tables(models.unit_count(model), cost_table=cost_table,
                     server_cost_table=server_cost_table)
        self.model_digest = models.model_digest(model)
        #: names the run in every stage-addressed message
        self.run_id = (1 << 61) | secrets.randbits(61)  # 9 bytes in msgpack: frame sizes fixed
        self.torch_device = resolve_torch_device(torch_device)
        self.system: System = system_for(Setup(config, model, self.data, self.test_set,
                                               cost_table, new_run_secret(),
                                               self.torch_device, server_cost_table))
        #: what each device announced it holds (`Ready`), by id
        self.announced: dict[int, Ready] = {}
        #: what each device measured of itself, by id (``/status``)
        self.profiled: dict[int, dict[str, float | None]] = {}
        self.prepared = False  # the system has planned for the announced fleet
        self.max_frame_bytes = frame_cap(config, model, self.data)
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, "server/compute",
                               charge_costs=cost_table is not None,
                               lanes=self.system.server_lanes)
        self.rests_idle_links = rest_idle_links and config.round_size(  # (sampled runs)
            config.devices) < config.devices
        self.admission = Admission(self)
        self.exclusions = Exclusions(config.byzantine_devices)
        #: judges the values devices send the coordinator's stages ([Note: judging
        #: arrivals]); its priors come from the initial model on the evaluation set
        self.arrival_judge = ArrivalJudge(limit=config.scale_limit, others_as_prior=True)
        self.sessions = self.admission.sessions
        self.draws = Draws(config, self.sessions)  # [Note: sampling per round]
        self.connected = self.admission.connected
        self.joined = self.admission.joined
        #: the coordinator's own work failing ([Note: server faults]); train() raises it
        self.faults = ServerFaults()
        self.epoch = -1
        self.finished = False  # train() has returned: no more admissions
        self._epoch_start = 0.0
        self.epochs: list[EpochMetrics] = []
        #: the global model as the last finished epoch left it, if finite ([Note: results
        #: on every ending] in aiopipe/metrics/results.py)
        self.last_good: dict[str, torch.Tensor] | None = None
        self._served_before_round = 0  # micro-batches of the epoch's earlier rounds
        #: per device, in this process: rounds completed, and for the current and the
        #: previous epoch its summed training loss and samples (`count_round`, /metrics)
        self.device_rounds: dict[int, int] = {}
        self.device_loss: dict[int, dict[int, tuple[float, int]]] = {}
        self._tally: dict[str, Any] = {}
        if not self.system.resumable:
            if resume:
                self.system.restore({}, {})  # raises, saying why
            checkpoint_dir = None  # nothing a run could resume from
        self.checkpoints = Checkpoints(checkpoint_dir, clock=clock, compute=self.compute,
                                       tensors=self.system.checkpoint_tensors)
        #: what the system's rounds play through; it numbers rounds and records changes
        self.system_rounds = SystemRounds(self.system, self.admission, self.checkpoints,
                                          clock=clock, compute=self.compute,
                                          cost_table=cost_table, recorder=self.recorder)
        self.replans = self.system_rounds.replans
        self._resume: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        if resume:
            if checkpoint_dir is None:
                raise ConfigError("resuming needs the checkpoint directory")
            self._resume = read_resumable(checkpoint_dir, self.system)

    @property
    def config(self) -> RunConfig:
        """The run's config, "auto" resolved (and re-planned): what devices receive."""
        return self.system.config

    @property
    def model(self) -> torch.nn.Sequential:
        """The global model."""
        return self.system.model

    @property
    def rounds(self) -> int:
        """Rounds numbered so far (a round played again after a fault takes one)."""
        return self.system_rounds.played

    # -- what admission and sessions ask -----------------------------------------------

    async def serve_link(self, link: Link, *, device_id: int | None = None,
                         admitted: Callable[[int], None] | None = None) -> None:
        """Run one device connection from hello to goodbye (see `Admission.serve_link`);
        ``admitted``: called with the device's id once its hello is taken (the link's
        owner then lifts pre-hello limits and shapes the downlink).

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection failed.
        """
        await self.admission.serve_link(link, device_id=device_id, admitted=admitted)

    async def wait_disconnected(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until every device connection has closed; whether
        they all did."""
        return await self.admission.wait_disconnected(seconds)

    def plan_for(self, device_id: int, session: int) -> Plan:
        """The `Plan` answering device ``device_id``'s hello."""
        return Plan(device_id, self.config.mode, self.config.to_mapping(), self.run_id,
                    server_time=self.clock.now(), session=session,
                    peer_keys=self.system.peer_keys(device_id), inputs=self.data.inputs,
                    target=(self.data.target,), num_classes=self.data.classes)

    def refuse_hello(self, hello: Hello) -> str:
        """Why the system cannot take this device ("" when it can): it was excluded, or
        its system says so."""
        return self.exclusions.refusal(hello.device_id) or self.system.refuse_hello(hello)

    def announce(self, device_id: int, ready: Ready) -> None:
        """Device ``device_id`` has set up ([Note: the devices' data]): take what it
        holds once it fits the run; the run starts when every device has.

        Raises:
            RefusedError: its data or model do not fit the run (it is told why).
        """
        problem = announcement_refusal(
            device_id, ready, data=self.data,
            model_digest=self.model_digest, dataset=self.config.dataset,
            planned=self.system_samples if self.prepared else None)
        if problem:
            raise RefusedError(problem)
        if device_id not in self.announced:
            log.info("device %d joined: %s", device_id, plural(ready.samples, "sample"))
        self.announced[device_id] = shared_announcement(ready, self.data, self.model_digest)
        if len(self.announced) == self.config.devices:
            self.joined.set()

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """A replica nobody asked for: the system's to judge (`System.unasked_replica`)."""
        self.system.unasked_replica(device_id, replica, start)

    def accuse(self, accuser: int, culprit: int, reason: str) -> None:
        """Device ``accuser`` refused what its neighbour ``culprit`` sent this round:
        exclude whom `Exclusions.accuse` says, like a lost device ([Note: judging
        arrivals])."""
        verdict = self.exclusions.accuse(accuser, culprit, reason)
        if verdict is not None:
            self._excluded(*verdict)

    def judge_data(self, device_id: int, message: Activation | Gradient,
                   assignment: Assignment) -> None:
        """Judge the values device ``device_id`` sent the coordinator's stage against the
        cut's scale. A refusal ends its session, as any broken protocol does, and
        excludes it, as a device a neighbour names is ([Note: judging arrivals]).

        Raises:
            PoisonedValueError: out of range, or not finite.
        """
        try:
            self.arrival_judge.judge_data(f"device{device_id}", message,
                                          first_unit=assignment.first_unit,
                                          stop_unit=assignment.stop_unit)
        except PoisonedValueError as error:
            why = f"the coordinator refused what it sent: {error}"
            if self.exclusions.exclude(device_id, why):
                self._excluded(device_id, why, dismiss=False)
            raise

    def _excluded(self, device: int, why: str, *, dismiss: bool = True) -> None:
        """``device`` is excluded for ``why``: logged, counted in the epoch's figures,
        and (``dismiss``) its session ended with the reason."""
        log.warning("device %d is excluded from the run: %s", device, why)
        tally = self._tally
        tally["excluded"] = sorted({*tally.get("excluded", ()), device})
        session = self.sessions.get(device)
        if session is not None and dismiss:
            session.dismiss(f"excluded: {why}", f"excluded from the run: {why}")

    def server_failed(self, device_id: int, error: BaseException) -> None:
        """[Note: server faults] The coordinator's own work for a device failed (a pass
        that ran out of memory, a bug). That is not the device's doing, and it would
        happen again: the device would reconnect, resend, and fail the same pass, for
        ever. So the device's session ends, the error is logged with its traceback once,
        the device is told why, and the run stops with a `TrainingError` naming it
        (`ServerFaults`)."""
        failure = self.faults.fail(device_id, error)
        session = self.sessions.get(device_id)
        if session is not None:
            session.dismiss(str(failure), f"training failed: {failure}")

    # -- training ---------------------------------------------------------------------

    async def train(self) -> RunResult:
        """Wait for every device, run every epoch, say goodbye; the run's result.

        Raises:
            TrainingError: devices did not join in time, or the run could not go on.
        """
        origin = self.clock.now()
        reason = TRAINING_FINISHED
        try:
            try:
                await self.faults.unless_failed(  # (a plan that could not be made)
                    wait_for(self.clock, self.joined.wait(), self.join_timeout))
            except TimeoutError:
                missing = sorted(set(range(self.config.devices)) - set(self.announced))
                raise TrainingError(f"devices {missing} did not join within "
                                    f"{self.join_timeout:g} s") from None
            self.startup.joined()
            if not self.prepared:
                await self._prepare()
            origin = self.system_rounds.origin = self.clock.now()
            for epoch in range(len(self.epochs), self.config.epochs):
                done = await self.faults.unless_failed(self._epoch(epoch))
                self.epochs.append(self.startup.stamp(done, self.recorder.slices))
                await self._keep_good_model()
                if self.progress is not None:
                    self.progress(self.epochs[-1])
                await self._checkpoint(epoch + 1, 0, 0.0, epoch)
            await self.checkpoints.written()
        except asyncio.CancelledError as exc:
            # Ctrl-C, or the embedding service cancelled the run (with its reason, if any)
            reason = str(exc.args[0]) if exc.args else INTERRUPTED
            raise
        except BaseException as exc:
            reason = f"training failed: {exc}"
            raise
        finally:
            self.finished = True
            for session in self.sessions.values():
                if not session.closing and not session.ended:
                    session.say_bye(reason)
            try:  # training failed: let the checkpoint in flight (or pending) end
                await self.checkpoints.written()
            except Exception as exc:  # the failure being raised wins
                log.error("the last checkpoint could not be written: %s", exc)
            self.compute.close()
            if reason != TRAINING_FINISHED:  # [Note: results on every ending]
                keep_unfinished(self.config, self.epochs, self.last_good, reason)
        return RunResult(self.config, list(self.epochs), self.model,
                         list(self.recorder.slices), origin)

    async def _keep_good_model(self) -> None:
        """Copy the global model as the epoch just finished left it, unless a weight is
        not finite ([Note: results on every ending] in aiopipe/metrics/results.py)."""
        state = await self.compute.call(partial(finite_state, self.model))
        if state is None:
            log.warning("epoch %d left non-finite weights: a failed run would keep the model "
                        "of an earlier epoch", len(self.epochs))
            return
        self.last_good = state

    async def _prepare(self) -> None:
        """Plan for the fleet as announced (off the event loop: planning may profile;
        time held still meanwhile in virtual time), then resume from a checkpoint if
        asked to; from now on each device's frames are held to the plan's limit."""
        self.system_samples = [self.announced[k].samples for k in range(self.config.devices)]
        devices = None
        if self.system.wants_profiles:  # what each device says goes to ``/status``
            with self.startup.timed("profiling_s"):
                devices, self.profiled = await fleet_profiles(
                    self.system, self.system_samples, self.announced, self.sessions,
                    units=models.unit_count(self.model), clock=self.clock)
        with self.clock.hold(), self.startup.timed("planning_s"):
            await asyncio.to_thread(self.system.prepare, self.system_samples, devices)
            if self.system.serves_stages and self.test_set is not None and len(self.test_set):
                rows = min(self.system.micro_batch_sizes(self.config))
                self.arrival_judge.set_cut_priors(await asyncio.to_thread(
                    cut_priors, self.config, self.model, self.test_set, rows))
        self.prepared = True
        if self._resume is not None:
            tensors, meta = self._resume
            await self.compute.call(partial(self.system.restore, tensors, meta["config"]))
            self._resume_counters(meta)
            self._resume = None
            # the checkpoint's model is the good one until an epoch finishes here
            self.last_good = await self.compute.call(partial(finite_state, self.model))
        limit = self.max_frame_bytes = min(self.system.frame_limit(), self.max_frame_bytes)
        for session in self.sessions.values():  # new connections get it from admission
            session.peer.max_frame_bytes = limit
        log_fleet_plan(log, self.system, units=models.unit_count(self.model),
                       samples=self.system_samples)

    async def _epoch(self, epoch: int) -> EpochMetrics:
        self.epoch = epoch
        start = self._epoch_start = self.clock.now()
        traffic_before = link_bytes(self.sessions)
        system, devices = self.system, self.config.devices
        peers_before = peer_bytes(self.sessions, devices)
        iterations = [system.iterations(k) for k in range(devices)]
        period = (system.round_iterations or self.config.aggregation_every
                  or max(iterations))
        tally = self._tally if self._tally.get("epoch") == epoch else new_tally(epoch, devices)
        self._tally = tally
        round_count = math.ceil(max(iterations) / period)
        self._served_before_round = 0
        changes_before = len(self.replans)
        for r in range(int(tally["next_round"]), round_count):
            first = r * period
            round_no = self.system_rounds.new_round()
            work = [max(0, min(period, n - first)) for n in iterations]
            participants = await self._participants()
            tally["present"] = sorted({*tally.get("present", ()), *participants})
            if self.config.devices_per_round:  # [Note: sampling per round]
                participants = self.draws.draw(epoch, r, participants, tally)
            mark = len(self.recorder.slices)
            done = await system.run_round(self.system_rounds, round_no, epoch, first, work,
                                          participants)
            add_round(tally, participants, done, system.refused_updates())
            for k, result in done.items():
                self.count_round(epoch, k, result)
            tally["next_round"] = r + 1
            if r + 1 < round_count or epoch + 1 < self.config.epochs:
                await self._after_round(round_no, epoch, mark)
            if r + 1 < round_count:  # after the last one, `train` checkpoints the epoch
                await self._checkpoint(epoch, r + 1, self.clock.now() - start, epoch)
        end = self.clock.now()
        traffic = _minus(link_bytes(self.sessions), traffic_before)
        accuracy = await self.compute.call(partial(test_accuracy, self.model, self.test_set,
                                                   self.loss, self.metric))
        held_out = await self._evaluate_on_devices(epoch)
        return epoch_metrics(
            epoch, tally, system, elapsed=end - start + float(tally["elapsed_before"]),
            by_track=self.recorder.busy_by_track(start, end), traffic=traffic,
            accuracy=accuracy, held_out=held_out, sessions=self.sessions,
            changes=self.replans[changes_before:], last=self.epochs[-1] if self.epochs else None,
            peers=_minus(peer_bytes(self.sessions, devices), peers_before))

    def epoch_progress(self) -> tuple[int, int]:
        """(micro-batches the server's stage has computed in the epoch under way, how many
        the epoch has) for a progress display; ``(0, 0)`` where the server computes no
        micro-batches (fl, a pipeline) or before training."""
        if not self.system.serves_stages or not self.prepared:
            return 0, 0
        total = served_in_epoch(self.system)
        done = self._served_before_round + sum(s.served for s in self.sessions.values())
        return min(done, total), total

    def count_round(self, epoch: int, device_id: int, result: RoundResult) -> None:
        """Device ``device_id`` completed a round of ``epoch``: count it and its loss
        (``device_rounds``, ``device_loss``; read by ``/metrics``)."""
        self.device_rounds[device_id] = self.device_rounds.get(device_id, 0) + 1
        losses = self.device_loss.setdefault(epoch, {})
        loss_sum, samples = losses.get(device_id, (0.0, 0))
        losses[device_id] = (loss_sum + result.loss_sum, samples + result.samples)
        self.device_loss.pop(epoch - 2, None)  # kept: the current and the previous epoch

    async def _evaluate_on_devices(self, epoch: int) -> tuple[float, dict[str, float]]:
        """The global model on the held-out data of the devices that take part and
        announced some (aiopipe.runtime.evaluation)."""
        asked = {k: self.sessions[k].evaluate for k in self.admission.alive()
                 if k in self.announced and self.announced[k].held_out > 0}
        if not asked:
            return math.nan, {}
        tensors = await self.compute.call(lambda: state_to_wire(
            {key: v.detach().clone() for key, v in self.model.state_dict().items()}))
        return await held_out_accuracy(asked, EvalRequest(epoch, tensors), clock=self.clock,
                                       timeout=self.config.device_timeout)

    async def _after_round(self, round_no: int, epoch: int, mark: int) -> None:
        devices = self.config.devices
        served = [self.sessions[k].served if k in self.sessions else 0 for k in range(devices)]
        self._served_before_round += sum(served)
        paced = [k not in self.sessions or self.sessions[k].peer.link.times_the_wire()
                 for k in range(devices)]
        change = await self.system.after_round(self.system_rounds, round_no, epoch,
                                               self.recorder.take(mark), served, paced)
        if change is not None:
            self.system_rounds.record_change(change)

    async def _participants(self) -> list[int]:
        """Devices taking part (connected, or reconnecting within reconnect_grace); if none,
        wait (join_timeout) for one to come back.

        Raises:
            TrainingError: every device was lost and none returned in time.
        """
        if not self.admission.alive():
            log.warning("every device was lost; waiting up to %g s for one to rejoin",
                        self.join_timeout)
            self.checkpoints.copy()  # no round is coming soon: save now
            try:
                await wait_for(self.clock, self.admission.wait_for_someone(),
                               self.join_timeout)
            except TimeoutError:
                raise TrainingError(f"every device was lost and none rejoined within "
                                    f"{self.join_timeout:g} s") from None
        return self.admission.alive()

    # -- checkpoints ---------------------------------------------------------------------

    async def _checkpoint(self, epoch: int, next_round: int, elapsed: float,
                          traced_epoch: int) -> None:
        """Checkpoint (when the run keeps checkpoints) before ``epoch``'s round
        ``next_round``; the copy is traced in ``traced_epoch``."""
        if self.checkpoints.directory is not None:  # (the meta is O(devices x epochs))
            await self.checkpoints.save(self._checkpoint_meta(epoch, next_round, elapsed),
                                        traced_epoch)

    def _checkpoint_meta(self, epoch: int, next_round: int, elapsed: float) -> dict[str, Any]:
        """What a checkpoint holds besides tensors (aiopipe.runtime.resume)."""
        return checkpoint_meta(self.config, epoch=epoch, next_round=next_round,
                               elapsed=elapsed, rounds=self.rounds, tally=self._tally,
                               epochs=self.epochs)

    def _resume_counters(self, meta: Mapping[str, Any]) -> None:
        """Where training stood at the checkpoint: rounds, finished epochs, the tally."""
        self.system_rounds.played = int(meta["rounds"])
        self.epochs = [_epoch_from(e) for e in meta.get("epochs", [])]
        tally = dict(meta["tally"])
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0))
        self._tally = tally

    # -- status --------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Live state for ``GET /status``: devices, plan, progress, and the busy fraction of
        each resource kind in the epoch so far (device figures are means over devices;
        device-side work is known once a device reports its round)."""
        now = self.clock.now()
        live: dict[str, float] = {}
        if self.epoch >= 0 and now > self._epoch_start:
            elapsed = now - self._epoch_start
            by_track = self.recorder.busy_by_track(self._epoch_start, now)
            live = {kind: round(busy / elapsed, 4)
                    for kind, busy in busy_by_kind(by_track, self.config.devices).items()}
        return {
            "mode": self.system.config.mode,  # (mode auto's choice, once it is made)
            "devices": self.config.devices,
            "joined": sorted(self.sessions), "connected": sorted(self.connected),
            "epoch": self.epoch + 1, "round": self.rounds,  # people count from 1; 0: none yet
            "epochs": self.config.epochs,
            "busy_fraction": live,
            "plan": self.system.plan_entries(),
            "profiles": {str(k): v for k, v in sorted(self.profiled.items())},
            "replans": self.replans[-STATUS_CHANGES:],  # (hadfl: one a round)
            # devices whose update was refused, clipped or dropped in the epoch under way
            # (or the last one): [Note: judging updates]
            "updates_refused": list(self._tally.get("refused", ())),
            # devices excluded from the run, and why ([Note: whose word excludes])
            "excluded": {str(k): why for k, why in self.exclusions.excluded.items()},
            # differential privacy spent by the last finished epoch's end (null: none)
            "privacy": privacy_status(self.epochs[-1] if self.epochs else None),
            "finished_epochs": [e.to_mapping() for e in self.epochs],
        }


def _minus(now: Sequence[int], before: Sequence[int]) -> tuple[int, ...]:
    """Counts ``now`` less what they were ``before``, one by one."""
    return tuple(a - b for a, b in zip(now, before, strict=True))
