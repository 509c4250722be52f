"""`RunConfig`: everything a run needs, validated on construction, loadable from TOML.

A config is plain data. `RunConfig.to_mapping` gives the TOML-able form that travels to
devices inside `Plan.run` and is written to ``config.toml`` in the results directory;
`RunConfig.from_mapping` and `RunConfig.from_toml` read it back. Every invalid value
raises `ConfigError` with one line naming the key, the value and what is accepted.

Beside it: aiopipe.config_values (the named choices and checks of single values),
aiopipe.config_keys (unknown keys) and aiopipe.config_toml (TOML in and out). None of
them imports this module. The keys of one system are its own, declared and checked in
its package (aiopipe.runtime.systems.<name>.options, found through the registry).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiopipe.config_keys import unknown_keys
from aiopipe.config_toml import fold_system_tables, read_run_keys, toml_document
from aiopipe.config_values import (
    AGGREGATIONS,
    DATA_PARTITIONS,
    INITIAL_WEIGHTS,
    LOSSES,
    OPTIMIZERS,
    OUTLIERS,
    PRIVACY_METHODS,
    RESCHEDULINGS,
    SCHEDULES,
    PerDevice,
    above,
    fail,
    one_network,
    per_device,
    pick,
    positive_int,
)
from aiopipe.entrypoints import is_entry_point
from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.registry import BUILT_IN, check_system, options_of

if TYPE_CHECKING:
    from aiopipe.transport.network import NetworkSpec

__all__ = [
    "AGGREGATIONS",
    "DATA_PARTITIONS",
    "INITIAL_WEIGHTS",
    "LOSSES",
    "MODES",
    "OPTIMIZERS",
    "OUTLIERS",
    "PRIVACY_METHODS",
    "RESCHEDULINGS",
    "SCHEDULES",
    "RunConfig",
]

#: The built-in modes (a run may also name a system of its own: "module:attribute").
MODES = tuple(BUILT_IN)
#: A run's mode when nothing names one.
_DEFAULT_MODE = "pipar"


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
        options: the values of the options a user's system declares of its own (keys
            that are not `RunConfig`'s: `SystemOptions.defaults`), read with `option`;
            empty for the built-in systems, whose options are keys of their own.

    Raises:
        ConfigError: a field has an invalid value (the message names the key).
    """

    mode: str = _DEFAULT_MODE
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
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            raise fail("mode", self.mode, f"one of {', '.join(MODES)} or module:attribute")
        self._check_model()
        if not isinstance(self.dataset, str) or not self.dataset:
            raise fail("dataset", self.dataset, "a dataset name")
        for key, builtin in (("loss", LOSSES), ("optimizer", OPTIMIZERS)):
            value = getattr(self, key)
            if value not in builtin and not is_entry_point(value):
                raise fail(key, value, f"{' or '.join(map(repr, builtin))} or module:function")
        for key in ("devices", "batch_size", "epochs", "torch_threads"):
            positive_int(key, getattr(self, key))
        tests = self.test_samples
        if isinstance(tests, bool) or not isinstance(tests, int) or tests < 0:
            raise fail("test_samples", tests, "an integer >= 0 (0: no evaluation set)")
        set_ = object.__setattr__
        set_(self, "samples_per_device", per_device(
            "samples_per_device", self.samples_per_device, self.devices, allow_auto=False))
        set_(self, "split_point", per_device("split_point", self.split_point, self.devices,
                                             allow_auto=True))
        set_(self, "parallel_batches", per_device("parallel_batches", self.parallel_batches,
                                                  self.devices, allow_auto=True))
        batches = self.parallel_batches
        for n in batches if isinstance(batches, tuple) else (batches,):
            if isinstance(n, int) and n > self.batch_size:
                raise fail("parallel_batches", n, f"at most batch_size ({self.batch_size})")
        network = self.network
        if isinstance(network, Sequence) and not isinstance(network, str):
            if len(network) != self.devices:
                raise fail("network", list(network), f"one network, or {self.devices} "
                           "(one per device)")
            set_(self, "network", tuple(one_network(v) for v in network))
        else:
            set_(self, "network", one_network(network))
        slowdown = self.device_slowdown
        values = slowdown if isinstance(slowdown, Sequence) else (slowdown,)
        if isinstance(slowdown, Sequence) and len(values) != self.devices:
            raise fail("device_slowdown", list(values), f"one number or {self.devices} numbers")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                math.isfinite(v) and v >= 1.0
            ):
                raise fail("device_slowdown", v, "a finite number >= 1")
        if isinstance(slowdown, Sequence):
            set_(self, "device_slowdown", tuple(float(v) for v in values))
        else:
            set_(self, "device_slowdown", float(slowdown))
        every = self.aggregation_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise fail("aggregation_every", self.aggregation_every, "an integer >= 0")
        for key in ("learning_rate", "momentum", "dirichlet_alpha"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value >= 0
            ):
                raise fail(key, value, "a finite number >= 0")
            set_(self, key, float(value))
        for key in ("learning_rate", "dirichlet_alpha"):
            if getattr(self, key) <= 0:
                raise fail(key, getattr(self, key), "a finite number > 0")
        if self.data_partition not in DATA_PARTITIONS:
            raise fail("data_partition", self.data_partition,
                       f"one of {', '.join(DATA_PARTITIONS)}")
        if self.partition in DATA_PARTITIONS:
            raise fail("partition", self.partition, '"auto" or a list of cut points (the '
                       "data partition is now data_partition)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise fail("seed", self.seed, "an integer")
        for key in ("heartbeat_interval", "device_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0
            ):
                raise fail(key, value, "a finite number of seconds > 0")
            set_(self, key, float(value))
        if self.device_timeout <= self.heartbeat_interval:
            raise fail("device_timeout", self.device_timeout,
                       f"more than heartbeat_interval ({self.heartbeat_interval:g} s)")
        grace = self.reconnect_grace
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not (
            math.isfinite(grace) and grace > 0
        ):
            raise fail("reconnect_grace", grace, "a finite number of seconds > 0")
        set_(self, "reconnect_grace", float(grace))
        for key in ("shape_links", "replan", "profile_devices"):
            if not isinstance(getattr(self, key), bool):
                raise fail(key, getattr(self, key), "true or false")
        threshold = self.replan_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not (
            math.isfinite(threshold) and 0 <= threshold < 1
        ):
            raise fail("replan_threshold", threshold, "a number in [0, 1)")
        set_(self, "replan_threshold", float(threshold))
        budget = self.device_memory_mb
        budgets = budget if isinstance(budget, Sequence) else (budget,)
        if isinstance(budget, Sequence) and len(budgets) != self.devices:
            raise fail("device_memory_mb", list(budgets),
                       f"one number or {self.devices} numbers")
        for v in budgets:
            if isinstance(v, bool) or not isinstance(v, int | float) or not (
                math.isfinite(v) and v >= 0
            ):
                raise fail("device_memory_mb", v, "a finite number of MB >= 0 (0 = unlimited)")
        set_(self, "device_memory_mb", tuple(float(v) for v in budgets)
             if isinstance(budget, Sequence) else float(budget))
        if not isinstance(self.out_dir, str):
            raise fail("out_dir", self.out_dir, "a path string")
        f = self.byzantine_devices
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise fail("byzantine_devices", f, "an integer >= 0")
        set_(self, "scale_limit", above("scale_limit", self.scale_limit, 1))
        check_system(self)

    def option(self, key: str) -> Any:
        """The value of ``key``, an option the run's system declares of its own (given
        in `options`, else its default)."""
        return self.options.get(key, options_of(self.mode).defaults[key])

    def round_size(self, alive: int) -> int:
        """Devices that train in a round when ``alive`` can (`devices_per_round`)."""
        value = self.devices_per_round
        wanted = (self.devices if not value else value if isinstance(value, int)
                  else math.ceil(value * self.devices))
        return min(wanted, alive)

    def _check_model(self) -> None:
        """``model`` and ``initial_weights`` ([Note: initial weights] in
        aiopipe/runtime/factories.py)."""
        model, weights = self.model, self.initial_weights
        kinds = "a model name, module:function, a callable factory or a torch.nn.Sequential"
        if weights not in INITIAL_WEIGHTS:
            raise fail("initial_weights", weights, " or ".join(
                f'"{w}"' for w in INITIAL_WEIGHTS))
        own = False  # a module with weights of its own
        if isinstance(model, str):
            if not model or (":" in model and not is_entry_point(model)):
                raise fail("model", model, kinds)
        else:
            from torch import nn  # local: config stays importable without building models

            own = isinstance(model, nn.Sequential)
            if not own and (isinstance(model, nn.Module) or not callable(model)):
                raise fail("model", model, kinds)
        if weights == "given" and not own:
            raise fail("initial_weights", weights, '"seed" for a model built by name or '
                       'factory (its weights are drawn under seed; "given" keeps a '
                       "torch.nn.Sequential's own weights)")
        if own and weights == "seed":
            from aiopipe.models.initialisers import parameters_not_reset  # torch-bound

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

    # -- per-device views ------------------------------------------------------------

    def device_split_point(self, device_id: int) -> int | str:
        """P for one device ("auto" until a planner resolves it)."""
        return pick(self.split_point, device_id)

    def device_parallel_batches(self, device_id: int) -> int | str:
        """N for one device ("auto" until a planner resolves it)."""
        return pick(self.parallel_batches, device_id)

    def device_samples_of(self, device_id: int) -> int:
        """Training samples device ``device_id`` holds in an emulated fleet."""
        return int(pick(self.samples_per_device, device_id))

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
            raise ConfigError(unknown_keys(unknown, known))
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in values.items()}
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> RunConfig:
        """Load a TOML file (top-level keys, or a ``[run]`` table; the run's system's
        options in its table, ``[hadfl]``: `fold_system_tables`), then apply overrides.

        Raises:
            ConfigError: the file is missing, is not valid TOML, or holds invalid values.
        """
        data = read_run_keys(path)
        mode = overrides.get("mode") or data.get("mode") or _DEFAULT_MODE
        values = fold_system_tables(data, str(mode), where=f"config file {str(path)!r}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_mapping(values)

    def to_toml(self) -> str:
        """The config as a TOML document of top-level keys, every key's value (what
        ``config.toml`` in a results dir holds: `from_mapping` reads it back whole)."""
        return toml_document(self.to_mapping())
