"""The server node: admits devices, runs rounds, aggregates, evaluates, records.

The coordinator (`ServerNode.train`) drives rounds; each connected device has a
`DeviceSession`. Per round (an epoch, or ``aggregation_every`` iterations):
- fl: send the global model to every device; devices train it whole; FedAvg the results;
- sfl / pipar: send every device its half of the global model; sessions serve
  activations on the shared compute queue; when every device's result is in, rebuild
  M_k = M^s_k (+) M^c_k per device, FedAvg weighted by samples (Eq. 3), split back (Eq. 4);
- sl: devices take turns; each starts from the previous one's weights; one server half.
After each epoch the global model is evaluated on the server's held-out test set.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
from collections.abc import Coroutine, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from aiopipe import data as datasets
from aiopipe import models
from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import (
    AiopipeError,
    ConfigError,
    DeviceLostError,
    RemoteProtocolError,
    TrainingError,
    TransportError,
)
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.metrics.trace import RESOURCE_KINDS, Recorder, resource_kind
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    PROTOCOL_VERSION,
    Bye,
    ErrorMessage,
    Hello,
    Plan,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from aiopipe.runtime.compute import Compute, warm_up_torch
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.plan import (
    DevicePlan,
    build_model,
    check_trainable,
    choose_plans,
    declared_devices,
    device_indices,
    device_plans,
    measure_planning_costs,
    model_profile,
    needs_planner,
    train_dataset,
    unit_output_shapes,
    with_plans,
)
from aiopipe.runtime.replan import Replan, live_profiles, make_optimizer, reselect
from aiopipe.runtime.session import DeviceSession
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile
from aiopipe.transport import Link

__all__ = ["ServerNode"]

log = logging.getLogger("aiopipe.server")

T = TypeVar("T")

#: Seconds a new connection has to say hello before it is dropped.
HELLO_TIMEOUT_S = 30.0


class ServerNode:
    """Coordinator and server-side compute of one run.

    Args:
        config: the run; "auto" split points and micro-batch counts are resolved here by
            the planner (`aiopipe.runtime.plan.resolve_auto`), and ``self.config`` is the
            resolved config that devices receive.
        clock: the node's clock.
        cost_table: charge compute from this table (virtual-time simulation); also what
            the planner plans with. Without it, "auto" measures one on this machine.
        join_timeout: seconds to wait for every device to say hello.
        progress: called with one line per finished epoch.
        checkpoint_dir: write a checkpoint there after every round (atomically).
        resume: continue from the checkpoint in ``checkpoint_dir``; the config must be
            the one it was written for.
    """

    def __init__(self, config: RunConfig, *, clock: Clock, cost_table: CostTable | None = None,
                 join_timeout: float = 300.0,
                 progress: Any = None, checkpoint_dir: Path | None = None,
                 resume: bool = False) -> None:
        warm_up_torch()
        self.config = config
        self.clock = clock
        self.cost_table = cost_table
        self.join_timeout = join_timeout
        self.progress = progress
        train = train_dataset(config)
        self.num_classes = train.num_classes
        self.in_shape = train.in_shape
        self.test_set = datasets.open_dataset(config.dataset, split="test",
                                              size=config.test_samples, seed=config.seed)
        self.model = build_model(config, num_classes=self.num_classes, in_shape=self.in_shape)
        self.units = models.unit_count(self.model)
        samples = [len(device_indices(config, train, k)) for k in range(config.devices)]
        self.samples = samples
        # [Note: planning] with "auto", plan now from the cost table (measured here when
        # not given: real runs keep real time) and, between rounds, from live measurements
        self.auto_config: RunConfig | None = None
        self.planning: ModelProfile | None = None
        self.live: list[DeviceProfile] = []
        self.replans: list[Replan] = []
        if needs_planner(config):
            planning_costs = cost_table or measure_planning_costs(config, self.model, train)
            self.auto_config = config
            self.planning = model_profile(self.model, self.in_shape, planning_costs)
            self.live = declared_devices(config, samples)
            config = with_plans(config, choose_plans(config, self.planning, self.live))
            self.config = config
        self.plans = device_plans(config, self.units, samples)
        check_trainable(self.model, self.in_shape, self.plans, config)
        self.activation_shapes = unit_output_shapes(self.model, self.in_shape)
        self.max_frame_bytes = self._frame_limit()
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, "server/compute",
                               charge_costs=cost_table is not None)
        self.replicas: dict[int, tuple[nn.Sequential, torch.optim.Optimizer]] = {}
        for plan in self.plans if config.mode != "fl" else ():
            self.replicas[plan.device_id] = self._replica(plan.split_point)
        self.sessions: dict[int, DeviceSession] = {}  # every device that joined the run
        self.connected: set[int] = set()  # devices whose connection is open now
        self._left = asyncio.Event()  # set whenever a connection closes
        self._arrived = asyncio.Event()  # set whenever a device is admitted
        #: why the server's own work failed ([Note: server faults]); train() raises it
        self.failure: TrainingError | None = None
        self._failed = asyncio.Event()
        self.joined = asyncio.Event()  # set once every device has said hello
        self.epoch = -1
        self.finished = False  # train() has returned: no more admissions
        self._half_specs: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._epoch_start = 0.0
        self.rounds = 0
        self.epochs: list[EpochMetrics] = []
        self._tally: dict[str, Any] = {}
        self.checkpoint_dir = checkpoint_dir
        self._checkpoint_writer: asyncio.Future[None] | None = None
        #: a checkpoint's metadata and epoch whose copy waits for the next round
        self._pending_checkpoint: tuple[dict[str, Any], int] | None = None
        if resume:
            if checkpoint_dir is None:
                raise ConfigError("resuming needs the checkpoint directory")
            self._restore(checkpoint_dir)

    # -- admission ----------------------------------------------------------------------

    async def serve_link(self, link: Link, *, device_id: int | None = None) -> None:
        """Run one device connection from hello to goodbye (the websocket handler's body).

        ``device_id``: the id the connection authenticated as (from its token); a Hello
        for any other id is refused.

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection failed.
        """
        peer = Peer(link, self.clock, self.recorder, "server/unknown",
                    max_frame_bytes=self.max_frame_bytes)
        try:
            hello: object = await wait_for(self.clock, peer.receive(), HELLO_TIMEOUT_S)
        except TimeoutError:
            hello = None
            problem = f"no hello within {HELLO_TIMEOUT_S:g} s"
        except RemoteProtocolError as exc:
            hello = None
            problem = f"bad hello: {exc}"
        else:
            problem = self._check_hello(hello, device_id)
        if problem:
            log.warning("refused a device: %s", problem)
            code = "busy" if problem.endswith("already connected") else "refused"
            with contextlib.suppress(TransportError):
                await peer.send(ErrorMessage(code, problem))
            await link.aclose()
            raise RemoteProtocolError(problem)
        assert isinstance(hello, Hello)
        k = hello.device_id
        session = self.sessions.get(k)
        resumed = session is not None and not session.ended and hello.session == session.nonce
        if session is not None:
            log.warning("device %d reconnected (%s)", k, "resuming its session" if resumed
                        else "afresh: it takes part from the next round")
        if session is not None and not session.ended:
            await self._supersede(session)
        if session is not None and not resumed:
            # a device that starts afresh cannot continue its old round: drop that round
            session.end("it restarted")
        if session is None or not resumed:
            plan = self.plans[k]
            earlier = session.link_bytes() if session is not None else (0, 0)
            session = DeviceSession(
                self, Peer(link, self.clock, self.recorder, f"device{k}/downlink",
                           max_frame_bytes=self.max_frame_bytes),
                plan, self.activation_shapes[plan.split_point - 1],
                earlier_bytes=earlier)  # the epoch's byte counts span sessions
            self.sessions[k] = session
        plan = self.plans[k]
        await peer.send(Plan(k, self.config.mode, plan.split_point, plan.parallel_batches,
                             plan.micro_batch_size, self.config.to_mapping(),
                             server_time=self.clock.now(), session=session.nonce))
        session.attach(link, resumed=resumed)
        if len(self.sessions) == self.config.devices:
            self.joined.set()
        self.connected.add(k)
        self._arrived.set()
        try:
            await session.serve()
        except TransportError as exc:
            # [Note: reconnection] wait for the device to come back before giving up
            self.connected.discard(k)
            self._left.set()
            grace = self.config.reconnect_grace
            log.warning("device %d: %s; waiting %g s for it to reconnect", k, exc, grace)
            if await session.wait_reattached(grace):
                return  # the new connection's serve_link carries on
            session.end(f"{exc}, and it did not reconnect within {grace:g} s")
            log.warning("device %d was lost", k)
            raise
        except (AiopipeError, OSError) as exc:
            session.end(str(exc))
            log.warning("device %d was lost: %s", k, exc)
            raise
        except Exception as exc:
            # [Note: server faults]
            cause = first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
            failure = TrainingError(f"the server's work for device {k} failed: "
                                    f"{type(cause).__name__}: {cause}")
            session.end(str(failure))
            log.error("%s", failure, exc_info=cause)
            if self.failure is None:
                self.failure = failure
                self._failed.set()
            with contextlib.suppress(TransportError):  # tell the device why, if it listens
                await session.peer.send(Bye(f"training failed: {failure}"))
        else:
            session.end("it said goodbye")
        finally:
            if self.sessions.get(k) is session and session.ended:
                self.connected.discard(k)
                self._left.set()

    async def _supersede(self, session: DeviceSession) -> None:
        """A device (authenticated as itself) said hello again: retire its old connection,
        which may still look alive (a stalled link)."""
        if not session.idle.is_set():
            await session.peer.link.aclose("superseded by a new connection")
            try:
                await wait_for(self.clock, session.idle.wait(), 30.0)
            except TimeoutError:
                raise RemoteProtocolError(f"device {session.device_id}'s old connection "
                                          "did not close") from None

    async def wait_disconnected(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until every device connection has closed (after Bye).

        Returns whether they all did. Closing the listening site earlier would drop the
        devices' close handshakes.
        """

        async def all_gone() -> None:
            while self.connected:
                self._left.clear()
                await self._left.wait()

        try:
            await wait_for(self.clock, all_gone(), seconds)
        except TimeoutError:
            return False
        return True

    def _check_hello(self, hello: object, authenticated: int | None) -> str:
        if not isinstance(hello, Hello):
            return f"expected Hello, got {type(hello).__name__}"
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        if self.finished:
            return "the run is over"
        if authenticated is not None and hello.device_id != authenticated:
            return f"token is for device {authenticated}, not device {hello.device_id}"
        session = self.sessions.get(hello.device_id)
        if authenticated is None and session is not None and not session.idle.is_set():
            # only a connection authenticated as this device may take over a live one
            return f"device id {hello.device_id} is already connected"
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        if not hello.device_id < self.config.devices:
            return f"device id {hello.device_id} is not in 0..{self.config.devices - 1}"
        return ""

    def _replica(self, split_point: int,
                 old: tuple[nn.Sequential, torch.optim.Optimizer] | None = None
                 ) -> tuple[nn.Sequential, torch.optim.Optimizer]:
        """A server-half replica at ``split_point`` from the global model, with its
        optimizer; momentum is carried over from ``old`` for the parameters it shares."""
        half = copy.deepcopy(models.split(self.model, split_point)[1])  # only that half
        return half, make_optimizer(half, self.config, previous=old)

    def device_half_specs(self, device_id: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Wire dtype and shape of every state-dict entry of device ``device_id``'s half."""
        specs = self._half_specs.get(device_id)
        if specs is None:
            half = models.split(self.model, self.plans[device_id].split_point)[0]
            specs = {name: (wire.dtype, wire.shape) for name, wire in
                     state_to_wire({k: v.detach() for k, v in half.state_dict().items()}).items()}
            self._half_specs[device_id] = specs
        return specs

    # -- training ---------------------------------------------------------------------

    async def train(self) -> RunResult:
        """Wait for every device, run every epoch, say goodbye; the run's result.

        Raises:
            TrainingError: devices did not join in time, or one was lost.
        """
        try:
            await wait_for(self.clock, self.joined.wait(), self.join_timeout)
        except TimeoutError:
            missing = sorted(set(range(self.config.devices)) - set(self.sessions))
            raise TrainingError(f"devices {missing} did not join within "
                                f"{self.join_timeout:g} s") from None
        origin = self.clock.now()
        reason = "training finished"
        try:
            for epoch in range(len(self.epochs), self.config.epochs):
                self.epochs.append(await self._unless_failed(self._epoch(epoch)))
                if self.progress is not None:
                    self.progress(self.epochs[-1])
                await self._save_checkpoint(epoch + 1, 0)
            await self._checkpoint_written()
        except BaseException as exc:
            reason = f"training failed: {exc}"
            raise
        finally:
            self.finished = True
            for session in self.sessions.values():
                if not session.closing and not session.ended:
                    session.say_bye(reason)
            try:  # training failed: let the checkpoint in flight (or pending) end
                await self._checkpoint_written()
            except Exception as exc:  # the failure being raised wins
                log.error("the last checkpoint could not be written: %s", exc)
            self.compute.close()
        return RunResult(self.config, list(self.epochs), self.model,
                         list(self.recorder.slices), origin)

    async def _unless_failed(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result, unless the server's own work fails first: then ``work`` is
        cancelled and the failure raised.

        [Note: server faults] An exception from the server's own work for a device (a
        pass that runs out of memory, a bug) is not the device's doing, and it would
        happen again: the device would reconnect, resend, and fail the same pass, for
        ever. So `serve_link` ends that device's session, logs the error with its
        traceback once, and the run stops with a `TrainingError` naming it.

        Raises:
            TrainingError: the server's work failed.
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
        iterations = [p.iterations_per_epoch for p in self.plans]
        period = self.config.aggregation_every or max(iterations)
        tally = self._tally if self._tally.get("epoch") == epoch else _new_tally(
            epoch, self.config.devices)
        self._tally = tally
        round_count = math.ceil(max(iterations) / period)
        for r in range(int(tally["next_round"]), round_count):
            first = r * period
            round_no = self.rounds
            self.rounds += 1
            work = [max(0, min(period, n - first)) for n in iterations]
            participants = await self._participants()
            mark = len(self.recorder.slices)
            if self.config.mode == "sl":  # devices take turns on one chain of weights
                done: dict[int, RoundResult] = {}
                for k in participants:
                    state = await self._prepare(k)
                    self._copy_checkpoint()
                    result = await self._round(k, round_no, epoch, first, work[k], state)
                    if result is not None:
                        done[k] = result
                        await self.compute.run("agg", partial(self._adopt, k, result),
                                               cost=0.0 if self.cost_table else None,
                                               epoch=epoch)
            else:
                states = {k: await self._prepare(k) for k in participants}
                self._copy_checkpoint()  # after the RoundStarts: see the Note
                try:
                    async with asyncio.TaskGroup() as tasks:
                        rounds = {k: tasks.create_task(
                            self._round(k, round_no, epoch, first, work[k], states[k]))
                            for k in participants}
                except BaseExceptionGroup as group:
                    raise first_error(group) from None
                done = {k: res for k, t in rounds.items() if (res := t.result()) is not None}
                if done:
                    cost = self.cost_table.aggregate_time(len(done)) if self.cost_table else None
                    await self.compute.run("agg", partial(self._aggregate, done), cost=cost,
                                           epoch=epoch)
            tally["lost"] = sorted(set(tally["lost"]) | (set(participants) - set(done)))
            for k, result in done.items():
                tally["device_samples"][k] += result.samples
                tally["loss_sum"] += result.loss_sum
                tally["correct"] += result.correct
            tally["next_round"] = r + 1
            if r + 1 < round_count or epoch + 1 < self.config.epochs:
                await self._reconsider(round_no, epoch, mark)
            if r + 1 < round_count:  # after the last one, `train` checkpoints the epoch
                await self._save_checkpoint(epoch, r + 1, elapsed=self.clock.now() - start)
        end = self.clock.now()
        accuracy = await self.compute.call(self._evaluate)
        up, down = (a - b for a, b in zip(self._link_bytes(), stats_before, strict=True))
        device_samples = tuple(int(n) for n in tally["device_samples"])
        samples = sum(device_samples)
        busy = self._busy(start, end)
        elapsed = end - start + float(tally["elapsed_before"])  # time before a restart too
        return EpochMetrics(
            epoch=epoch, time_s=elapsed, busy_s=busy,
            idle_s={k: elapsed - v for k, v in busy.items()},
            loss=float(tally["loss_sum"]) / max(1, samples), accuracy=accuracy,
            train_accuracy=int(tally["correct"]) / max(1, samples), samples=samples,
            bytes_up=int(up), bytes_down=int(down),
            plan=[{"device": p.device_id, "split_point": p.split_point,
                   "parallel_batches": p.parallel_batches} for p in self.plans],
            device_samples=device_samples, devices_lost=tuple(tally["lost"]),
        )

    # -- checkpoints (see aiopipe.runtime.checkpoint) --------------------------------------

    async def _save_checkpoint(self, epoch: int, next_round: int, *,
                               elapsed: float = 0.0) -> None:
        """Checkpoint the run; training goes on while the state is copied and written.

        [Note: background checkpoints] Writing a checkpoint (hundreds of MB for a deep
        model's replicas and their momentum, fsynced) takes seconds, and for a whole
        round's length the server would stand idle. So the state is copied in the compute
        thread, where nothing else touches the replicas meanwhile (a memory copy, traced
        as a "ckpt" slice), and the copy is written by another thread while the next
        round runs.

        The copy itself (0.2 s for resnet18's 4 replicas with momentum, 0.5 s for vgg16's)
        waits for the next round: it is queued on the compute thread just after the
        device halves for the round's `RoundStart`s were taken (`_copy_checkpoint`), so it
        runs while the devices compute and send their first activations, when the server
        has nothing to do. It still comes before any server work of that round (the
        compute queue is FIFO), so it sees the state the finished round left. The
        metadata is taken now. The last round of an epoch is not checkpointed by itself:
        the checkpoint after the epoch (with its metrics) follows its evaluation.

        One checkpoint is in flight at a time: the next one, and the end of training,
        wait for it, and a failed write raises there. A copy still waiting when training
        ends (or fails: nothing has changed the state yet) is made then. The files are
        renamed into place only when whole, so a crash during a write leaves the previous
        checkpoint to resume from. When costs are charged (virtual time) the checkpoint is
        written in place, as a deterministic simulation wants.
        """
        if self.checkpoint_dir is None:
            return
        await self._checkpoint_written()
        meta = self._checkpoint_meta(epoch, next_round, elapsed)
        if self.compute.charge_costs:
            save_checkpoint(self.checkpoint_dir,
                            await self.compute.call(self._checkpoint_tensors), meta)
            return
        # the copy is server work: a "ckpt" slice in the epoch whose work it saves
        self._pending_checkpoint = (meta, epoch if next_round else epoch - 1)

    def _copy_checkpoint(self) -> None:
        """Queue the pending checkpoint's copy on the compute thread, then its write."""
        if self._pending_checkpoint is None:
            return
        meta, epoch = self._pending_checkpoint
        self._pending_checkpoint = None
        # created before the round's tasks, this task takes the compute lock first
        self._checkpoint_writer = asyncio.ensure_future(self._copy_and_write(meta, epoch))

    async def _copy_and_write(self, meta: dict[str, Any], epoch: int) -> None:
        assert self.checkpoint_dir is not None
        tensors = await self.compute.run("ckpt", self._checkpoint_tensors, epoch=epoch)
        with self.clock.hold():
            await asyncio.to_thread(save_checkpoint, self.checkpoint_dir, tensors, meta)

    async def _checkpoint_written(self) -> None:
        """Wait for the checkpoint in flight, if any (starting a pending one first);
        raise what its copy or write raised."""
        self._copy_checkpoint()
        writer, self._checkpoint_writer = self._checkpoint_writer, None
        if writer is not None:
            await writer

    def _write_checkpoint(self, epoch: int, next_round: int, elapsed: float) -> None:
        """Write a checkpoint now, on the calling thread."""
        assert self.checkpoint_dir is not None
        save_checkpoint(self.checkpoint_dir, self._checkpoint_tensors(),
                        self._checkpoint_meta(epoch, next_round, elapsed))

    def _checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """A copy of the tensors a checkpoint holds.

        A replica's weights are left out where they equal the global model's (after an
        aggregation they all do); `_restore` takes those from the global model."""
        whole = self.model.state_dict()
        tensors = {f"model/{k}": v.detach().clone() for k, v in whole.items()}
        for k, (half, optimizer) in self.replicas.items():
            for name, v in half.state_dict().items():
                if not torch.equal(v, whole[name]):
                    tensors[f"replica/{k}/{name}"] = v.detach().clone()
            for i, param in enumerate(half.parameters()):
                buffer = optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    tensors[f"momentum/{k}/{i}"] = buffer.detach().clone()
        return tensors

    def _checkpoint_meta(self, epoch: int, next_round: int,
                         elapsed: float) -> dict[str, Any]:
        """What a checkpoint holds besides tensors: config, position, tally, epochs."""
        # a deep copy: the next round adds to the tally's lists while the file is written
        tally = (copy.deepcopy(self._tally) if next_round
                 else _new_tally(epoch, self.config.devices))
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0)) + elapsed
        return {"config": self.config.to_mapping(), "epoch": epoch,
                "rounds": self.rounds, "tally": {**tally, "epoch": epoch,
                                                 "next_round": next_round},
                "epochs": [e.to_mapping() for e in self.epochs]}

    def _restore(self, directory: Path) -> None:
        tensors, meta = load_checkpoint(directory)
        saved = dict(meta.get("config", {}))
        current = self.config.to_mapping()
        planned = ("split_point", "parallel_batches") if self.auto_config else ()
        for key in ("out_dir", *planned):  # "auto" plans are the checkpoint's, see below
            saved.pop(key, None)
            current.pop(key, None)
        if saved != current:
            changed = sorted(k for k in set(saved) | set(current)
                             if saved.get(k) != current.get(k))
            raise ConfigError(f"the checkpoint in {str(directory)!r} is for another run "
                              f"(different {', '.join(changed)})")
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        if self.auto_config is not None:  # go on with the plans the run had (re-)chosen
            resumed = self.config.replace(split_point=meta["config"]["split_point"],
                                          parallel_batches=meta["config"]["parallel_batches"])
            self._switch_plans([(p.split_point, p.parallel_batches)
                                for p in device_plans(resumed, self.units, self.samples)])
        whole = self.model.state_dict()
        for k, (half, optimizer) in self.replicas.items():
            prefix = f"replica/{k}/"
            half.load_state_dict({name: tensors.get(prefix + name, whole[name])
                                  for name in half.state_dict()})
            for i, param in enumerate(half.parameters()):
                buffer = tensors.get(f"momentum/{k}/{i}")
                if buffer is not None:
                    optimizer.state[param]["momentum_buffer"] = buffer.clone()
        self.rounds = int(meta["rounds"])
        self.epochs = [_epoch_from(e) for e in meta.get("epochs", [])]
        tally = dict(meta["tally"])
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0))
        self._tally = tally
        log.warning("resuming at epoch %d, round %d of the epoch, from %s",
                    int(meta["epoch"]) + 1, int(tally["next_round"]), directory)

    # -- re-planning (see aiopipe.runtime.replan) ---------------------------------------

    async def _reconsider(self, round_no: int, epoch: int, mark: int) -> None:
        """Between rounds: re-estimate from the round's trace and switch plans when a
        fresh selection is estimated to be better by more than ``replan_threshold``."""
        config = self.config
        if (self.auto_config is None or self.planning is None or not config.replan
                or config.mode not in ("sfl", "pipar")):
            return
        served = [self.sessions[k].served if k in self.sessions else 0
                  for k in range(config.devices)]
        paced = [k not in self.sessions or self.sessions[k].peer.link.paces_sends()
                 for k in range(config.devices)]
        slices, planning, auto = self.recorder.take(mark), self.planning, self.auto_config
        plans, current = list(self.plans), [(p.split_point, p.parallel_batches)
                                            for p in self.plans]
        batch = config.batch_size

        def decide() -> tuple[list[DeviceProfile], list[tuple[int, int]], float, float]:
            profile, live = live_profiles(slices, plans, served, planning, self.live,
                                          paced=paced)
            return live, *reselect(auto, profile, live, current)

        try:
            # off the event loop (selection over many devices takes a while), time held
            # still meanwhile in virtual time
            with self.clock.hold():
                self.live, chosen, before, after = await asyncio.to_thread(decide)
        except ConfigError as exc:
            log.warning("re-planning after round %d failed, keeping the plans: %s",
                        round_no, exc)
            return
        if chosen == current:
            return
        if any((batch // n) * n != plan.samples_per_iteration
               for (_, n), plan in zip(chosen, self.plans, strict=True)):
            return  # see [Note: switching]: iterations per epoch must stay the same
        await self.compute.call(partial(self._switch_plans, chosen))
        event = Replan(round_no, epoch, before, after, tuple(chosen))
        self.replans.append(event)
        log.warning("re-planned after round %d: estimated epoch %.3g s -> %.3g s with "
                    "(P, N) = %s", round_no, before, after, chosen)

    def _switch_plans(self, chosen: list[tuple[int, int]]) -> None:
        """Adopt new (P_k, N_k): plans, replicas, sessions (between rounds; in the
        compute thread, which owns the replicas)."""
        batch = self.config.batch_size
        for k, (p, n) in enumerate(chosen):
            old = self.plans[k]
            if (p, n) == (old.split_point, old.parallel_batches):
                continue
            plan = DevicePlan(k, p, n, batch // n, old.iterations_per_epoch)
            self.plans[k] = plan
            self._half_specs.pop(k, None)
            if k in self.replicas:
                self.replicas[k] = self._replica(p, self.replicas[k])
            session = self.sessions.get(k)
            if session is not None:
                session.replan(plan, self.activation_shapes[p - 1])
        self.config = with_plans(self.config, chosen)

    async def _participants(self) -> list[int]:
        """Devices taking part (connected, or reconnecting within reconnect_grace); if none,
        wait (join_timeout) for one to come back.

        Raises:
            TrainingError: every device was lost and none returned in time.
        """
        def alive() -> list[int]:
            return sorted(k for k, s in self.sessions.items() if not s.ended)

        if not alive():
            log.warning("every device was lost; waiting up to %g s for one to rejoin",
                        self.join_timeout)
            self._copy_checkpoint()  # no round is coming soon: save now

            async def someone() -> None:
                while not alive():
                    self._arrived.clear()
                    await self._arrived.wait()

            try:
                await wait_for(self.clock, someone(), self.join_timeout)
            except TimeoutError:
                raise TrainingError(f"every device was lost and none rejoined within "
                                    f"{self.join_timeout:g} s") from None
        return alive()

    async def _prepare(self, k: int) -> dict[str, Any]:
        """Device k's half of the global model, for its `RoundStart` (compute thread)."""
        optimizer = self.replicas[k][1] if k in self.replicas else None

        def prepare() -> dict[str, Any]:
            if optimizer is not None:  # a lost round may have left gradients behind
                optimizer.zero_grad(set_to_none=True)
            return self._device_half_state(k)

        return await self.compute.call(prepare)

    async def _round(self, k: int, round_no: int, epoch: int, first: int,
                     iterations: int, half_state: dict[str, Any]) -> RoundResult | None:
        """Device k's part of a round, from its prepared half; None when the device was
        lost meanwhile."""
        session = self.sessions[k]
        if session.window is None and round_no > 0:
            log.warning("device %d takes part again from round %d", k, round_no)
        try:
            plan = self.plans[k]
            if self.config.mode == "fl":
                start = RoundStart(round_no, epoch, first, iterations, half_state)
            else:
                start = RoundStart(round_no, epoch, first, iterations, half_state,
                                   plan.split_point, plan.parallel_batches,
                                   plan.micro_batch_size)
            return await session.start_round(start)
        except DeviceLostError as exc:
            log.warning("round %d goes on without device %d: %s", round_no, k, exc)
            return None

    def _device_half_state(self, k: int) -> dict[str, Any]:
        half = models.split(self.model, self.plans[k].split_point)[0]
        return state_to_wire({key: v.detach().clone() for key, v in half.state_dict().items()})

    def _whole_state(self, k: int, result: RoundResult) -> dict[str, torch.Tensor]:
        device_half = state_from_wire(result.tensors)
        if self.config.mode == "fl":
            return dict(device_half)
        server_half = self.replicas[k][0].state_dict()
        return models.merge_states(device_half, server_half)

    def _aggregate(self, results: Mapping[int, RoundResult]) -> None:
        """FedAvg over the devices whose round completed, weighted by their samples."""
        states = [self._whole_state(k, res) for k, res in results.items()]
        weights = [float(res.samples) for res in results.values()]
        if sum(weights) == 0:
            return
        self._load_global(fedavg(states, weights))

    def _adopt(self, k: int, result: RoundResult) -> None:
        """SL: the next device starts from this device's weights."""
        self._load_global(self._whole_state(k, result))

    def _load_global(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
        for half, _ in self.replicas.values():
            own = half.state_dict()
            half.load_state_dict({key: state[key] for key in own})

    def _evaluate(self) -> float:
        self.model.eval()
        correct = 0
        try:
            with torch.no_grad():
                for first in range(0, len(self.test_set), 500):
                    x, y = self.test_set.batch(range(first, min(first + 500, len(self.test_set))))
                    correct += int((self.model(x).argmax(1) == y).sum())
        finally:
            self.model.train()
        return correct / max(1, len(self.test_set))

    def _busy(self, start: float, end: float) -> dict[str, float]:
        """Busy seconds per resource kind in [start, end]; device kinds are means."""
        totals = dict.fromkeys(RESOURCE_KINDS, 0.0)
        for track, busy in self.recorder.busy_by_track(start, end).items():
            totals[resource_kind(track)] += busy
        k = self.config.devices
        return {kind: value if kind == "server" else value / k
                for kind, value in totals.items()}

    def _link_bytes(self) -> tuple[int, int]:
        up = down = 0
        for session in self.sessions.values():
            received, sent = session.link_bytes()
            up += received
            down += sent
        return up, down

    def _frame_limit(self) -> int:
        state_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        batch = self.config.batch_size
        act = max(math.prod(s) for s in self.activation_shapes) * 4 * batch + 8 * batch
        # a RoundResult also carries the device's trace of the round: a few slices per
        # micro-batch, each well under 128 bytes as msgpack
        most = self.config.batch_size if self.auto_config else 0  # N after re-planning
        slices = max((p.iterations_per_epoch * (3 * max(p.parallel_batches, most) + 2) + 16)
                     for p in self.plans)
        return int(max(state_bytes, act) + HEADER_SLACK_BYTES + 256 * len(self.model.state_dict())
                + 128 * slices)

    def describe(self) -> dict[str, Any]:
        """Live state for ``GET /status``: devices, plan, progress, and the busy fraction of
        each resource kind in the epoch so far (device figures are means over devices;
        device-side work is known once a device reports its round)."""
        now = self.clock.now()
        live: dict[str, float] = {}
        if self.epoch >= 0 and now > self._epoch_start:
            elapsed = now - self._epoch_start
            live = {kind: round(busy / elapsed, 4)
                    for kind, busy in self._busy(self._epoch_start, now).items()}
        return {
            "mode": self.config.mode, "devices": self.config.devices,
            "joined": sorted(self.sessions), "connected": sorted(self.connected),
            "epoch": self.epoch, "round": self.rounds,
            "epochs": self.config.epochs,
            "busy_fraction": live,
            "plan": [{"device": p.device_id, "split_point": p.split_point,
                      "parallel_batches": p.parallel_batches,
                      "micro_batch_size": p.micro_batch_size} for p in self.plans],
            "replans": [r.to_mapping() for r in self.replans],
            "finished_epochs": [e.to_mapping() for e in self.epochs],
        }


def _new_tally(epoch: int, devices: int) -> dict[str, Any]:
    """An epoch's running totals (what a checkpoint needs to finish the epoch exactly)."""
    return {"epoch": epoch, "next_round": 0, "device_samples": [0] * devices,
            "loss_sum": 0.0, "correct": 0, "lost": [], "elapsed_before": 0.0}


def _epoch_from(values: Mapping[str, Any]) -> EpochMetrics:
    fields = dict(values)
    fields["device_samples"] = tuple(fields.get("device_samples", ()))
    fields["devices_lost"] = tuple(fields.get("devices_lost", ()))
    return EpochMetrics(**fields)
