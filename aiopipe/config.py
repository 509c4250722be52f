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
import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aiopipe.config_keys import unknown_keys
from aiopipe.config_options import (
    FLAT_KEYS_UNTIL,
    fold_system_tables,
    option_values,
    plain,
    system_keys,
    warn_flat_keys,
)
from aiopipe.config_toml import read_run_keys, toml_document
from aiopipe.config_values import (
    AGGREGATIONS,
    DATA_PARTITIONS,
    INITIAL_WEIGHTS,
    LOSSES,
    METRICS,
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
from aiopipe.runtime.systems.registry import (
    BUILT_IN,
    check_system,
    option_owners,
    options_of,
)

if TYPE_CHECKING:
    from aiopipe.transport.network import NetworkSpec

__all__ = [
    "AGGREGATIONS",
    "DATA_PARTITIONS",
    "INITIAL_WEIGHTS",
    "LOSSES",
    "METRICS",
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
_Options = TypeVar("_Options")


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
            plans and keeps a backup, off the data path) or "fedbuff" (FedBuff: every
            device trains at its own pace and uploads its delta; the coordinator
            applies the buffered deltas, weighted by staleness, every few arrivals) or
            "auto" (the fastest of fl, sfl and pipar for the fleet, predicted when the
            devices have joined), or "module:attribute", a system of one's own.
        model: a model name of `aiopipe.models.MODEL_NAMES`, ``module:function`` (a
            factory, called with ``num_classes`` and ``in_shape`` if it takes them, that
            returns the model; every node imports it), or, in-process only (it cannot
            go in TOML), such a factory itself (a callable) or the user's own
            ``torch.nn.Module``. A model is an ``nn.Sequential`` of split units, or any
            other one-input module, traced and cut between its children
            (`aiopipe.models.split_units`). A name's or a factory's weights are drawn
            under ``seed``.
        initial_weights: what a user's ``torch.nn.Module`` starts from: "seed" (the
            default) re-initialises a copy of it from ``seed`` (every module's
            ``reset_parameters()``), so that a run's initial weights are a function of
            the config alone: two configs built by one function train alike, whatever
            the global torch generator did in between; a module with parameters that no
            ``reset_parameters()`` covers is refused. "given": its own weights as they
            are (pretrained ones). Models by name or factory take only "seed"
            (docs/design.md §Initial weights).
        loss: "cross-entropy" (over the output's last dimension: a class per sample,
            or per token), "mse" (a float target), or ``module:function``: a factory
            returning ``loss(output, target)``, the mean loss of a micro-batch, given
            the model's output and the data's target as they are.
        metric: what is reported beside the loss, as the runs' accuracy: "accuracy"
            (a classifier's, per sample or per token), "none" (the loss alone), or
            ``module:function``: a factory returning ``metric(output, target)``, the
            micro-batch's per-sample scores in [0, 1], summed.
        optimizer: "sgd" (with ``learning_rate`` and ``momentum``), or
            ``module:function``: a factory called with ``params`` and, if it takes
            them, ``learning_rate`` and ``momentum``, returning a torch optimizer.
        train_hook: "" (none; a strategy may bring its own: FedProx's proximal term), or
            ``module:function``: a factory, called with no arguments on every node that
            trains a stage, returning a hook that may change the last stage's loss and
            every stage's gradients before the step, with the round's global weights at
            hand (`aiopipe.runtime.stage.TrainHook`, [Note: train hooks]). fl, sl, sfl
            and pipar (a device's stage and the coordinator's replica of its server
            half): the systems whose options say they run one
            (`SystemOptions.runs_train_hook`).
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
        device_memory_mb: memory budget per device for the planner (one value or one
            per device; 0 = unlimited): the device half's weights, gradients, momentum
            and the activations of N in-flight micro-batches must fit.
        byzantine_devices: the faulty devices a run tolerates: how many devices' word
            against a peer excludes it (aiopipe.runtime.exclusion), and Krum's f.
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
        devices_per_round: how many devices train in each round,
            sampled anew every round (Flower's fraction_fit in spirit): 0, every device;
            an integer n >= 1, n of them; a fraction in (0, 1), that share of the
            devices rounded up. The choice is seeded by ``seed``, the epoch and the round
            (`sampled_devices`), among the devices alive then, and recorded in each
            epoch's ``sampled``; FedAvg weighs the sampled devices' samples. Only systems that
            sample devices take it (`SystemOptions.samples_devices`: fl, sl, sfl, pipar).
        profile_devices: with "auto" (and in mode asteroid, any plan: its rows are
            balanced by speed) on real clocks, plan from what each device measures of
            itself where it runs (its units' times, its links' rates:
            aiopipe.runtime.profiling); false: from the server's own table times each
            device's ``device_slowdown`` and the ``network`` as declared.
        options: the options of the run's system: an instance of its options dataclass
            (`SystemOptions.values`: `StarOptions` for fl and sl, `ReplicaOptions` for
            sfl and pipar, `PipelineOptions`, `FTPipeHDOptions`, `AsteroidOptions`,
            `HADFLOptions`, or a user's system's own), given as one or as a mapping of
            the keys to change (a config file's table named after the mode, ``[hadfl]``);
            the defaults fill the rest. `RunConfig` keeps what every run has; what only
            one system takes is its own (aiopipe.runtime.systems.registry).

    Flat system keys (``RunConfig(mode="hadfl", ring_size=3)``, ``config.ring_size``,
    ``ring_size = 3`` at a config file's top level) are the old form: read for one more
    release, each with a `FutureWarning` that says where the key goes now.

    Raises:
        ConfigError: a field has an invalid value (the message names the key).
    """

    mode: str = _DEFAULT_MODE
    model: Any = "vgg5"
    initial_weights: str = "seed"
    loss: str = "cross-entropy"
    metric: str = "accuracy"
    optimizer: str = "sgd"
    train_hook: str = ""
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
    device_memory_mb: float | tuple[float, ...] = 0.0
    profile_devices: bool = True
    byzantine_devices: int = 1
    scale_limit: float = 1000.0
    devices_per_round: int | float = 0
    options: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            raise fail("mode", self.mode, f"one of {', '.join(MODES)} or module:attribute")
        self._check_model()
        if not isinstance(self.dataset, str) or not self.dataset:
            raise fail("dataset", self.dataset, "a dataset name")
        for key, builtin in (("loss", LOSSES), ("metric", METRICS), ("optimizer", OPTIMIZERS)):
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
        for key in ("shape_links", "profile_devices"):
            if not isinstance(getattr(self, key), bool):
                raise fail(key, getattr(self, key), "true or false")
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
        self._check_devices_per_round()
        check_system(self)

    def options_as(self, kind: type[_Options]) -> _Options:
        """The run's system's options, typed as ``kind`` (its options dataclass, or a
        base of it).

        Raises:
            TypeError: the run's options are not a ``kind``.
        """
        if not isinstance(self.options, kind):
            raise TypeError(f"mode {self.mode}'s options are a "
                            f"{type(self.options).__name__}, not a {kind.__name__}")
        return self.options

    def _check_devices_per_round(self) -> None:
        """Sampling per round: 0, a count up to ``devices``, or a fraction in (0, 1)."""
        value = self.devices_per_round
        expected = f"0 (every device), an integer 1..{self.devices} or a fraction in (0, 1)"
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                isinstance(value, int) and not 0 <= value <= self.devices) or (
                isinstance(value, float) and not 0 < value < 1):
            raise fail("devices_per_round", value, expected)

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
        kinds = "a model name, module:function, a callable factory or a torch.nn.Module"
        if weights not in INITIAL_WEIGHTS:
            raise fail("initial_weights", weights, " or ".join(
                f'"{w}"' for w in INITIAL_WEIGHTS))
        own = False  # a module with weights of its own
        if isinstance(model, str):
            if not model or (":" in model and not is_entry_point(model)):
                raise fail("model", model, kinds)
        else:
            from torch import nn  # local: config stays importable without building models

            own = isinstance(model, nn.Module)
            if not own and not callable(model):
                raise fail("model", model, kinds)
        if weights == "given" and not own:
            raise fail("initial_weights", weights, '"seed" for a model built by name or '
                       'factory (its weights are drawn under seed; "given" keeps a '
                       "torch.nn.Module's own weights)")
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
        """A copy with some fields changed (validated again). ``options`` given as a
        mapping changes only the options it names (the system's options dataclass
        replaces them all); a new ``mode`` keeps the options its system also takes."""
        options = changes.pop("options", None)
        flat = system_keys(changes)
        if flat:
            warn_flat_keys(flat, "replace()")
        takes = options_of(changes.get("mode", self.mode)).keys
        kept = ({} if options is not None and not isinstance(options, Mapping)  # a whole one
                else {k: v for k, v in option_values(self.options).items() if k in takes})
        return dataclasses.replace(self, options={**kept, **flat, **option_values(options)},
                                   **changes)

    def to_mapping(self) -> dict[str, Any]:
        """Plain TOML-able values of every field (a custom model becomes "custom"); the
        options in a table named after the system (``"hadfl": {...}``), as a config file
        holds them."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "model" and not isinstance(value, str):
                value = "custom"
            if f.name == "options":
                out[options_of(self.mode).table] = plain(option_values(value))
                continue
            out[f.name] = plain(value)
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, warn: bool = True) -> RunConfig:
        """Build from plain values (`to_mapping`'s form; the run's options in its
        system's table, or as ``options``), refusing unknown keys. A system's key at top
        level is the old form (class docstring): read, with a `FutureWarning` unless
        ``warn`` is false (an old checkpoint's config, which the user did not write).

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        mode = str(values.get("mode") or _DEFAULT_MODE)
        nested, flat = fold_system_tables(values, mode, where="config")
        if flat and warn:
            warn_flat_keys(flat, "a config's top level", table=options_of(mode).table)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in nested if k not in known]  # in the order given
        if unknown:
            raise ConfigError(unknown_keys(unknown, known | set(option_owners())))
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in nested.items()}
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> RunConfig:
        """Load a TOML file (top-level keys, or a ``[run]`` table; the run's system's
        options in its table, ``[hadfl]``), then apply ``overrides`` (None: not given).

        Raises:
            ConfigError: the file is missing, is not valid TOML, or holds invalid values.
        """
        where = f"config file {str(path)!r}"
        data = read_run_keys(path)
        mode = str(overrides.get("mode") or data.get("mode") or _DEFAULT_MODE)
        values, flat = fold_system_tables(data, mode, where=where)
        if flat:
            warn_flat_keys(flat, f"{where}'s top level", table=options_of(mode).table)
        given = {k: v for k, v in overrides.items() if v is not None}
        changes = system_keys(given)
        if changes:
            warn_flat_keys(changes, "from_toml()")
        values.update(given)
        values["options"] = {**values.get("options", {}), **changes}
        return cls.from_mapping(values)

    def to_toml(self) -> str:
        """The config as a TOML document: every common key's value at top level, then
        the options in the system's table (what ``config.toml`` in a results dir holds:
        `from_toml` reads it back whole)."""
        mapping = self.to_mapping()
        table = options_of(self.mode).table
        options = mapping.pop(table)
        return toml_document(mapping) + f"\n[{table}]\n" + toml_document(options)


def _init_with_flat_keys(init: Callable[..., None]) -> Callable[..., None]:
    """`RunConfig`'s constructor, reading the old flat system keys (class docstring)
    into ``options`` with a `FutureWarning`."""

    @functools.wraps(init)
    def __init__(self: RunConfig, *args: Any, **kwargs: Any) -> None:
        flat = system_keys(kwargs)
        if flat:
            warn_flat_keys(flat, "RunConfig()")
            given = kwargs.get("options")
            given = option_values(given) if given is not None else {}
            both = sorted(set(flat) & set(given))
            if both:
                raise ConfigError(f"config key {both[0]!r} is given twice: keep the one in "
                                  "options")
            kwargs["options"] = {**given, **flat}
        init(self, *args, **kwargs)

    return __init__


def _read_flat_key(self: RunConfig, name: str) -> Any:
    """``config.ring_size``, the old flat read of a system's option (class docstring)."""
    if name in option_owners():
        warnings.warn(f"config.{name} reads a system option the old flat way (read until "
                      f"aiopipe {FLAT_KEYS_UNTIL}): read config.options.{name}",
                      FutureWarning, stacklevel=2)
        options = object.__getattribute__(self, "options")
        if hasattr(options, name):
            return getattr(options, name)
        return options_of(option_owners()[name][0]).defaults()[name]  # another system's
    raise AttributeError(f"'RunConfig' object has no attribute {name!r}")


# (set after the class is made, so that type checkers see neither: they are the old form)
setattr(RunConfig, "__init__", _init_with_flat_keys(RunConfig.__init__))  # noqa: B010
setattr(RunConfig, "__getattr__", _read_flat_key)  # noqa: B010
