"""`RunConfig`: everything a run needs, validated on construction, loadable from TOML.

A config is plain data. `RunConfig.to_mapping` gives the TOML-able form that travels to
devices inside `Plan.run` and is written to ``config.toml`` in the results directory;
`RunConfig.from_mapping` and `RunConfig.from_toml` read it back. Every invalid value
raises `ConfigError` with one line naming the key, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiopipe.entrypoints import is_entry_point
from aiopipe.errors import ConfigError

if TYPE_CHECKING:
    from aiopipe.transport.network import NetworkSpec

__all__ = [
    "AGGREGATIONS",
    "DATA_PARTITIONS",
    "INITIAL_WEIGHTS",
    "LINKED_MODES",
    "LOSSES",
    "MODES",
    "OPTIMIZERS",
    "OUTLIERS",
    "PIPELINE_MODES",
    "PRIVACY_METHODS",
    "REPLICA_MODES",
    "RESCHEDULINGS",
    "SCHEDULES",
    "STAR_MODES",
    "RunConfig",
    "devices_to_trim",
]

MODES = ("fl", "sl", "sfl", "pipar", "pipeline", "ftpipehd", "asteroid", "hadfl")
#: The modes whose devices form one pipeline and link to each other directly (a chain:
#: device p runs stage p; asteroid: a group of devices per stage).
PIPELINE_MODES = ("pipeline", "ftpipehd", "asteroid")
#: The modes whose devices link to each other directly (every device listens for peers).
LINKED_MODES = (*PIPELINE_MODES, "hadfl")
LOSSES = ("cross-entropy",)
AGGREGATIONS = ("fedavg", "fedmedian", "trimmed-mean", "krum")
OUTLIERS = ("keep", "clip", "drop")
OPTIMIZERS = ("sgd",)
DATA_PARTITIONS = ("iid", "dirichlet")
SCHEDULES = ("1f1b", "gpipe")
#: The modes whose devices talk only to the server (the star: fl, sl, sfl, pipar).
STAR_MODES = ("fl", "sl", "sfl", "pipar")
#: The modes whose server holds a replica of its half per device (``server_lanes``).
REPLICA_MODES = ("sfl", "pipar")
#: Differential privacy on the devices (aiopipe.runtime.privacy).
PRIVACY_METHODS = ("none", "classic", "pixeldp")
#: The keys only mode "hadfl" takes.
HADFL_KEYS = ("warmup_epochs", "warmup_learning_rate", "local_steps", "sync_periods",
              "ring_size", "version_smoothing", "ring_timeout", "group_size",
              "inter_group_every")
#: What a user's own module starts from: re-initialised from ``seed``, or its weights.
INITIAL_WEIGHTS = ("seed", "given")
#: How Asteroid re-plans after a device is lost (docs/design.md §Asteroid).
RESCHEDULINGS = ("lightweight", "heavy")

PerDevice = int | str | tuple[int, ...]


def _fail(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"config key {key!r}: got {value!r}, expected {expected}")


def devices_to_trim(trim: float) -> int:
    """The fewest models of which a trimmed mean with fraction ``trim`` (in (0, 0.5))
    drops one at each end: the least n with floor(trim x n) >= 1. 0 for a ``trim`` of 0
    (no count of models is trimmed)."""
    if not trim > 0:
        return 0
    n = max(1, math.ceil(1 / trim) - 1)
    while math.floor(trim * n) < 1:  # (1 / trim may round either way)
        n += 1
    return n


def _positive_int(key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(key, value, "an integer >= 1")
    return value


def _above(key: str, value: object, low: float) -> float:
    """``value`` as a float, once it is a finite number above ``low``.

    Raises:
        ConfigError: it is not (the message names the key).
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > low):
        raise _fail(key, value, f"a finite number > {low:g}")
    return float(value)


def _per_device(key: str, value: object, devices: int, *, allow_auto: bool) -> PerDevice:
    if isinstance(value, str):
        if allow_auto and value == "auto":
            return value
        raise _fail(key, value, '"auto", an integer or a list of integers' if allow_auto
                    else "an integer or a list of integers")
    if isinstance(value, int) and not isinstance(value, bool):
        return _positive_int(key, value)
    if isinstance(value, Sequence):
        items = tuple(_positive_int(key, v) for v in value)
        if len(items) != devices:
            raise _fail(key, list(value), f"a list of {devices} integers (one per device)")
        return items
    raise _fail(key, value, "an integer or a list of integers")


def _device_id(key: str, value: object, devices: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < devices:
        raise _fail(key, value, f"device ids in 0..{devices - 1}")
    return value


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What to train, how, on how many devices; see DESIGN §6.

    Attributes:
        mode: "pipar" (pipelined split learning), "sfl" (split-federated, N=1), "sl"
            (devices take turns on one server half), "fl" (FedAvg, whole model on
            devices), "pipeline" (a synchronous pipeline across the devices: device p
            runs stage p, device 0 holds the data, the last computes the loss; no
            server stage) or "ftpipehd" (the same chain, asynchronous: FTPipeHD's 1F1B
            with weight stashing, vertical sync and weight aggregation; whole batches
            stream through without a flush until the epoch ends) or "asteroid"
            (Asteroid's hybrid pipeline: stages run by groups of devices that split
            every micro-batch between them and all-reduce their stage's gradients
            before each step; the first stage's members hold the data) or "hadfl"
            (HADFL: every device trains the whole model on its own data, as many local
            steps as its speed allows in a period; then a few devices, chosen by their
            predicted versions, average their models over a ring of device-to-device
            links and one of them sends the average to the others; the coordinator
            plans and keeps a backup, off the data path).
        model: a model name of `aiopipe.models.MODEL_NAMES`, ``module:function`` (a
            factory, called with ``num_classes`` and ``in_shape`` if it takes them, that
            returns the ``nn.Sequential`` of split units; every node imports it), or,
            in-process only (it cannot go in TOML), such a factory itself (a callable)
            or the user's own ``torch.nn.Sequential``. A name's or a factory's weights
            are drawn under ``seed``.
        initial_weights: what a user's ``torch.nn.Sequential`` starts from: "seed" (the
            default) re-initialises a copy of it from ``seed`` (every module's
            ``reset_parameters()``), so that a run's initial weights are a function of
            the config alone: two configs built by one function train alike, whatever
            the global torch generator did in between; a module with parameters that no
            ``reset_parameters()`` covers is refused. "given": its own weights as they
            are (pretrained ones). Models by name or factory take only "seed"
            (docs/design.md §Initial weights).
        loss: "cross-entropy", or ``module:function``: a factory returning
            ``loss(logits, labels)``, the mean loss of a micro-batch.
        optimizer: "sgd" (with ``learning_rate`` and ``momentum``), or
            ``module:function``: a factory called with ``params`` and, if it takes
            them, ``learning_rate`` and ``momentum``, returning a torch optimizer.
        dataset: a dataset name (``synthetic-cifar10``...) or ``mnist:DIR`` style path:
            the server's evaluation set (its test split, ``test_samples`` of it), and
            the data an emulated fleet (the launcher, `aiopipe.simulate`, a device
            started without data of its own) shares out by ``data_partition``.
            Devices with data of their own train on that instead.
        devices: number of devices K.
        samples_per_device: training samples each device of an emulated fleet holds
            (one number, or one per device: unequal shares); devices with their own
            data hold what they hold (in a pipeline: device 0, which holds the data).
        batch_size: samples per optimizer step, B (PiPar splits it into N micro-batches
            of floor(B/N)).
        epochs: passes over each device's data.
        split_point: units on the device, P (1..Q-1), per device as a list, or "auto".
        parallel_batches: micro-batches per iteration, N, per device as a list, or
            "auto" (a pipeline: one integer).
        partition: a pipeline's S - 1 cut points (stage p holds units cut[p-1]+1..cut[p];
            increasing, in 1..Q-1), or "auto": stages of balanced compute (asteroid:
            Asteroid's planner chooses them with ``stage_groups``).
        stage_groups: asteroid: the devices of each stage, a list of S lists of device
            ids (every device in one; each micro-batch is split between a stage's
            devices by Asteroid's Algorithm 1), or "auto" (the planner, with
            ``partition`` "auto").
        rescheduling: asteroid: how the plan changes when a device is lost mid-round
            (the round is then played again from its start): "lightweight" (§3.4: a
            group keeps its units on the members left; a stage left without a device
            gives its units to its neighbours) or "heavy" (the planner from scratch over
            the devices left: the paper's straw-man).
        schedule: a pipeline's schedule, "1f1b" (K_p = 2(S - p) - 1 forwards on stage p
            before one forward, one backward) or "gpipe" (all forwards, then all
            backwards).
        version_aggregation: ftpipehd: stage p averages its S - p in-flight weight
            versions every this many times S - p updates (the paper's multiple; 0:
            never).
        global_replication_every: ftpipehd: batches between global replications (the
            pipeline flushes and the coordinator takes every stage's weights and
            momentum: a round ends; re-partitioning happens there, and a round lost to
            a fault is played again from there); 0: once per epoch.
        first_repartition_after: ftpipehd with "auto" cuts: the run's first
            re-partition comes after this many batches (the paper's 10: the pipeline
            flushes there, and the planner takes the capacities they measured), the
            next ones at each global replication; 0: at the first global replication.
        chain_replication_every: ftpipehd: batches between chain replications (each
            stage sends its weights and momentum to the next stage's device, the last
            stage to the coordinator; a round lost to a fault is played again from the
            latest point every stage's state survived); asteroid: batches of an epoch
            between stage backups (every device keeps its stage's state; a stage's
            only device also sends it to the first device of the next stage, the last
            stage's to the first stage's: a round lost to a fault is played again from
            the latest point every stage survived); 0: none.
        network: a preset ("4g", "4g+", "wifi", "lan") or a table with ``up_mbps``,
            ``down_mbps`` and optional ``latency_ms``; or a list of those, one per
            device (each device's own links, PiPar Eqs. 9-10).
        device_slowdown: compute slowdown factor per device (>= 1), one value or a list.
        aggregation_every: FedAvg every this many iterations; 0 means once per epoch.
        learning_rate, momentum: plain SGD on every model half.
        data_partition, dirichlet_alpha: how training data is spread over devices.
        test_samples: size of the server's held-out evaluation set (0: the server
            holds no data at all and reports no test accuracy).
        seed: everything random derives from it.
        out_dir: where the results directory goes ("" = do not write one).
        torch_threads: torch intra-op threads per node.
        shape_links: over websockets, pace each sender at the ``network`` rates
            (sender-side shaping, to emulate the network on one machine). Turn it off
            when the network itself is shaped (tc) or real; the planner still uses
            ``network`` as the bandwidth to plan with. Memory links always follow
            ``network``.
        heartbeat_interval: seconds between a device's heartbeats.
        device_timeout: seconds of silence (no message at all, heartbeats included)
            after which a connection is given up (so a silent device is lost after
            device_timeout + reconnect_grace, a disconnected one after reconnect_grace).
            It must exceed the time one frame takes on the slowest link. In ftpipehd it
            is also FTPipeHD's timer: device 0 stops a round that has waited this long
            for the same gradients, and the round is played again.
        reconnect_grace: seconds a device whose connection broke has to reconnect
            before the server declares it lost and its round goes on without it (the
            recovery time after a crash; a reconnect later than this rejoins at the next
            round).
        replan: with "auto" split points or micro-batch counts, re-estimate at every
            round boundary from live measurements (each device's compute and link
            speeds) and switch plans when the estimate improves enough. Off by default:
            on really shaped links between processes (bench/shaped.py, vgg5) every
            switch was estimated to help and made the epochs longer; see the README.
        replan_threshold: the relative improvement of the estimated remaining time a
            new plan needs before the coordinator switches to it (0.1 = 10%).
        device_memory_mb: memory budget per device for the planner (one value or one
            per device; 0 = unlimited): the device half's weights, gradients, momentum
            and the activations of N in-flight micro-batches must fit.
        aggregation: how a round's device models become the global model: "fedavg"
            (weighted by samples, PiPar Eq. 3), or a robust one that bounds what a few
            devices can do: "fedmedian" (coordinate-wise median), "trimmed-mean"
            (dropping ``trim_fraction`` of the highest and of the lowest values per
            coordinate), "krum" (the model nearest its neighbours, for at most
            ``byzantine_devices`` bad devices; needs devices >= that + 3).
        trim_fraction, byzantine_devices: see ``aggregation``. A trimmed mean that would
            trim nothing from a whole round (floor(trim_fraction x devices a round) = 0)
            is refused here with the number of devices it needs.
        outliers: what to do with a device whose update (its whole model, its server
            replica included, minus the round's starting model) is more than
            ``outlier_limit`` times the round's median update norm: "keep", "clip"
            (scaled down to the median's norm: it moves the aggregate no further than a
            typical device, in its own direction) or "drop" (left out of the
            aggregation); clipped or dropped devices are named in the log and in
            ``EpochMetrics.updates_refused``.
        outlier_limit: see ``outliers``.
        scale_limit: how far beyond the run's own scale what a peer sends may be,
            whatever the other options: in fl, sl, sfl and pipar a device's update that
            is not finite or whose norm is more than this many times the run's scale
            (the round's median update, or the recent accepted ones') is refused and its
            device named, and an aggregate beyond it is not installed
            (aiopipe.runtime.aggregation [Note: judging updates]); in the modes whose
            devices link, a tensor a device receives from a peer (activations,
            gradients, group gradients, replicas, ring chunks) whose largest magnitude
            is more than this many times that stream's recent ones (or, for a stream's
            first tensors, the same cut's in the run's initial model, or the receiver's
            own copy) is refused and its sender named and excluded
            (aiopipe.runtime.judge). NaN or Inf always is.
        warmup_epochs: hadfl: epochs of the mutual negotiation (§III-B), E_warmup: each
            is one round in which every device trains one epoch of its data at
            ``warmup_learning_rate`` and the whole fleet averages; the strategy comes
            from the seconds they took. 0: none (only with a fixed ``local_steps``).
        warmup_learning_rate: hadfl: the negotiation's (small) learning rate.
        local_steps: hadfl: "capacity" (Algorithm 1: each device trains as many
            mini-batches as fit its speed in a period of ``sync_periods``
            hyperperiods) or a number of mini-batches every device trains per round
            (with ``ring_size`` = devices: synchronous decentralized FedAvg; 1: every
            step all-reduced, as PyTorch DDP).
        sync_periods: hadfl: T_sync, hyperperiods between synchronisations.
        ring_size: hadfl: N_p, the devices that average their models each round (0:
            half the devices, at least 2).
        version_smoothing: hadfl: Holt's smoothing factor alpha (Eq. 7), in (0, 1).
        group_size: hadfl: devices per group when there are many (§III-C): each round
            every group averages within itself (``ring_size`` of its devices, its
            sender sending on to the rest of the group); 0: one group of all.
        inter_group_every: hadfl with groups: every this many rounds the round is an
            inter-group synchronisation instead: one device of each group (drawn as
            rings are) average, and the average goes to every other device.
        privacy: differential privacy on the devices (fl, sl, sfl, pipar; PiPar §5.6.2):
            "none", "classic" (Gaussian noise on the device's model half before it is
            uploaded) or "pixeldp" (a noise layer before the device's first layer:
            Gaussian noise on every training input); aiopipe.runtime.privacy.
        privacy_noise: the noise's standard deviation (weights' units for classic,
            inputs' for pixeldp: synthetic and normalised data have unit variance).
        server_lanes: sfl, pipar: passes of different devices' server replicas the server
            runs at once (PiPar §3.2.3 Fig. 3c): its compute threads, for a server with
            that many cores or a GPU; 1 runs every pass in turn. The planner plans with
            it ([Note: server lanes]); each device's own passes stay in order.
        devices_per_round: fl, sl, sfl, pipar: how many devices train in each round,
            sampled anew every round (Flower's fraction_fit in spirit): 0, every device;
            an integer n >= 1, n of them; a fraction in (0, 1), that share of the
            devices rounded up. The choice is seeded by ``seed``, the epoch and the round
            (`sampled_devices`), among the devices alive then, and recorded in each
            epoch's ``sampled``; FedAvg weighs the sampled devices' samples.
        ring_timeout: hadfl: seconds a ring member waits for its upstream before it
            asks whether it is alive (a handshake); an upstream that does not answer
            within as long again (or whose link broke) is bypassed.
        profile_devices: with "auto" (and in mode asteroid, any plan: its rows are
            balanced by speed) on real clocks, plan from what each device measures of
            itself where it runs (its units' times, its links' rates:
            aiopipe.runtime.profiling); false: from the server's own table times each
            device's ``device_slowdown`` and the ``network`` as declared.

    Raises:
        ConfigError: a field has an invalid value (the message names the key).
    """

    mode: str = "pipar"
    model: Any = "vgg5"
    initial_weights: str = "seed"
    loss: str = "cross-entropy"
    optimizer: str = "sgd"
    dataset: str = "synthetic-cifar10"
    devices: int = 2
    samples_per_device: int | tuple[int, ...] = 2000
    batch_size: int = 48  # N = 4, the default, divides it: no sample of a batch left out
    epochs: int = 3
    split_point: PerDevice = 2
    parallel_batches: PerDevice = 4
    network: str | Mapping[str, float] | tuple[str | Mapping[str, float], ...] = "lan"
    device_slowdown: float | tuple[float, ...] = 1.0
    aggregation_every: int = 0
    learning_rate: float = 0.02
    momentum: float = 0.9
    partition: str | tuple[int, ...] = "auto"
    stage_groups: str | tuple[tuple[int, ...], ...] = "auto"
    schedule: str = "1f1b"
    rescheduling: str = "lightweight"
    data_partition: str = "iid"
    dirichlet_alpha: float = 0.5
    test_samples: int = 1000
    seed: int = 0
    out_dir: str = ""
    torch_threads: int = 1
    shape_links: bool = True
    heartbeat_interval: float = 5.0
    device_timeout: float = 60.0
    reconnect_grace: float = 10.0
    replan: bool = False
    replan_threshold: float = 0.1
    device_memory_mb: float | tuple[float, ...] = 0.0
    profile_devices: bool = True
    aggregation: str = "fedavg"
    trim_fraction: float = 0.2
    byzantine_devices: int = 1
    outliers: str = "keep"
    outlier_limit: float = 10.0
    scale_limit: float = 1000.0
    version_aggregation: int = 1
    global_replication_every: int = 100
    chain_replication_every: int = 50
    first_repartition_after: int = 10
    warmup_epochs: int = 1
    warmup_learning_rate: float = 0.002
    local_steps: int | str = "capacity"
    sync_periods: int = 1
    ring_size: int = 0
    version_smoothing: float = 0.5
    ring_timeout: float = 5.0
    group_size: int = 0
    inter_group_every: int = 4
    privacy: str = "none"
    privacy_noise: float = 0.01
    server_lanes: int = 1
    devices_per_round: int | float = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise _fail("mode", self.mode, f"one of {', '.join(MODES)}")
        self._check_model()
        if not isinstance(self.dataset, str) or not self.dataset:
            raise _fail("dataset", self.dataset, "a dataset name")
        for key, builtin in (("loss", LOSSES), ("optimizer", OPTIMIZERS)):
            value = getattr(self, key)
            if value not in builtin and not is_entry_point(value):
                raise _fail(key, value, f"{' or '.join(map(repr, builtin))} or module:function")
        for key in ("devices", "batch_size", "epochs", "torch_threads"):
            _positive_int(key, getattr(self, key))
        tests = self.test_samples
        if isinstance(tests, bool) or not isinstance(tests, int) or tests < 0:
            raise _fail("test_samples", tests, "an integer >= 0 (0: no evaluation set)")
        set_ = object.__setattr__
        set_(self, "samples_per_device", _per_device(
            "samples_per_device", self.samples_per_device, self.devices, allow_auto=False))
        set_(self, "split_point", _per_device("split_point", self.split_point, self.devices,
                                              allow_auto=True))
        set_(self, "parallel_batches", _per_device("parallel_batches", self.parallel_batches,
                                                   self.devices, allow_auto=True))
        batches = self.parallel_batches
        for n in batches if isinstance(batches, tuple) else (batches,):
            if isinstance(n, int) and n > self.batch_size:
                raise _fail("parallel_batches", n, f"at most batch_size ({self.batch_size})")
        network = self.network
        if isinstance(network, Sequence) and not isinstance(network, str):
            if len(network) != self.devices:
                raise _fail("network", list(network), f"one network, or {self.devices} "
                            "(one per device)")
            set_(self, "network", tuple(_network(v) for v in network))
        else:
            set_(self, "network", _network(network))
        slowdown = self.device_slowdown
        values = slowdown if isinstance(slowdown, Sequence) else (slowdown,)
        if isinstance(slowdown, Sequence) and len(values) != self.devices:
            raise _fail("device_slowdown", list(values), f"one number or {self.devices} numbers")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                math.isfinite(v) and v >= 1.0
            ):
                raise _fail("device_slowdown", v, "a finite number >= 1")
        if isinstance(slowdown, Sequence):
            set_(self, "device_slowdown", tuple(float(v) for v in values))
        else:
            set_(self, "device_slowdown", float(slowdown))
        every = self.aggregation_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise _fail("aggregation_every", self.aggregation_every, "an integer >= 0")
        for key in ("learning_rate", "momentum", "dirichlet_alpha"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value >= 0
            ):
                raise _fail(key, value, "a finite number >= 0")
            set_(self, key, float(value))
        for key in ("learning_rate", "dirichlet_alpha"):
            if getattr(self, key) <= 0:
                raise _fail(key, getattr(self, key), "a finite number > 0")
        if self.data_partition not in DATA_PARTITIONS:
            raise _fail("data_partition", self.data_partition,
                        f"one of {', '.join(DATA_PARTITIONS)}")
        self._check_pipeline()
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise _fail("seed", self.seed, "an integer")
        for key in ("heartbeat_interval", "device_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0
            ):
                raise _fail(key, value, "a finite number of seconds > 0")
            set_(self, key, float(value))
        if self.device_timeout <= self.heartbeat_interval:
            raise _fail("device_timeout", self.device_timeout,
                        f"more than heartbeat_interval ({self.heartbeat_interval:g} s)")
        grace = self.reconnect_grace
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not (
            math.isfinite(grace) and grace > 0
        ):
            raise _fail("reconnect_grace", grace, "a finite number of seconds > 0")
        set_(self, "reconnect_grace", float(grace))
        for key in ("shape_links", "replan", "profile_devices"):
            if not isinstance(getattr(self, key), bool):
                raise _fail(key, getattr(self, key), "true or false")
        threshold = self.replan_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not (
            math.isfinite(threshold) and 0 <= threshold < 1
        ):
            raise _fail("replan_threshold", threshold, "a number in [0, 1)")
        set_(self, "replan_threshold", float(threshold))
        budget = self.device_memory_mb
        budgets = budget if isinstance(budget, Sequence) else (budget,)
        if isinstance(budget, Sequence) and len(budgets) != self.devices:
            raise _fail("device_memory_mb", list(budgets),
                        f"one number or {self.devices} numbers")
        for v in budgets:
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                math.isfinite(v) and v >= 0
            ):
                raise _fail("device_memory_mb", v, "a finite number of MB >= 0 (0 = unlimited)")
        set_(self, "device_memory_mb", tuple(float(v) for v in budgets)
             if isinstance(budget, Sequence) else float(budget))
        if not isinstance(self.out_dir, str):
            raise _fail("out_dir", self.out_dir, "a path string")
        self._check_aggregation()
        self._check_hadfl()
        self._check_privacy()
        self._check_server_lanes()
        self._check_devices_per_round()
        self._check_trim()

    def _check_devices_per_round(self) -> None:
        """Sampling per round: 0, a count up to ``devices``, or a fraction in (0, 1); only
        where a round is a set of devices training from the global model."""
        value = self.devices_per_round
        expected = f"0 (every device), an integer 1..{self.devices} or a fraction in (0, 1)"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail("devices_per_round", value, expected)
        if isinstance(value, int) and not 0 <= value <= self.devices:
            raise _fail("devices_per_round", value, expected)
        if isinstance(value, float) and not 0 < value < 1:
            raise _fail("devices_per_round", value, expected)
        if value and self.mode not in STAR_MODES:
            raise _fail("devices_per_round", value, f"0 in mode {self.mode} (devices are "
                        "sampled per round in fl, sl, sfl and pipar)")

    def _check_trim(self) -> None:
        """A trimmed mean must trim something from a whole fleet's round (a round that
        lost devices and trims nothing is warned about: `Star`)."""
        if self.aggregation != "trimmed-mean":
            return
        trim, size = self.trim_fraction, self.round_size(self.devices)
        need = devices_to_trim(trim)
        if not need:
            raise _fail("trim_fraction", trim, "a fraction > 0 with aggregation "
                        "\"trimmed-mean\" (0 trims nothing: that is an unweighted mean)")
        if size < need:
            least = math.ceil(1000 / size) / 1000  # shown as is: floor(least x size) >= 1
            fits = (f", or trim_fraction >= {least:g}" if size >= 3
                    else " (a trimmed mean needs at least 3)")
            raise _fail("trim_fraction", trim, f"at least {need} devices a round to trim "
                        f"any (floor({trim:g} x {size}) = 0: nothing would be trimmed){fits}")

    def round_size(self, alive: int) -> int:
        """Devices that train in a round when ``alive`` can (`devices_per_round`)."""
        value = self.devices_per_round
        wanted = (self.devices if not value else value if isinstance(value, int)
                  else math.ceil(value * self.devices))
        return min(wanted, alive)

    def _check_server_lanes(self) -> None:
        """Concurrent server passes: a count >= 1, above 1 only where the server holds a
        replica per device (sfl, pipar)."""
        lanes = self.server_lanes
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise _fail("server_lanes", lanes, "an int >= 1")
        if lanes > 1 and self.mode not in REPLICA_MODES:
            raise _fail("server_lanes", lanes, f"1 in mode {self.mode} (the server runs "
                        "one replica per device only in sfl and pipar)")

    def _check_privacy(self) -> None:
        """The devices' differential privacy: a known method, in a star mode."""
        if self.privacy not in PRIVACY_METHODS:
            raise _fail("privacy", self.privacy, f"one of {', '.join(PRIVACY_METHODS)}")
        if self.privacy != "none" and self.mode not in STAR_MODES:
            raise _fail("privacy", self.privacy, f'"none" in mode {self.mode} (it is for '
                        "fl, sl, sfl and pipar)")
        object.__setattr__(self, "privacy_noise", _above("privacy_noise", self.privacy_noise, 0))

    def _check_hadfl(self) -> None:
        """HADFL's keys: valid, and given only in mode hadfl."""
        if self.mode != "hadfl":
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for key in HADFL_KEYS:
                if getattr(self, key) != defaults[key]:
                    raise _fail(key, getattr(self, key), 'its default: it is for mode "hadfl"')
            return
        warmup = self.warmup_epochs
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise _fail("warmup_epochs", warmup, "an integer >= 0")
        steps = self.local_steps
        if steps != "capacity":
            _positive_int("local_steps", steps)
        elif warmup == 0:
            raise _fail("warmup_epochs", 0, '>= 1 with local_steps "capacity" (its times '
                        "size the local steps)")
        _positive_int("sync_periods", self.sync_periods)
        _positive_int("inter_group_every", self.inter_group_every)
        group = self.group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise _fail("group_size", group, "an integer >= 0 (0: one group)")
        size = self.ring_size
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= self.devices:
            raise _fail("ring_size", size, f"an integer in 0..{self.devices} (0: half the "
                        "devices)")
        for key, low, high in (("warmup_learning_rate", 0.0, math.inf),
                               ("version_smoothing", 0.0, 1.0), ("ring_timeout", 0.0, math.inf)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    low < value < high):
                raise _fail(key, value, f"a number in ({low:g}, {high:g})")
            object.__setattr__(self, key, float(value))
        if self.aggregation_every:
            raise _fail("aggregation_every", self.aggregation_every,
                        "0 for hadfl (its rounds are its synchronisation periods)")

    def _check_model(self) -> None:
        """``model`` and ``initial_weights`` ([Note: initial weights] in
        aiopipe/runtime/factories.py)."""
        model, weights = self.model, self.initial_weights
        kinds = "a model name, module:function, a callable factory or a torch.nn.Sequential"
        if weights not in INITIAL_WEIGHTS:
            raise _fail("initial_weights", weights, " or ".join(
                f'"{w}"' for w in INITIAL_WEIGHTS))
        own = False  # a module with weights of its own
        if isinstance(model, str):
            if not model or (":" in model and not is_entry_point(model)):
                raise _fail("model", model, kinds)
        else:
            from torch import nn  # local: config stays importable without building models

            own = isinstance(model, nn.Sequential)
            if not own and (isinstance(model, nn.Module) or not callable(model)):
                raise _fail("model", model, kinds)
        if weights == "given" and not own:
            raise _fail("initial_weights", weights, '"seed" for a model built by name or '
                        'factory (its weights are drawn under seed; "given" keeps a '
                        "torch.nn.Sequential's own weights)")
        if own and weights == "seed":
            from aiopipe.runtime.factories import parameters_not_reset  # torch-bound

            missed = parameters_not_reset(model)
            if missed:
                named = ", ".join(missed[:5]) + (f" and {len(missed) - 5} more"
                                                 if len(missed) > 5 else "")
                owners = " and ".join(sorted({type(model.get_submodule(
                    name.rpartition(".")[0])).__name__ for name in missed}))
                raise ConfigError(
                    f"config key 'model': no reset_parameters() re-initialises "
                    f"{'parameters' if len(missed) > 1 else 'parameter'} {named} (of "
                    f'{owners}), which initial_weights "seed" needs (it draws the '
                    f"model's weights again from seed); give {owners} a "
                    "reset_parameters(), pass a factory that builds the model "
                    '(model=my_model, called under the seed), or set initial_weights='
                    "\"given\" to train from the module's own weights")

    def ring_members(self, devices: int | None = None) -> int:
        """HADFL's N_p among ``devices`` (default: the fleet; a group's size): ``ring_size``,
        or half of them (at least 2, at most all)."""
        n = self.devices if devices is None else devices
        return min(n, self.ring_size or max(2, math.ceil(n / 2)))

    def _check_aggregation(self) -> None:
        """The aggregation's keys."""
        if self.aggregation not in AGGREGATIONS:
            raise _fail("aggregation", self.aggregation, f"one of {', '.join(AGGREGATIONS)}")
        trim = self.trim_fraction
        if isinstance(trim, bool) or not isinstance(trim, int | float) or not 0 <= trim < 0.5:
            raise _fail("trim_fraction", trim, "a number in [0, 0.5)")
        object.__setattr__(self, "trim_fraction", float(trim))
        f = self.byzantine_devices
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise _fail("byzantine_devices", f, "an integer >= 0")
        if self.aggregation == "krum" and self.devices < f + 3:
            raise _fail("byzantine_devices", f, f"at most devices - 3 ({self.devices - 3}) "
                        "for krum")
        if self.outliers not in OUTLIERS:
            raise _fail("outliers", self.outliers, f"one of {', '.join(OUTLIERS)}")
        object.__setattr__(self, "outlier_limit", _above("outlier_limit", self.outlier_limit, 1))
        object.__setattr__(self, "scale_limit", _above("scale_limit", self.scale_limit, 1))

    def _check_pipeline(self) -> None:
        """The pipeline's keys: valid, and given only where they mean something."""
        partition = self.partition
        if partition in DATA_PARTITIONS:
            raise _fail("partition", partition, '"auto" or a list of cut points (the data '
                        "partition is now data_partition)")
        if isinstance(partition, int) and not isinstance(partition, bool):
            partition = (partition,)  # one cut point: two stages
        if isinstance(partition, Sequence) and not isinstance(partition, str):
            cuts = tuple(_positive_int("partition", v) for v in partition)
            if any(b <= a for a, b in itertools.pairwise(cuts)):
                raise _fail("partition", list(cuts), "increasing cut points")
            if self.mode in ("pipeline", "ftpipehd") and len(cuts) != self.devices - 1:
                raise _fail("partition", list(cuts),
                            f"{self.devices - 1} cut points (one fewer than the devices)")
            object.__setattr__(self, "partition", cuts)
        elif partition != "auto":
            raise _fail("partition", partition, '"auto" or a list of cut points')
        if self.schedule not in SCHEDULES:
            raise _fail("schedule", self.schedule, f"one of {', '.join(SCHEDULES)}")
        for name, initial in (("version_aggregation", 1), ("global_replication_every", 100),
                              ("chain_replication_every", 50), ("first_repartition_after", 10)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _fail(name, value, "an integer >= 0")
            modes = (("ftpipehd", "asteroid") if name == "chain_replication_every"
                     else ("ftpipehd",))
            if self.mode not in modes and value != initial:
                raise _fail(name, value, f"its default: it is for mode "
                            f"{' and '.join(map(repr, modes))}".replace("'", '"'))
        if self.mode == "ftpipehd" and self.optimizer != "sgd":
            raise _fail("optimizer", self.optimizer, 'its default, "sgd": ftpipehd applies SGD '
                        "(learning_rate, momentum) itself, to each stage's weight versions")
        if self.mode == "ftpipehd" and self.schedule != "1f1b":
            raise _fail("schedule", self.schedule, 'its default: ftpipehd runs 1F1B')
        self._check_stage_groups()
        if self.rescheduling not in RESCHEDULINGS:
            raise _fail("rescheduling", self.rescheduling, f"one of {', '.join(RESCHEDULINGS)}")
        if self.mode != "asteroid" and self.rescheduling != "lightweight":
            raise _fail("rescheduling", self.rescheduling, 'its default: it is for mode '
                        '"asteroid"')
        if self.mode not in PIPELINE_MODES:
            for key, default in (("partition", "auto"), ("schedule", "1f1b")):
                if getattr(self, key) != default:
                    raise _fail(key, getattr(self, key), f'its default: {key} is for mode '
                                f'"pipeline" ({self.mode} splits at split_point)')
            return
        if self.devices < 2:
            raise _fail("devices", self.devices, "at least 2 for a pipeline (one per stage)")
        if not isinstance(self.parallel_batches, int):
            raise _fail("parallel_batches", self.parallel_batches,
                        "one integer for a pipeline (micro-batches per iteration)")
        if self.aggregation_every:
            raise _fail("aggregation_every", self.aggregation_every,
                        "0 for a pipeline (its rounds are epochs: it aggregates nothing)")

    def _check_stage_groups(self) -> None:
        """Asteroid's stage groups: "auto" with an "auto" partition, or every device in
        exactly one of one more groups than cut points."""
        groups = self.stage_groups
        if groups == "auto":
            if self.mode == "asteroid" and self.partition != "auto":
                raise _fail("partition", list(self.partition), '"auto" when stage_groups '
                            'is "auto" (the planner chooses both)')
            return
        if self.mode != "asteroid":
            raise _fail("stage_groups", groups, 'its default, "auto": it is for mode '
                        '"asteroid"')
        if isinstance(groups, str) or not isinstance(groups, Sequence) or not groups or any(
                isinstance(g, str) or not isinstance(g, Sequence) or not g for g in groups):
            raise _fail("stage_groups", groups, '"auto" or a list of non-empty lists of '
                        "device ids")
        fixed = tuple(tuple(_device_id("stage_groups", d, self.devices) for d in g)
                      for g in groups)
        members = sorted(d for g in fixed for d in g)
        if members != list(range(self.devices)):
            raise _fail("stage_groups", [list(g) for g in fixed],
                        f"every device of 0..{self.devices - 1} in exactly one group")
        if self.partition == "auto" or len(self.partition) != len(fixed) - 1:
            raise _fail("partition", self.partition, f"{len(fixed) - 1} cut points (one "
                        "fewer than the stage groups)")
        object.__setattr__(self, "stage_groups", fixed)

    # -- per-device views ------------------------------------------------------------

    def device_split_point(self, device_id: int) -> int | str:
        """P for one device ("auto" until a planner resolves it)."""
        return _pick(self.split_point, device_id)

    def device_parallel_batches(self, device_id: int) -> int | str:
        """N for one device ("auto" until a planner resolves it)."""
        return _pick(self.parallel_batches, device_id)

    def device_samples_of(self, device_id: int) -> int:
        """Training samples device ``device_id`` holds in an emulated fleet."""
        return int(_pick(self.samples_per_device, device_id))

    def device_memory_bytes_of(self, device_id: int) -> int | None:
        """One device's memory budget in bytes; None when unlimited."""
        budget = self.device_memory_mb
        mb = float(budget[device_id] if isinstance(budget, tuple) else budget)
        return int(mb * 2**20) if mb > 0 else None

    def device_network(self, device_id: int) -> NetworkSpec:
        """Device ``device_id``'s links (up: device to server, down: the reverse)."""
        from aiopipe.transport.network import network_spec  # pure; local keeps layers apart

        network = self.network
        return network_spec(network[device_id] if isinstance(network, tuple) else network)

    def device_slowdown_of(self, device_id: int) -> float:
        """Compute slowdown factor of one device."""
        slowdown = self.device_slowdown
        return float(slowdown[device_id] if isinstance(slowdown, tuple) else slowdown)

    # -- conversions -----------------------------------------------------------------

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_mapping(self) -> dict[str, Any]:
        """Plain TOML-able values of every field (a custom model becomes "custom")."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "model" and not isinstance(value, str):
                value = "custom"
            if isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            if isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build from plain values, refusing unknown keys.

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in known]  # in the order given
        if unknown:
            raise ConfigError(_unknown_keys(unknown, known))
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in values.items()}
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> RunConfig:
        """Load a TOML file (top-level keys, or a ``[run]`` table), then apply overrides.

        Raises:
            ConfigError: the file is missing, is not valid TOML, or holds invalid values.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        if "run" in data and isinstance(data["run"], dict):
            if len(data) > 1:
                raise ConfigError(f"config file {str(path)!r}: put the run keys either at top "
                                  f"level or under [run], not both")
            data = data["run"]
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_mapping(data)

    def to_toml(self) -> str:
        """The config as a TOML document (what ``config.toml`` in a results dir holds)."""
        lines = []
        for key, value in self.to_mapping().items():
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _unknown_keys(unknown: Sequence[object], known: set[str]) -> str:
    """The error for keys that no `RunConfig` field has: each one named, with the known
    key it likely meant (`_likely_key`), and the known keys listed when one of them has
    no such guess; e.g. ``unknown config keys 'epoch' (did you mean 'epochs'?), 'lr'
    (did you mean 'learning_rate'?)``."""
    names = sorted(known)
    said, unguessed = [], False
    for key in unknown:
        guess = _likely_key(key, names)
        said.append(repr(key) if guess is None else f"{key!r} (did you mean {guess!r}?)")
        unguessed = unguessed or guess is None
    text = f"unknown config {'key' if len(unknown) == 1 else 'keys'} {', '.join(said)}"
    return text + (f"; known keys: {', '.join(names)}" if unguessed else "")


def _likely_key(key: object, names: Sequence[str]) -> str | None:
    """The known key ``key`` likely meant: itself in lower case with underscores
    ("Batch-Size"), the one whose words' initials it is ("lr": learning_rate), or the
    closest spelling (`difflib.get_close_matches`: "epoch", "split_pont"); None when
    none is close."""
    if not isinstance(key, str):
        return None
    plain = key.strip().lower().replace("-", "_")
    if plain in names:
        return plain
    initials = [n for n in names if "_" in n and "".join(w[:1] for w in n.split("_")) == plain]
    if len(initials) == 1:
        return initials[0]
    close = difflib.get_close_matches(plain, names, n=1)
    return close[0] if close else None


def _network(value: object) -> str | dict[str, Any]:
    """One network: a preset name or a table of rates.

    Raises:
        ConfigError: neither, or a table with no rates (unshaped is "lan").
    """
    from aiopipe.transport.network import network_spec  # pure; local keeps layers apart

    if isinstance(value, Mapping):
        value = dict(value)
        if any(v is None for v in value.values()):
            raise _fail("network", value,
                        'numbers for up_mbps and down_mbps (for no shaping use "lan")')
    elif not isinstance(value, str):
        raise _fail("network", value, 'a preset name or {up_mbps=.., down_mbps=..}')
    try:
        network_spec(value)
    except ConfigError as exc:
        raise ConfigError(f"config key 'network': {exc}") from None
    return value


def _pick(value: PerDevice, device_id: int) -> int | str:
    if isinstance(value, tuple):
        return value[device_id]
    return value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise ConfigError(f"cannot write {value!r} to TOML")


def _toml_string(text: str) -> str:
    # TOML basic strings allow no raw control characters (tab aside): escape them all.
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(key: object) -> str:
    text = str(key)
    if text and all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in text):
        return text
    return _toml_string(text)
