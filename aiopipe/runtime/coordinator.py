"""The coordinator: admits devices, drives rounds and epochs, evaluates and records.

It is the same for every system; what differs (placement, what devices are told, the
coordinator's own stages, how results become the model) is the `System` chosen once from
``config.mode`` (`aiopipe.runtime.systems`). Its parts, each one idea:
- `Admission` (aiopipe/runtime/admission.py): hellos, sessions, connections;
- `DeviceSession` (session.py): one device's connection, rounds, and the stage the
  coordinator runs for it;
- the system's rounds, and `after_round` (re-planning);
- `Checkpoints` (checkpoint.py): checkpoints written while training goes on;
- the epoch loop here: rounds, tallies, metrics, evaluation on the held-out test set.

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
Until then each connection may carry frames up to `_frame_cap`; after, the plan's limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import secrets
from collections.abc import Callable, Coroutine, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from aiopipe import data as datasets
from aiopipe import models
from aiopipe.auth import new_run_secret
from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import (
    ConfigError,
    DeviceLostError,
    RefusedError,
    TrainingError,
)
from aiopipe.metrics.results import EpochMetrics, RunResult, write_unfinished
from aiopipe.metrics.trace import (
    MAX_REPORT_SLICES,
    REPORT_SLICE_BYTES,
    RESOURCE_KINDS,
    Recorder,
    resource_kind,
)
from aiopipe.protocol import (
    TRAINING_FINISHED,
    EvalRequest,
    Hello,
    Plan,
    Ready,
    Replica,
    ReplicaRequest,
    RoundResult,
    RoundStart,
    TensorData,
    state_to_wire,
)
from aiopipe.runtime.admission import Admission
from aiopipe.runtime.checkpoint import Checkpoints, load_checkpoint
from aiopipe.runtime.compute import Compute, resolve_torch_device, warm_up_torch
from aiopipe.runtime.evaluation import held_out_accuracy, test_accuracy
from aiopipe.runtime.exclusion import Exclusions
from aiopipe.runtime.factories import build_model
from aiopipe.runtime.plan import declared_devices
from aiopipe.runtime.plan_text import log_plan
from aiopipe.runtime.profiling import profile_fleet
from aiopipe.runtime.sampling import sampled_devices
from aiopipe.runtime.stage import ServerStage
from aiopipe.runtime.systems import Setup, System, planning_batch_sizes, system_for
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.transport import Link
from aiopipe.wording import plural

__all__ = ["Coordinator"]

log = logging.getLogger("aiopipe.server")

#: The latest changes ``/status`` lists (re-plans, recoveries, HADFL's rounds).
STATUS_CHANGES = 50

#: `Bye.reason` when the server's run is cancelled (Ctrl-C of ``python -m aiopipe.server``).
INTERRUPTED = "the server was interrupted"

T = TypeVar("T")


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

    Raises:
        ConfigError: the config cannot run, or there is no checkpoint to resume from.
    """

    def __init__(self, config: RunConfig, *, clock: Clock, cost_table: CostTable | None = None,
                 join_timeout: float = 300.0,
                 progress: Any = None, checkpoint_dir: Path | None = None,
                 resume: bool = False, torch_device: str = "cpu",
                 server_cost_table: CostTable | None = None) -> None:
        warm_up_torch()
        torch.set_num_threads(config.torch_threads)  # as every device does
        self.clock = clock
        self.cost_table = cost_table
        self.join_timeout = join_timeout
        self.progress = progress
        # [Note: the devices' data] the run's kind of data, from the dataset's name (or
        # its test split); training data is the devices' own
        self.in_shape, self.num_classes, self.test_set = _evaluation_data(config)
        model = build_model(config, num_classes=self.num_classes, in_shape=self.in_shape)
        _check_tables(models.unit_count(model), cost_table=cost_table,
                      server_cost_table=server_cost_table)
        self.model_digest = models.model_digest(model)
        #: names the run in every stage-addressed message
        self.run_id = (1 << 61) | secrets.randbits(61)  # 9 bytes in msgpack: frame sizes fixed
        self.torch_device = resolve_torch_device(torch_device)
        self.system: System = system_for(Setup(config, model, self.in_shape, self.num_classes,
                                               self.test_set, cost_table, new_run_secret(),
                                               self.torch_device, server_cost_table))
        #: what each device announced it holds (`Ready`), by id
        self.announced: dict[int, Ready] = {}
        #: what each device measured of itself, by id (``/status``)
        self.profiled: dict[int, dict[str, float | None]] = {}
        self.prepared = False  # the system has planned for the announced fleet
        self.max_frame_bytes = _frame_cap(config, model, self.in_shape)
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, "server/compute",
                               charge_costs=cost_table is not None, lanes=config.server_lanes)
        self.admission = Admission(self)
        self.exclusions = Exclusions(config.byzantine_devices)
        self.sessions = self.admission.sessions
        self.connected = self.admission.connected
        self.joined = self.admission.joined
        #: why the coordinator's own work failed ([Note: server faults]); train() raises it
        self.failure: TrainingError | None = None
        self._failed = asyncio.Event()
        self.epoch = -1
        self.finished = False  # train() has returned: no more admissions
        self._epoch_start = 0.0
        self.rounds = 0
        self.epochs: list[EpochMetrics] = []
        #: the global model as the last finished epoch left it, if finite ([Note: results
        #: on every ending] in aiopipe/metrics/results.py)
        self.last_good: dict[str, torch.Tensor] | None = None
        self.replans: list[dict[str, Any]] = []
        self.origin = clock.now()  # the trace's zero: training's start
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
        self._resume: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        if resume:
            if checkpoint_dir is None:
                raise ConfigError("resuming needs the checkpoint directory")
            self._resume = self._read_checkpoint(checkpoint_dir)

    @property
    def config(self) -> RunConfig:
        """The run's config, "auto" resolved (and re-planned): what devices receive."""
        return self.system.config

    @property
    def model(self) -> torch.nn.Sequential:
        """The global model."""
        return self.system.model

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
                    peer_keys=self.system.peer_keys(device_id), in_shape=self.in_shape,
                    num_classes=self.num_classes)

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
        problem = self._refusal(device_id, ready)
        if problem:
            raise RefusedError(problem)
        if device_id not in self.announced:
            log.info("device %d joined: %s", device_id, plural(ready.samples, "sample"))
        self.announced[device_id] = ready
        if len(self.announced) == self.config.devices:
            self.joined.set()

    def _refusal(self, k: int, ready: Ready) -> str:
        """Why device k's announcement does not fit the run ("" when it does)."""
        if ready.in_shape != self.in_shape:
            return (f"device {k}'s inputs have shape {ready.in_shape}, the run's "
                    f"{self.in_shape} (its dataset {self.config.dataset!r})")
        if ready.num_classes > self.num_classes:
            return (f"device {k}'s labels range over {ready.num_classes} classes, the run's "
                    f"model has {self.num_classes}")
        if ready.model_digest != self.model_digest:
            return (f"device {k} built another model than the server (digest "
                    f"{ready.model_digest[:12]} against {self.model_digest[:12]}): both "
                    "must run the same model code with the same config")
        if self.prepared and ready.samples != self.system_samples[k]:
            return (f"device {k} now holds {ready.samples} samples; the run was planned "
                    f"for its {self.system_samples[k]}")
        return ""

    def address_of(self, device_id: int) -> str:
        """Where device ``device_id`` listens for peers ("" when it does not)."""
        return self.admission.addresses.get(device_id, "")

    async def settled_alive(self) -> list[int]:
        """The devices taking part, once none is between connections (waiting at most
        ``reconnect_grace`` for each to come back or be given up)."""
        deadline = self.clock.now() + self.config.reconnect_grace + 1.0
        while (set(self.admission.alive()) - self.admission.connected
               and self.clock.now() < deadline):
            await self.clock.sleep(0.05)
        return self.admission.alive()

    def new_round(self) -> int:
        """A fresh round number (a round played again after a fault takes one)."""
        self.rounds += 1
        return self.rounds - 1

    def record_change(self, change: dict[str, Any], *,
                      recovery: tuple[float, float] | None = None) -> None:
        """Keep what the system changed mid-round with its re-plans. A ``recovery``'s
        span (clock times: the fault noticed, training resumed) goes into the trace
        (track ``server/recovery``) and into the record as ``noticed_s`` and
        ``resumed_s``, seconds in the trace."""
        change = dict(change)
        if recovery is not None:
            start, end = recovery
            self.recorder.add("server/recovery", "recover", start, end,
                              epoch=int(change.get("epoch", -1)))
            change["noticed_s"], change["resumed_s"] = start - self.origin, end - self.origin
        self.replans.append(_numbered_for_people(change))

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """A replica nobody asked for: the system's to judge (`System.unasked_replica`)."""
        self.system.unasked_replica(device_id, replica, start)

    async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
        """Device ``device_id``'s answer to ``request`` (empty when it was lost, or did
        not answer within ``device_timeout``)."""
        session = self.sessions.get(device_id)
        if session is None:
            return []
        try:
            return await wait_for(self.clock, session.replicas(request),
                                  self.config.device_timeout)
        except (DeviceLostError, TimeoutError):
            return []

    def accuse(self, accuser: int, culprit: int, reason: str) -> None:
        """Device ``accuser`` refused what its neighbour ``culprit`` sent this round:
        exclude whom `Exclusions.accuse` says, like a lost device ([Note: judging
        arrivals])."""
        verdict = self.exclusions.accuse(accuser, culprit, reason)
        if verdict is None:
            return
        device, why = verdict
        log.warning("device %d is excluded from the run: %s", device, why)
        tally = self._tally
        tally["excluded"] = sorted({*tally.get("excluded", ()), device})
        session = self.sessions.get(device)
        if session is not None and not session.ended:
            session.end(f"excluded: {why}")
            if not session.closing:
                session.say_bye(f"excluded from the run: {why}")

    def server_failed(self, device_id: int, error: BaseException) -> None:
        """[Note: server faults] The coordinator's own work for a device failed (a pass
        that ran out of memory, a bug). That is not the device's doing, and it would
        happen again: the device would reconnect, resend, and fail the same pass, for
        ever. So the device's session ends, the error is logged with its traceback once,
        the device is told why, and the run stops with a `TrainingError` naming it."""
        cause = first_error(error) if isinstance(error, BaseExceptionGroup) else error
        failure = TrainingError(f"the server's work for device {device_id} failed: "
                                f"{type(cause).__name__}: {cause}")
        session = self.sessions.get(device_id)
        log.error("%s", failure, exc_info=cause)
        if self.failure is None:
            self.failure = failure
            self._failed.set()
        if session is not None and not session.ended:
            session.end(str(failure))
            if not session.closing:
                session.say_bye(f"training failed: {failure}")

    # -- what systems ask ----------------------------------------------------------------

    async def play(self, device_id: int, start: RoundStart, stage: ServerStage | None, *,
                   returns: Mapping[str, TensorData] | None = None) -> RoundResult | None:
        """Device ``device_id``'s part of a round; None when it was lost meanwhile.
        ``returns``: the tensors its result must hold, when not the ones ``start``
        sends."""
        session = self.sessions[device_id]
        if session.window is None and start.round > 0 and not self.config.devices_per_round:
            # (sampled per round, a device's first round may be any one)
            log.warning("device %d takes part again from round %d", device_id,
                        start.round + 1)
        try:
            return await session.run_round(start, stage, returns=returns)
        except DeviceLostError as exc:
            log.warning("round %d goes on without device %d: %s", start.round + 1, device_id,
                        exc)
            return None

    def session_of(self, device_id: int) -> int:
        """An id of device ``device_id``'s session (0: none): a new one when its process
        started afresh, the same across reconnections."""
        session = self.sessions.get(device_id)
        return session.nonce if session is not None and not session.ended else 0

    def copy_checkpoint(self) -> None:
        """Let a pending checkpoint's copy go now (see [Note: background checkpoints])."""
        self.checkpoints.copy()

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
                await wait_for(self.clock, self.joined.wait(), self.join_timeout)
            except TimeoutError:
                missing = sorted(set(range(self.config.devices)) - set(self.announced))
                raise TrainingError(f"devices {missing} did not join within "
                                    f"{self.join_timeout:g} s") from None
            if not self.prepared:
                await self._prepare()
            origin = self.origin = self.clock.now()
            for epoch in range(len(self.epochs), self.config.epochs):
                self.epochs.append(await self._unless_failed(self._epoch(epoch)))
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
            if reason != TRAINING_FINISHED:
                await self._keep_unfinished(reason)
        return RunResult(self.config, list(self.epochs), self.model,
                         list(self.recorder.slices), origin)

    async def _keep_good_model(self) -> None:
        """Copy the global model as the epoch just finished left it, unless a weight is
        not finite ([Note: results on every ending] in aiopipe/metrics/results.py)."""
        state = await self.compute.call(partial(_finite_state, self.model))
        if state is None:
            log.warning("epoch %d left non-finite weights: a failed run would keep the model "
                        "of an earlier epoch", len(self.epochs))
            return
        self.last_good = state

    async def _keep_unfinished(self, reason: str) -> None:
        """Training ended before its last epoch: write what the finished epochs measured,
        the last good model and ``reason`` into ``out_dir`` ([Note: results on every
        ending]); nothing when no epoch finished. A failure to write is logged (the
        run's own error goes on)."""
        out_dir = self.config.out_dir
        if not out_dir or not self.epochs:
            return
        try:  # on the loop, as the run ends: a few files, no thread to wait for
            write_unfinished(self.config, list(self.epochs), self.last_good, out_dir, reason)
        except OSError as exc:
            log.error("the finished epochs' results could not be written: %s", exc)
            return
        log.warning("%s: the metrics and model of %s are in %s", reason,
                    plural(len(self.epochs), "finished epoch"), out_dir)

    async def _prepare(self) -> None:
        """Plan for the fleet as announced (off the event loop: planning may profile;
        time held still meanwhile in virtual time), then resume from a checkpoint if
        asked to; from now on each device's frames are held to the plan's limit."""
        self.system_samples = [self.announced[k].samples for k in range(self.config.devices)]
        devices = await self._profiles() if self.system.wants_profiles else None
        with self.clock.hold():
            await asyncio.to_thread(self.system.prepare, self.system_samples, devices)
        self.prepared = True
        if self._resume is not None:
            tensors, meta = self._resume
            await self.compute.call(partial(self.system.restore, tensors, meta["config"]))
            self._resume_counters(meta)
            self._resume = None
            # the checkpoint's model is the good one until an epoch finishes here
            self.last_good = await self.compute.call(partial(_finite_state, self.model))
        limit = self.max_frame_bytes = min(self.system.frame_limit(), self.max_frame_bytes)
        for session in self.sessions.values():  # new connections get it from admission
            session.peer.max_frame_bytes = limit
        self._log_plan()
        self._warn_of_uneven_micro_batches()

    def _log_plan(self) -> None:
        """The plan, a line per device (aiopipe.runtime.plan_text); nothing when the
        system has none yet (HADFL plans each round, and logs its strategy itself)."""
        entries = self.system.plan_entries()
        if not entries:
            return
        estimate = entries[0].get("estimate_s")
        log_plan(log, logging.INFO, f"planned {self.config.mode}", entries,
                 units=models.unit_count(self.model), batch_size=self.system.config.batch_size,
                 iterations=self.system.iterations, notes=[f"est. {estimate:.3g} s an "
                                                           "iteration"] if estimate else [])

    def _warn_of_uneven_micro_batches(self) -> None:
        """Say so when N does not divide B: micro-batches of floor(B/N) samples then train
        fewer than B samples per iteration ([Note: iterations per epoch] in plan.py)."""
        batch = self.config.batch_size
        for entry in self.system.plan_entries():
            n = entry.get("parallel_batches")
            if not isinstance(n, int) or batch % n == 0:
                continue
            k = int(entry["device"])
            trained = self.system.iterations(k) * (batch // n) * n
            divisors = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
            log.warning("device %d: parallel_batches %d does not divide batch_size %d: each "
                        "iteration trains %d micro-batches of %d = %d samples, %d of its %d "
                        "per epoch (N dividing B: %s)", k, n, batch, n, batch // n,
                        (batch // n) * n, trained, self.system_samples[k], divisors)

    async def _profiles(self) -> list[DeviceProfile]:
        """Each device as it measures itself (aiopipe.runtime.profiling [Note: device
        profiles]); what it says goes to ``/status``."""
        config = self.config
        devices, self.profiled = await profile_fleet(
            {k: self.sessions[k] for k in range(config.devices)},
            {k: self.announced[k].host for k in range(config.devices)},
            declared_devices(config, self.system_samples),
            sizes=tuple(planning_batch_sizes(config)), units=models.unit_count(self.model),
            clock=self.clock)
        return devices

    async def _unless_failed(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result, unless the coordinator's own work fails first: then
        ``work`` is cancelled and the failure raised ([Note: server faults]).

        Raises:
            TrainingError: the coordinator's work failed.
        """
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.failure is not None:
            raise self.failure
        return task.result()

    async def _epoch(self, epoch: int) -> EpochMetrics:
        self.epoch = epoch
        start = self._epoch_start = self.clock.now()
        stats_before = self._link_bytes()
        peers_before = self._peer_bytes()
        system, devices = self.system, self.config.devices
        iterations = [system.iterations(k) for k in range(devices)]
        period = (system.round_iterations or self.config.aggregation_every
                  or max(iterations))
        tally = self._tally if self._tally.get("epoch") == epoch else _new_tally(epoch, devices)
        self._tally = tally
        round_count = math.ceil(max(iterations) / period)
        self._served_before_round = 0
        changes_before = len(self.replans)
        for r in range(int(tally["next_round"]), round_count):
            first = r * period
            round_no = self.new_round()
            work = [max(0, min(period, n - first)) for n in iterations]
            participants = await self._participants()
            tally["present"] = sorted({*tally.get("present", ()), *participants})
            if self.config.devices_per_round:  # [Note: sampling per round]
                participants = sampled_devices(self.config.seed, epoch, r, participants,
                                               self.config.round_size(len(participants)))
                tally.setdefault("sampled", []).append(participants)
            mark = len(self.recorder.slices)
            done = await system.run_round(self, round_no, epoch, first, work, participants)
            tally["lost"] = sorted(set(tally["lost"]) | (set(participants) - set(done))
                                   | set(tally.get("excluded", ())))
            tally["refused"] = sorted(set(tally.get("refused", []))
                                      | set(system.refused_updates()))
            for k, result in done.items():
                tally["device_samples"][k] += result.samples
                tally["loss_sum"] += result.loss_sum
                tally["correct"] += result.correct
                self.count_round(epoch, k, result)
            tally["next_round"] = r + 1
            if r + 1 < round_count or epoch + 1 < self.config.epochs:
                await self._after_round(round_no, epoch, mark)
            if r + 1 < round_count:  # after the last one, `train` checkpoints the epoch
                await self._checkpoint(epoch, r + 1, self.clock.now() - start, epoch)
        end = self.clock.now()
        up, down = (a - b for a, b in zip(self._link_bytes(), stats_before, strict=True))
        accuracy = await self.compute.call(partial(test_accuracy, self.model, self.test_set))
        held_out, per_device = await self._evaluate_on_devices(epoch)
        device_samples = tuple(int(n) for n in tally["device_samples"])
        samples = system.epoch_samples(device_samples)
        elapsed = end - start + float(tally["elapsed_before"])  # time before a restart too
        by_track = self.recorder.busy_by_track(start, end)
        busy = self._busy(by_track)
        return EpochMetrics(
            # people count epochs from 1 (`EpochMetrics.epoch`); the loop's index is 0-based
            epoch=epoch + 1, time_s=elapsed, busy_s=busy,
            idle_s={k: elapsed - v for k, v in busy.items()},
            # an epoch in which nobody trained has no loss (NaN, null in metrics.jsonl)
            loss=float(tally["loss_sum"]) / samples if samples else math.nan,
            accuracy=accuracy,
            train_accuracy=int(tally["correct"]) / samples if samples else math.nan,
            samples=samples,
            bytes_up=int(up), bytes_down=int(down), plan=system.plan_entries(),
            device_samples=device_samples, devices_lost=_lost_in(tally, devices),
            updates_refused=tuple(tally.get("refused", [])),
            stages=system.stage_figures(
                by_track, elapsed, {k: s.peak_live for k, s in self.sessions.items()},
                {k: s.peak_memory for k, s in self.sessions.items()}),
            links={track: {"busy_s": seconds, "idle_s": elapsed - seconds}
                   for track, seconds in sorted(by_track.items()) if "->" in track},
            held_out_accuracy=held_out, device_accuracy=per_device,
            changes=tuple(self.replans[changes_before:]),
            sampled=tuple(tuple(r) for r in tally.get("sampled", ())),
            devices_excluded=tuple(tally.get("excluded", ())),
            peer_bytes=(tuple(a - b for a, b in zip(self._peer_bytes(), peers_before,
                                                     strict=True))
                        if self.system.links_devices else ()),
        )

    def epoch_progress(self) -> tuple[int, int]:
        """(micro-batches the server's stage has computed in the epoch under way, how many
        the epoch has) for a progress display; ``(0, 0)`` where the server computes no
        micro-batches (fl, a pipeline) or before training."""
        if not self.system.serves_stages or not self.prepared:
            return 0, 0
        total = sum(self.system.iterations(int(p["device"])) * int(p.get("parallel_batches", 1))
                    for p in self.system.plan_entries())
        if self.config.devices_per_round:  # about: the sampled devices' share of it
            devices = self.config.devices
            total = math.ceil(total * self.config.round_size(devices) / devices)
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
        paced = [k not in self.sessions or self.sessions[k].peer.link.paces_sends()
                 for k in range(devices)]
        change = await self.system.after_round(self, round_no, epoch,
                                               self.recorder.take(mark), served, paced)
        if change is not None:
            self.replans.append(_numbered_for_people(change))

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

    def _busy(self, by_track: Mapping[str, float]) -> dict[str, float]:
        """Busy seconds per resource kind; device kinds are means over devices."""
        totals = dict.fromkeys(RESOURCE_KINDS, 0.0)
        for track, busy in by_track.items():
            kind = resource_kind(track)
            if kind in totals:
                totals[kind] += busy
        k = self.config.devices
        return {kind: value if kind == "server" else value / k
                for kind, value in totals.items()}

    def _peer_bytes(self) -> list[int]:
        """Per device, the bytes it reported sending to its peers so far (this process's
        sessions: a device that restarted counts from its new session)."""
        return [self.sessions[k].peer_bytes if k in self.sessions else 0
                for k in range(self.config.devices)]

    def _link_bytes(self) -> tuple[int, int]:
        up = down = 0
        for session in self.sessions.values():
            received, sent = session.link_bytes()
            up += received
            down += sent
        return up, down

    # -- checkpoints ---------------------------------------------------------------------

    async def _checkpoint(self, epoch: int, next_round: int, elapsed: float,
                          traced_epoch: int) -> None:
        """Checkpoint (when the run keeps checkpoints) before ``epoch``'s round
        ``next_round``; the copy is traced in ``traced_epoch``."""
        if self.checkpoints.directory is not None:  # (the meta is O(devices x epochs))
            await self.checkpoints.save(self._checkpoint_meta(epoch, next_round, elapsed),
                                        traced_epoch)

    def _checkpoint_meta(self, epoch: int, next_round: int, elapsed: float) -> dict[str, Any]:
        """What a checkpoint holds besides tensors: config, position, tally, epochs."""
        # a deep copy: the next round adds to the tally's lists while the file is written
        tally = (copy.deepcopy(self._tally) if next_round
                 else _new_tally(epoch, self.config.devices))
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0)) + elapsed
        return {"config": self.config.to_mapping(), "epoch": epoch,
                "rounds": self.rounds, "tally": {**tally, "epoch": epoch,
                                                 "next_round": next_round},
                "epochs": [e.to_mapping() for e in self.epochs]}

    def _read_checkpoint(self, directory: Path
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The checkpoint to resume from, once it is this run's.

        Raises:
            ConfigError: none there, or it is another run's.
        """
        tensors, meta = load_checkpoint(directory)
        # a key the checkpoint's version did not have ran as its default does
        meta["config"] = {**RunConfig().to_mapping(), **dict(meta.get("config", {}))}
        saved = dict(meta["config"])
        current = self.config.to_mapping()
        for key in ("out_dir", *self.system.planned_keys):  # "auto" plans: the checkpoint's
            saved.pop(key, None)
            current.pop(key, None)
        if saved != current:
            changed = sorted(k for k in set(saved) | set(current)
                             if saved.get(k) != current.get(k))
            raise ConfigError(f"the checkpoint in {str(directory)!r} is for another run "
                              f"(different {', '.join(changed)})")
        log.warning("resuming at epoch %d, its round %d, from %s", int(meta["epoch"]) + 1,
                    int(meta["tally"]["next_round"]) + 1, directory)
        return tensors, meta

    def _resume_counters(self, meta: Mapping[str, Any]) -> None:
        """Where training stood at the checkpoint: rounds, finished epochs, the tally."""
        self.rounds = int(meta["rounds"])
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
                    for kind, busy in self._busy(by_track).items()}
        return {
            "mode": self.config.mode, "devices": self.config.devices,
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
            "finished_epochs": [e.to_mapping() for e in self.epochs],
        }


def _evaluation_data(config: RunConfig
                     ) -> tuple[tuple[int, ...], int, datasets.Dataset | None]:
    """The run's input shape and classes, and the coordinator's evaluation set (the test
    split of ``config.dataset``, ``test_samples`` of it; None when 0).

    Raises:
        ConfigError: the dataset is unknown or unreadable.
    """
    known = datasets.data_format(config.dataset)
    test_set = None
    if config.test_samples or known is None:  # an entry point: only its data can tell
        test_set = datasets.open_device_data(config.dataset, split="test", seed=config.seed,
                                             size=config.test_samples or None)
    if known is None:
        assert test_set is not None
        _, shape, classes = datasets.describe(test_set)
        known = shape, classes
    return known[0], known[1], test_set if config.test_samples else None


def _finite_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A copy of ``model``'s state, or None when a floating entry is not finite."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point()):
        return state
    return None


def _frame_cap(config: RunConfig, model: torch.nn.Sequential, in_shape: tuple[int, ...]
               ) -> int:
    """The largest frame a device's connection may carry before the run is planned:
    the whole model's state, an activation of the whole batch, a round's action list and
    the largest round report a device sends (`MAX_REPORT_SLICES`)."""
    from aiopipe.protocol import HEADER_SLACK_BYTES
    from aiopipe.runtime.plan import unit_output_shapes

    state = model.state_dict()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    batch = config.batch_size
    widest = max(math.prod(s) for s in (in_shape, *unit_output_shapes(model, in_shape)))
    activation = 4 * batch * widest + 8 * batch
    actions = 16 * (6 * batch + 2)
    return int(max(state_bytes, activation) + HEADER_SLACK_BYTES + 256 * len(state) + actions
               + REPORT_SLICE_BYTES * MAX_REPORT_SLICES)


def _check_tables(units: int, **tables: CostTable | None) -> None:
    """Each given cost table is the model's: one row per split unit.

    Raises:
        ConfigError: one is not (naming it), or a server table comes without devices'.
    """
    if tables.get("server_cost_table") is not None and tables.get("cost_table") is None:
        raise ConfigError("server_cost_table needs cost_table: the devices' own")
    for name, table in tables.items():
        if table is not None and table.units != units:
            raise ConfigError(f"{name} has {table.units} units, the model {units}: it was "
                              "measured for another model")


def _lost_in(tally: Mapping[str, Any], devices: int) -> tuple[int, ...]:
    """The epoch's lost devices: those that dropped out of a round it played, and those
    alive at the start of none of its rounds (absent the whole epoch, 0 samples; an
    epoch's tally from before this was kept has no ``present``: nobody absent)."""
    absent = set(range(devices)) - set(tally.get("present", range(devices)))
    return tuple(sorted({*tally["lost"], *absent}))


#: What a change's record (`EpochMetrics.changes`, ``/status``'s ``replans``) numbers:
#: an epoch, a round of the run; the systems give them as the runtime's 0-based indices.
_NUMBERED_FIELDS = ("epoch", "round", "replayed_as")


def _numbered_for_people(change: Mapping[str, Any]) -> dict[str, Any]:
    """``change`` with its epoch and round numbers counted from 1, as the rest of
    ``metrics.jsonl`` and the log count them (its iterations stay offsets from 0)."""
    out = dict(change)
    for name in _NUMBERED_FIELDS:
        if isinstance(out.get(name), int):
            out[name] += 1
    return out


def _new_tally(epoch: int, devices: int) -> dict[str, Any]:
    """An epoch's running totals (what a checkpoint needs to finish the epoch exactly)."""
    return {"epoch": epoch, "next_round": 0, "device_samples": [0] * devices,
            "loss_sum": 0.0, "correct": 0, "lost": [], "refused": [], "elapsed_before": 0.0}


def _epoch_from(values: Mapping[str, Any]) -> EpochMetrics:
    fields = dict(values)
    fields["epoch"] = int(fields["epoch"])  # from 1, as in metrics.jsonl and EpochMetrics
    fields["device_samples"] = tuple(fields.get("device_samples", ()))
    fields["devices_lost"] = tuple(fields.get("devices_lost", ()))
    fields["updates_refused"] = tuple(fields.get("updates_refused", ()))
    fields["stages"] = tuple(fields.get("stages", ()))
    fields["links"] = dict(fields.get("links", {}))
    fields["device_accuracy"] = dict(fields.get("device_accuracy", {}))
    fields["changes"] = tuple(fields.get("changes", ()))
    fields["peer_bytes"] = tuple(fields.get("peer_bytes", ()))
    fields["sampled"] = tuple(tuple(r) for r in fields.get("sampled", ()))
    fields["devices_excluded"] = tuple(fields.get("devices_excluded", ()))
    for name in ("held_out_accuracy", "accuracy", "loss", "train_accuracy"):
        if fields.get(name) is None:  # NaN is null in JSON
            fields[name] = math.nan
    return EpochMetrics(**fields)

