"""The interface between the coordinator and a training system (see the package docs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol, cast

import torch
from torch import nn

from aiopipe import data as datasets
from aiopipe.clock import Clock
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, RemoteProtocolError
from aiopipe.metrics.trace import Recorder, Slice
from aiopipe.protocol import (
    Hello,
    Replica,
    ReplicaRequest,
    RoundResult,
    RoundStart,
    SecAggReply,
    SecAggRequest,
    TensorData,
)
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.device_half import DeviceHalf
from aiopipe.runtime.stage import ServerStage
from aiopipe.runtime.systems.registry import find_system
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile

__all__ = ["Rounds", "Setup", "System", "SystemDefaults", "mini_batches", "planning_batch_sizes",
           "refuse_replica",
           "system_class", "system_for"]


@dataclass(frozen=True, slots=True)
class Setup:
    """What every system starts from (devices' sample counts come later: `prepare`).

    ``model``: the whole model, initialized from the seed, for data of the kind
    ``data`` (`aiopipe.data.DataKind`: its inputs, target and classes); ``test_set``: the
    coordinator's evaluation data, if any (profiling loads micro-batches of it: data of
    the run's kind); ``cost_table``: charge
    compute from it (virtual time) and plan with it; ``run_secret``: this run's secret,
    from which peer keys derive; ``torch_device``: where the coordinator's own stages
    compute (the global model stays on the CPU); ``server_costs``: charge the
    coordinator's own stages from this table instead (virtual time with the server's
    hardware measured apart, e.g. a GPU: `bench/gpu_costs.py`), and plan the server's
    side with it, the devices' with ``cost_table``; None: ``cost_table`` for both.
    """

    config: RunConfig
    model: nn.Sequential
    data: datasets.DataKind
    test_set: datasets.Dataset | None
    cost_table: CostTable | None
    run_secret: bytes
    torch_device: torch.device
    server_costs: CostTable | None = None


class Rounds(Protocol):
    """What a system's round needs from the coordinator."""

    clock: Clock
    compute: Compute
    cost_table: CostTable | None
    recorder: Recorder  # the run's trace so far

    async def play(self, device_id: int, start: RoundStart, stage: ServerStage | None, *,
                   returns: Mapping[str, TensorData] | None = None) -> RoundResult | None:
        """Run device ``device_id``'s part of a round; None when it was lost meanwhile.
        ``returns``: the tensors its result must hold (names, dtypes, shapes), when not
        the ones ``start`` sends."""
        ...

    def session_of(self, device_id: int) -> int:
        """An id of device ``device_id``'s session (0: none): a new one when its process
        started afresh, the same across reconnections."""
        ...

    def copy_checkpoint(self) -> None:
        """Let a pending checkpoint's copy go now (the round's RoundStarts are taken)."""
        ...

    def address_of(self, device_id: int) -> str:
        """Where device ``device_id`` listens for peers ("" when it does not)."""
        ...

    async def settled_alive(self) -> list[int]:
        """The devices taking part, once none is between connections (waiting at most
        ``reconnect_grace`` for each to come back or be given up)."""
        ...

    def new_round(self) -> int:
        """A fresh round number (a round played again after a fault takes one)."""
        ...

    def record_change(self, change: dict[str, Any], *,
                      recovery: tuple[float, float] | None = None) -> None:
        """Keep what the system changed mid-round with its re-plans (a ``recovery``: with
        its span, from the fault noticed to training resumed, clock times)."""
        ...

    async def replicas(self, device_id: int, request: ReplicaRequest) -> list[Replica]:
        """Device ``device_id``'s answer to ``request`` (empty when it was lost)."""
        ...

    async def secagg(self, device_id: int, request: SecAggRequest) -> SecAggReply | None:
        """Device ``device_id``'s answer to a secure aggregation step (None when it was
        lost or too slow)."""
        ...


class System(Protocol):
    """One training system's coordinator half (see the package docstring)."""

    #: the system's device half
    device_half: ClassVar[type[DeviceHalf]]
    #: whether its devices link to each other (they listen for peers: an endpoint)
    links_devices: ClassVar[bool]
    #: whether the coordinator runs a stage for devices (it serves micro-batches)
    serves_stages: bool
    #: the coordinator's compute lanes: its stages' passes it runs at once
    server_lanes: int

    #: the run's config with every "auto" resolved
    config: RunConfig
    #: config keys a resumed run takes from its checkpoint (the plans "auto" chose)
    planned_keys: tuple[str, ...]
    #: whether a run can resume from this system's checkpoints
    resumable: bool
    #: whether a run goes on when a device is lost mid-run (its round played again, its
    #: update dropped, its ring bypassed...), so that the one-command launcher lets it
    recovers_lost_devices: ClassVar[bool]
    #: the whole model as the coordinator holds it between rounds
    model: nn.Sequential

    #: iterations per round (0: ``aggregation_every``'s, or the epoch's)
    round_iterations: int

    @property
    def devices_sit_out(self) -> bool:
        """Whether a device may sit rounds out while it is alive (drawn to train), so
        that its first round in a session may be any round."""
        ...

    #: whether the system plans from the devices' own profiles (aiopipe.runtime.profiling
    #: [Note: device profiles]): the coordinator asks them before `prepare`
    wants_profiles: bool

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """The micro-batch sizes the run's stages may compute at (its cost tables hold
        these and B)."""
        ...

    def __init__(self, setup: Setup) -> None:
        """Set the system up for the run ``setup`` describes.

        Raises:
            ConfigError: the config cannot run (no plan fits, a bad partition...).
        """
        ...

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Plan with what the devices announced (``samples[k]``: device k's training
        samples) and, when the system wants them, measured of themselves (``devices``),
        once every device has, before the first round.

        Raises:
            ConfigError: the fleet cannot run (no plan fits, too few samples...).
        """
        ...

    def plan_entries(self) -> list[dict[str, Any]]:
        """The plan as plain values (``metrics.jsonl``'s ``plan``, ``/status``); empty
        until `prepare`."""
        ...

    def iterations(self, device_id: int) -> int:
        """Iterations device ``device_id`` runs per epoch."""
        ...

    def refuse_hello(self, hello: Hello) -> str:
        """Why this system cannot take the device ("" when it can)."""
        ...

    def peer_keys(self, device_id: int) -> dict[str, str]:
        """The pair keys device ``device_id`` needs for its peer links (hex)."""
        ...

    def frame_limit(self) -> int:
        """The largest frame any message of the run can need, in bytes (after
        `prepare`)."""
        ...

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Run one round with ``participants``, ``work[k]`` iterations each from
        iteration ``first``; the results of the devices that completed it, already
        absorbed into `model`.

        Raises:
            TrainingError: the round cannot go on without a device that was lost.
        """
        ...

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """Device ``device_id`` sent ``replica`` unasked, in the round ``start`` began
        (None: none under way): keep it, or let it go when it is harmless.

        Raises:
            RemoteProtocolError: the system takes no such replica.
        """
        ...

    def refused_updates(self) -> list[int]:
        """Devices whose update was refused (star: `UpdateJudge`), or clipped or dropped
        (``outliers``), since the last call."""
        ...

    def epoch_samples(self, device_samples: Sequence[int]) -> int:
        """Samples the epoch trained, from what each device processed."""
        ...

    def stage_figures(self, busy: Mapping[str, float], elapsed: float,
                      peaks: Mapping[int, int], memory: Mapping[int, int]
                      ) -> list[dict[str, Any]]:
        """Per-stage figures of an epoch (``EpochMetrics.stages``) from the busy seconds
        per trace track, the epoch's length, each device's peak of live activations and
        the most bytes its training held, measured (0: not measured)."""
        ...

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """Between rounds: re-plan if the system does (``slices``: the round's trace;
        ``served[k]``: micro-batches the coordinator computed for device k; ``paced[k]``:
        whether k's link times its sends); what changed, for the record, or None."""
        ...

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """A copy of the tensors a checkpoint holds (compute thread)."""
        ...

    def resumed_config(self, mode: str) -> RunConfig:
        """The config a checkpoint of this run must hold, when it was written in
        ``mode``: the run's own, or, for a system that chooses the mode itself (mode
        auto), the run's config as it runs ``mode``."""
        ...

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's tensors and saved config (compute thread).

        Raises:
            ConfigError: this system cannot resume from it.
        """
        ...


class SystemDefaults:
    """What most systems' coordinator halves do alike, for a system to inherit and
    override where it differs: a run that is not resumable, devices that do not link, a
    coordinator that serves no stage, no re-plan between rounds, no replica taken, no
    update screened, every device's samples the epoch's, figures per resource kind only.
    Its ``config`` is the run's (set by the subclass's ``__init__``)."""

    config: RunConfig
    links_devices: ClassVar[bool] = False
    recovers_lost_devices: ClassVar[bool] = False
    serves_stages: bool = False
    server_lanes: int = 1
    resumable: bool = False
    planned_keys: tuple[str, ...] = ()
    wants_profiles: bool = False
    round_iterations: int = 0

    @property
    def devices_sit_out(self) -> bool:
        """Where devices are sampled per round (``devices_per_round``)."""
        return bool(self.config.devices_per_round)

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """Whole batches: B."""
        return [config.batch_size]

    def refuse_hello(self, hello: Hello) -> str:
        """Every device the run admits is taken."""
        return ""

    def peer_keys(self, device_id: int) -> dict[str, str]:
        """Devices do not link: none."""
        return {}

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """Its devices hold no replicas: refused."""
        refuse_replica(self.config.mode)

    def refused_updates(self) -> list[int]:
        """No update is screened: none."""
        return []

    def epoch_samples(self, device_samples: Sequence[int]) -> int:
        """Every device trains on its own samples: their sum."""
        return sum(device_samples)

    def stage_figures(self, busy: Mapping[str, float], elapsed: float,
                      peaks: Mapping[int, int], memory: Mapping[int, int]
                      ) -> list[dict[str, Any]]:
        """Figures per resource kind only (`EpochMetrics.busy_s`): none per stage."""
        return []

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """No re-plan between rounds: nothing changed."""
        return None

    def resumed_config(self, mode: str) -> RunConfig:
        """The run's own config, whatever ``mode`` the checkpoint was written in."""
        return self.config

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Not resumable: nothing."""
        return {}

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Not resumable.

        Raises:
            ConfigError: always.
        """
        raise ConfigError(f"mode {self.config.mode} cannot resume from a checkpoint")


def refuse_replica(mode: str) -> NoReturn:
    """`System.unasked_replica` of a system whose devices hold no replicas.

    Raises:
        RemoteProtocolError: always.
    """
    raise RemoteProtocolError(f"a replica in mode {mode}")


def system_class(mode: str) -> type[System]:
    """The coordinator half of the system that runs ``mode`` (`find_system`): what it
    declares, such as ``recovers_lost_devices``, can be asked before a run is set up.

    Raises:
        ConfigError: no such system.
    """
    return cast(type[System], find_system(mode))


def system_for(setup: Setup) -> System:
    """The system ``setup.config.mode`` names, set up (planned) for the run.

    Raises:
        ConfigError: the config cannot run (no plan fits, a bad partition...).
    """
    return system_class(setup.config.mode)(setup)


def planning_batch_sizes(config: RunConfig) -> list[int]:
    """Every batch size a cost table must hold for the run and its planner: the
    micro-batch sizes the run's system may use (its ``micro_batch_sizes``) and B for
    whole batches."""
    sizes = system_class(config.mode).micro_batch_sizes(config)
    return sorted({*sizes, config.batch_size})


def mini_batches(samples: Sequence[int], batch_size: int) -> list[int]:
    """Each device's whole mini-batches of ``batch_size`` in its announced ``samples``
    (the systems whose devices train the whole model at their own pace: HADFL, FedBuff).

    Raises:
        ConfigError: a device holds fewer samples than a mini-batch.
    """
    batches = [n // batch_size for n in samples]
    short = [k for k, n in enumerate(batches) if n < 1]
    if short:
        raise ConfigError(f"device {short[0]} holds {samples[short[0]]} samples, fewer "
                          f"than a mini-batch ({batch_size})")
    return batches
