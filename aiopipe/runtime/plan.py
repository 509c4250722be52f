"""What each device runs: the resolved (P, N, B') per device, and the shared set-up.

Both sides build the same model from the same `RunConfig` (`aiopipe.runtime.factories`):
the server the whole model (initialized from the seed), a device the model's structure
(its weights arrive in `RoundStart`). The training data is the devices' own: the server
plans from what each announces (`Ready`) and opens no training data. An emulated fleet
(the launcher, `aiopipe.simulate`) shares one dataset out instead: `device_data` is
device k's shard of it, as ``data_partition`` splits it.

[Note: iterations per epoch] A device with S samples, batch size B and N micro-batches
uses B' = floor(B/N) samples per micro-batch and runs floor(S / (B' N)) iterations per
epoch (PiPar Algorithm 1, line 3); the remainder of its shuffled data is left out that
epoch. FL and SL/SFL use N = 1, B' = B.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from aiopipe import data as datasets
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, TrainingError
from aiopipe.models.crossing import (
    Crossing,
    Value,
    as_crossing,
    crossing_bytes,
    example,
    gradient_leaves,
    joined,
    leaves,
)
from aiopipe.protocol import leaves_to_wire
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.cost_cache import cached_costs, cost_key
from aiopipe.runtime.factories import build_model, unit_crossings
from aiopipe.runtime.memory import saved_bytes
from aiopipe.runtime.overheads import measure_runtime_overheads
from aiopipe.scheduler.costs import CostTable, measure_costs
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile
from aiopipe.wording import plural

__all__ = [
    "DevicePlan",
    "build_model",
    "cached_planning_costs",
    "check_trainable",
    "declared_devices",
    "device_data",
    "device_indices",
    "measure_planning_costs",
    "model_profile",
    "planning_cost_key",
    "train_dataset",
    "unit_crossings",
]


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The plan for one device: split point P, micro-batches N, micro-batch size B'."""

    device_id: int
    split_point: int
    parallel_batches: int
    micro_batch_size: int
    iterations_per_epoch: int

    @property
    def samples_per_iteration(self) -> int:
        """B' x N."""
        return self.micro_batch_size * self.parallel_batches


def train_dataset(config: RunConfig) -> datasets.Dataset:
    """The training set an emulated fleet's shards are cut from (lazily generated or
    memory-mapped).

    Raises:
        ConfigError: unknown dataset or unreadable files.
    """
    per_device = config.samples_per_device
    size = sum(per_device) if isinstance(per_device, tuple) else per_device * config.devices
    return _train_set(config.dataset, config.seed, size)


@functools.lru_cache(maxsize=8)
def _train_set(dataset: str, seed: int, size: int) -> datasets.Dataset:
    """Opened once per process: every device of an in-process simulation cuts its shard
    from it (a name's, or a ``module:function``'s)."""
    return datasets.open_device_data(dataset, split="train", seed=seed, size=size)


def device_data(config: RunConfig, device_id: int) -> datasets.Dataset:
    """Device ``device_id``'s shard of an emulated fleet's training set.

    Raises:
        ConfigError: unknown dataset or unreadable files.
    """
    train = train_dataset(config)
    return datasets.Shard(train, device_indices(config, train, device_id))


def device_indices(config: RunConfig, dataset: datasets.Dataset, device_id: int) -> np.ndarray:
    """Indices into ``dataset`` of the samples device ``device_id`` holds."""
    key = (dataset.name, len(dataset), config.devices, config.data_partition,
           config.dirichlet_alpha, config.samples_per_device, config.seed)
    shards = _SHARDS.get(key)
    if shards is None:
        # cached: every node of an in-process simulation asks for the same partition, and
        # computing it once per device would cost O(K^2) for K devices
        parts = datasets.partition(dataset.labels(), config.devices,
                                   scheme=config.data_partition,
                                   alpha=config.dirichlet_alpha,
                                   samples_per_device=config.samples_per_device,
                                   seed=config.seed)
        for part in parts:
            part.flags.writeable = False
        if len(_SHARDS) >= 8:
            _SHARDS.clear()
        shards = _SHARDS[key] = tuple(parts)
    return shards[device_id]


_SHARDS: dict[tuple[object, ...], tuple[np.ndarray, ...]] = {}


def check_trainable(model: nn.Sequential, inputs: Crossing | Sequence[int],
                    plans: list[DevicePlan], config: RunConfig) -> None:
    """Refuse plans whose micro-batches ``model`` cannot train on.

    One training pass (forward and backward, in training mode) of a copy of ``model`` on
    the smallest micro-batch any plan uses: batch norm needs more than one value per
    channel, so a model whose maps shrink to 1x1 cannot train on one sample, and a run
    would fail in its first pass. A model that trains on the smallest micro-batch trains
    on larger ones. The model, its batch-norm statistics and torch's random state are
    left as they were. ``inputs``: the model's (`aiopipe.models.crossing.as_crossing`).
    ``config`` gives the model's name and the batch size for the error.

    Raises:
        ConfigError: the pass fails; the message says at which size and what to change.
    """
    smallest = min(plans, key=lambda p: p.micro_batch_size)
    size = smallest.micro_batch_size
    with torch.random.fork_rng(devices=[]):
        probe = copy.deepcopy(model).train()
        try:
            out = leaves(probe(example(as_crossing(inputs), size)))
            sum(o.sum() for o in out if o.is_floating_point()).backward()  # type: ignore[union-attr]
        except (RuntimeError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            name = config.model if isinstance(config.model, str) else "the custom model"
            raise ConfigError(
                f"{name} cannot train on {plural(size, 'sample')} per "
                f"micro-batch (device {smallest.device_id}: batch_size {config.batch_size} / "
                f"parallel_batches {smallest.parallel_batches}): {reason}; use fewer "
                "parallel_batches or a larger batch_size") from None


def measure_planning_costs(config: RunConfig, model: nn.Sequential,
                           inputs: Crossing | Sequence[int],
                           dataset: datasets.Dataset | None, *,
                           sizes: Sequence[int], repeats: int = 5,
                           warmup: int = 2) -> CostTable:
    """A cost table at ``sizes`` (for a run: every batch size it or its planner may use,
    `aiopipe.runtime.systems.planning_batch_sizes`), measured here.

    Measured as the nodes run: with ``config.torch_threads`` torch threads, the run's
    learning rate and momentum, and the fixed cost of loading a micro-batch of
    ``dataset`` (data of the run's kind: the server's evaluation set, or a device's own;
    None: no loading cost) charged to each device forward, and the server's aggregation
    of a
    round (FedAvg over the devices' whole models, then loading the result into the
    global model and, approximately, each device's replica), and the runtime's own
    hand-over per work item and messages per micro-batch
    (`measure_runtime_overheads`, with activations of the first unit's output shape).
    The model is left as it was.
    """
    whole = {key: v.detach().clone() for key, v in model.state_dict().items()}

    def load_batch(size: int) -> Value:
        assert dataset is not None
        return dataset.batch(np.arange(size) % len(dataset))[0]

    def aggregate(devices: int) -> None:
        state = fedavg([whole] * devices, [1.0] * devices)
        for _ in range(devices + 1):
            model.load_state_dict(state)

    crossing = as_crossing(inputs)
    # messages as large as the first cut's (its leaves' bytes as one float32 tensor)
    first_cut = crossing_bytes(unit_crossings(model, crossing)[0])
    overheads = measure_runtime_overheads((1, max(1, first_cut // 4)))
    return measure_costs(model, crossing, sizes, repeats=repeats, warmup=warmup,
                         learning_rate=config.learning_rate, momentum=config.momentum,
                         threads=config.torch_threads,
                         load_batch=None if dataset is None else load_batch,
                         aggregate=aggregate, handover=overheads.handover,
                         message=overheads.message)


def planning_cost_key(config: RunConfig, model: nn.Sequential,
                      inputs: Crossing | Sequence[int], dataset: datasets.Dataset | None, *,
                      role: str) -> str:
    """The [Note: cost cache] key of `measure_planning_costs`'s tables for these arguments
    on this machine (any batch sizes); ``role`` ("server", "device") says whose data is
    loaded (the server's evaluation set, a device's own), so the two never share a file."""
    data = ("none" if dataset is None else
            f"{config.dataset}|{role}|{type(dataset).__module__}.{type(dataset).__qualname__}")
    return cost_key(model, inputs, data,
                    {"threads": config.torch_threads, "learning_rate": config.learning_rate,
                     "momentum": config.momentum})


def cached_planning_costs(config: RunConfig, model: nn.Sequential,
                          inputs: Crossing | Sequence[int],
                          dataset: datasets.Dataset | None, *, sizes: Sequence[int],
                          role: str = "server", what: str = "the server's cost table"
                          ) -> CostTable:
    """`measure_planning_costs`'s table at (at least) ``sizes``, read from the cost
    cache when this machine measured one for the same key (`planning_cost_key`) at those
    sizes before, else measured and kept
    there ([Note: cost cache]; [Note: device profiles] in aiopipe.runtime.profiling):
    a second run of a model starts training without profiling it again. One log line
    says which (``what``, the file, or the seconds measuring took)."""
    key = planning_cost_key(config, model, inputs, dataset, role=role)

    def measure(wanted: Sequence[int]) -> CostTable:
        return measure_planning_costs(config, model, inputs, dataset, sizes=wanted)

    return cached_costs(key, measure, sizes, what=what)


#: A run id as large as `Plan.run_id`'s (62 bits, the top one set), for frame sizes.
_TYPICAL_RUN_ID = 2**62 - 1


def model_profile(model: nn.Sequential, inputs: Crossing | Sequence[int],
                  costs: CostTable, *, server_lanes: int = 1) -> ModelProfile:
    """What the planner knows about ``model``: ``costs`` plus the activation, frame and
    state sizes of every split unit (frame overheads are the codec's own figures), and
    the server's ``server_lanes``."""
    from aiopipe.protocol import Activation, Gradient, encode, to_tensor_data

    crossing = as_crossing(inputs)
    crossings = unit_crossings(model, crossing)
    activation_bytes = tuple(crossing_bytes(c) for c in crossings)
    sample = leaves_to_wire(leaves(example(crossings[0], 1)))
    labels = torch.zeros(1, dtype=torch.int64)
    ids = (_TYPICAL_RUN_ID, 0, 0, 0, 0, 0, "device0", "server")  # as a run's frames carry
    act_overhead = len(encode(Activation(*ids, sample, to_tensor_data(labels)))
                       ) - activation_bytes[0] - 8
    gradient = leaves_to_wire(leaves(example(gradient_leaves(crossings[0]) or crossings[0], 1)))
    grad_overhead = len(encode(Gradient(*ids, gradient))) - activation_bytes[0]
    state_bytes = tuple(sum(t.numel() * t.element_size() for t in unit.state_dict().values())
                        for unit in model.children())
    frozen_bytes = tuple(sum(p.numel() * p.element_size() for p in unit.parameters()
                             if not p.requires_grad) for unit in model.children())
    return ModelProfile(costs, activation_bytes, state_bytes,
                        frame_overhead=grad_overhead, activation_frame_overhead=act_overhead,
                        saved_bytes=saved_bytes_per_sample(model, crossing),
                        server_lanes=server_lanes,
                        frozen_bytes=frozen_bytes if any(frozen_bytes) else None,
                        min_rows=2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                          for m in model.modules()) else 1)


def saved_bytes_per_sample(model: nn.Sequential, inputs: Crossing | Sequence[int], *,
                           samples: int = 4) -> tuple[int, ...]:
    """Per unit, the bytes per sample autograd keeps from its forward for the backward,
    its input included (`aiopipe.runtime.memory.saved_bytes`), measured on ``samples``
    zeros in training mode on a copy (the model's batch-norm statistics stay as
    they are)."""
    twin = copy.deepcopy(model).train()
    x: object = example(as_crossing(inputs), samples)
    out: list[int] = []
    for u, unit in enumerate(twin.children()):
        taken = [t.detach().requires_grad_(u > 0 and t.is_floating_point()) for t in leaves(x)]
        y, held = saved_bytes(partial(unit, joined(taken)), list(unit.parameters()), taken)
        out.append(math.ceil(held / samples))
        x = y
    return tuple(out)


def declared_devices(config: RunConfig, samples: list[int], *,
                     costs: CostTable | None = None) -> list[DeviceProfile]:
    """Device profiles from the config: ``device_slowdown`` and each device's
    ``network``; ``costs``: their table (times their slowdown) when it is not the
    server's."""
    return [DeviceProfile(config.device_slowdown_of(k), config.device_network(k).up,
                          config.device_network(k).down, samples[k], costs)
            for k in range(config.devices)]


def device_run_config(run: Mapping[str, Any], custom_model: nn.Sequential | None
                      ) -> RunConfig:
    """The run a device's plan describes (``run``: the plan's config tree), with the
    device's own model when the server runs a custom one (``custom_model``).

    Raises:
        ConfigError: ``run`` is not a valid run.
        TrainingError: the server runs a custom model and the device has none.
    """
    values = dict(run)
    if values.get("model") != "custom":
        return shared_run_config(values)
    if custom_model is None:
        raise TrainingError("the server runs a custom model; pass model= to the device")
    return RunConfig.from_mapping({**values, "model": "vgg5", "initial_weights": "seed"}
                                  ).replace(model=custom_model,
                                            initial_weights=values.get("initial_weights",
                                                                       "seed"))


#: the runs parsed in this process, by their tree's text (`shared_run_config`)
_RUN_CONFIGS: dict[str, RunConfig] = {}


def shared_run_config(run: Mapping[str, Any]) -> RunConfig:
    """``RunConfig.from_mapping(run)``, one object for every equal tree in this process:
    the devices of an in-process simulation each parse the same run from their plans,
    1.7 KB each (170 MB for a population of 100,000). A `RunConfig` is frozen, so
    sharing it changes nothing a device sees.

    Raises:
        ConfigError: ``run`` is not a valid run (as `RunConfig.from_mapping`).
    """
    key = json.dumps(run, sort_keys=True, default=repr)
    config = _RUN_CONFIGS.get(key)
    if config is None:
        config = RunConfig.from_mapping(run)
        if len(_RUN_CONFIGS) >= 8:  # a process that runs many runs keeps the last few
            _RUN_CONFIGS.clear()
        _RUN_CONFIGS[key] = config
    return config
