"""``GET /metrics``: the coordinator's state in the Prometheus text format.

Each coordinator has a `CollectorRegistry` of its own (`registry_for`; never the
process-wide default registry: several servers may live in one process), holding a
`CoordinatorCollector` that reads the coordinator's state at scrape time, so a scrape
costs nothing while nobody scrapes. Series (counters get ``_total`` in the text):

- the run: ``aiopipe_run_info{mode}``, ``aiopipe_devices``, ``aiopipe_devices_joined``,
  ``aiopipe_devices_connected``, ``aiopipe_epoch``, ``aiopipe_epochs_finished``,
  ``aiopipe_rounds_started_total``, ``aiopipe_replans_total``,
  ``aiopipe_busy_fraction{resource}`` (the epoch so far, as ``/status`` says);
- the last finished epoch: ``aiopipe_epoch_seconds``, ``aiopipe_test_accuracy``,
  ``aiopipe_train_loss``, ``aiopipe_train_accuracy``, ``aiopipe_held_out_accuracy``,
  ``aiopipe_epoch_samples``, ``aiopipe_epoch_bytes_up``, ``aiopipe_epoch_bytes_down``,
  ``aiopipe_epoch_devices_lost``, ``aiopipe_epoch_updates_refused``,
  ``aiopipe_busy_seconds{resource}``, ``aiopipe_idle_seconds{resource}``,
  ``aiopipe_privacy_epsilon`` and ``aiopipe_privacy_delta`` (differential privacy's, by
  the end of that epoch, with DP-SGD or dp-fedavg), ``aiopipe_device_privacy_epsilon``
  (``device="k"``);
- per device (``device="k"``): ``aiopipe_device_connected``,
  ``aiopipe_device_bytes_up_total``, ``aiopipe_device_bytes_down_total``,
  ``aiopipe_device_samples_total``, ``aiopipe_device_epoch_samples``,
  ``aiopipe_device_rounds_total``, ``aiopipe_device_train_loss``,
  ``aiopipe_device_lost_epochs_total``, ``aiopipe_device_refused_epochs_total``,
  ``aiopipe_device_held_out_accuracy``, ``aiopipe_device_split_point``,
  ``aiopipe_device_parallel_batches``.

A value that is not known (no finished epoch yet, no held-out data, a pipeline stage that
computes no loss) is left out rather than written as NaN; ``aiopipe_test_accuracy`` keeps
its NaN (no test set), as it always did.

This module imports ``prometheus_client``; `aiopipe.runtime.http` imports it only when
``/metrics`` is first asked for, so that ``import aiopipe`` stays fast.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from aiopipe.runtime.coordinator import Coordinator

__all__ = ["CONTENT_TYPE_LATEST", "CoordinatorCollector", "exposition", "registry_for"]

_registries: weakref.WeakKeyDictionary[Coordinator, CollectorRegistry] = (
    weakref.WeakKeyDictionary())


def registry_for(node: Coordinator) -> CollectorRegistry:
    """``node``'s own registry (made on first use), holding its `CoordinatorCollector`;
    ``/metrics`` serves whatever else is registered there too."""
    registry = _registries.get(node)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(CoordinatorCollector(node))
        _registries[node] = registry
    return registry


def exposition(node: Coordinator) -> tuple[bytes, str]:
    """The body and content type that answer ``GET /metrics`` for ``node``."""
    return generate_latest(registry_for(node)), CONTENT_TYPE_LATEST


class CoordinatorCollector(Collector):
    """Reads a coordinator's state when scraped (see the module docstring for what).

    It holds the coordinator weakly: once the coordinator is gone it yields nothing.
    """

    def __init__(self, node: Coordinator) -> None:
        self._node = weakref.ref(node)

    def collect(self) -> Iterable[Metric]:
        """The metric families of the coordinator's state now (those with a value)."""
        node = self._node()
        if node is None:
            return []
        families = [*_run(node), *_last_epoch(node), *_devices(node)]
        return [family for family in families if family.samples]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _by(family: GaugeMetricFamily | CounterMetricFamily,
        values: Mapping[str, float]) -> GaugeMetricFamily | CounterMetricFamily:
    """``family`` with one sample per label value (its one label)."""
    for label, value in values.items():
        family.add_metric([label], value)
    return family


def _run(node: Coordinator) -> Iterator[Metric]:
    """The run as a whole (what ``/status`` says, as numbers)."""
    status = node.describe()
    info = GaugeMetricFamily("aiopipe_run_info", "The run's mode (the value is always 1).",
                             labels=["mode"])
    info.add_metric([str(status["mode"])], 1)
    yield info
    yield _gauge("aiopipe_devices", "Devices the run is configured for.", status["devices"])
    yield _gauge("aiopipe_devices_joined", "Devices that have joined the run.",
                 len(status["joined"]))
    yield _gauge("aiopipe_devices_connected", "Devices with an open session.",
                 len(status["connected"]))
    yield _gauge("aiopipe_epoch", "The epoch under way or last run (the first is 1; 0 "
                 "before it).", status["epoch"])
    # a gauge, as it was before prometheus-client: a counter would be renamed *_total
    yield _gauge("aiopipe_epochs_finished", "Epochs finished so far.", len(node.epochs))
    yield _counter("aiopipe_rounds_started", "Rounds started so far (a resumed run counts "
                   "its rounds before the restart).", status["round"])
    yield _counter("aiopipe_replans", "Re-plans (new split points or micro-batch counts "
                   "adopted between rounds) in this server process.", len(node.replans))
    yield _by(GaugeMetricFamily("aiopipe_busy_fraction", "Busy fraction per resource kind "
                                "in the epoch so far (device kinds: means over devices).",
                                labels=["resource"]),
              {str(k): float(v) for k, v in status["busy_fraction"].items()})


def _last_epoch(node: Coordinator) -> Iterator[Metric]:
    """Figures of the last finished epoch (nothing before one has finished)."""
    if not node.epochs:
        return
    last = node.epochs[-1]
    yield _gauge("aiopipe_epoch_seconds", "Duration of the last finished epoch.", last.time_s)
    yield _gauge("aiopipe_test_accuracy", "Test accuracy after the last finished epoch (NaN "
                 "without a test set).", last.accuracy)
    yield _gauge("aiopipe_train_loss", "Mean training loss per sample in the last finished "
                 "epoch.", last.loss)
    yield _gauge("aiopipe_train_accuracy", "Training accuracy in the last finished epoch.",
                 last.train_accuracy)
    if not math.isnan(last.held_out_accuracy):
        yield _gauge("aiopipe_held_out_accuracy", "Accuracy after the last finished epoch on "
                     "the devices' held-out data.", last.held_out_accuracy)
    yield _gauge("aiopipe_epoch_samples", "Samples trained in the last finished epoch.",
                 last.samples)
    yield _gauge("aiopipe_epoch_bytes_up", "Bytes the server received from devices in the "
                 "last finished epoch.", last.bytes_up)
    yield _gauge("aiopipe_epoch_bytes_down", "Bytes the server sent to devices in the last "
                 "finished epoch.", last.bytes_down)
    yield _gauge("aiopipe_epoch_devices_lost", "Devices lost during the last finished epoch.",
                 len(last.devices_lost))
    yield _gauge("aiopipe_epoch_updates_refused", "Devices whose update was refused, "
                 "clipped or dropped in the last finished epoch.", len(last.updates_refused))
    yield _by(GaugeMetricFamily("aiopipe_busy_seconds", "Busy seconds per resource kind in "
                                "the last finished epoch (device kinds: means over devices).",
                                labels=["resource"]), last.busy_s)
    yield _by(GaugeMetricFamily("aiopipe_idle_seconds", "Idle seconds per resource kind in "
                                "the last finished epoch (device kinds: means over devices).",
                                labels=["resource"]), last.idle_s)
    if not math.isnan(last.epsilon):
        yield _gauge("aiopipe_privacy_epsilon", "Differential privacy's epsilon for the run "
                     f"by the last finished epoch's end (per {last.privacy_unit}).",
                     last.epsilon)
        yield _gauge("aiopipe_privacy_delta", "The delta of aiopipe_privacy_epsilon.",
                     last.delta)
        yield _by(GaugeMetricFamily("aiopipe_device_privacy_epsilon", "Each device's "
                                    "differential privacy epsilon by the last finished "
                                    "epoch's end.", labels=["device"]), last.device_epsilon)


def _devices(node: Coordinator) -> Iterator[Metric]:
    """One sample per device (label ``device``) in each family; unknown values left out."""
    devices = [str(k) for k in range(node.config.devices)]
    epochs = node.epochs
    last = epochs[-1] if epochs else None

    # samples: finished epochs, plus the epoch under way (this process's rounds of it)
    samples = dict.fromkeys(devices, 0.0)
    for epoch in epochs:
        for k, n in enumerate(epoch.device_samples):
            samples[str(k)] = samples.get(str(k), 0.0) + n
    if node.epoch >= len(epochs):
        for k, (_, n) in node.device_loss.get(node.epoch, {}).items():
            samples[str(k)] = samples.get(str(k), 0.0) + n

    up: dict[str, float] = {}
    down: dict[str, float] = {}
    for device in devices:
        session = node.sessions.get(int(device))
        received, sent = session.link_bytes() if session is not None else (0, 0)
        up[device], down[device] = float(received), float(sent)

    connected = {str(k) for k in node.connected}
    yield _by(GaugeMetricFamily("aiopipe_device_connected", "Whether the device has an open "
                                "session (1) or not (0).", labels=["device"]),
              {k: float(k in connected) for k in devices})
    yield _by(CounterMetricFamily("aiopipe_device_bytes_up", "Bytes the server received from "
                                  "the device, over all its connections in this server "
                                  "process.", labels=["device"]), up)
    yield _by(CounterMetricFamily("aiopipe_device_bytes_down", "Bytes the server sent to the "
                                  "device, over all its connections in this server process.",
                                  labels=["device"]), down)
    yield _by(CounterMetricFamily("aiopipe_device_samples", "Samples the device trained in "
                                  "completed rounds (finished epochs, and the rounds of the "
                                  "epoch under way).", labels=["device"]), samples)
    yield _by(CounterMetricFamily("aiopipe_device_rounds", "Rounds the device completed in "
                                  "this server process.", labels=["device"]),
              {k: float(node.device_rounds.get(int(k), 0)) for k in devices})
    yield _by(GaugeMetricFamily("aiopipe_device_train_loss", "The device's mean training "
                                "loss per sample in the last finished epoch (over the "
                                "rounds this server process ran).", labels=["device"]),
              _device_loss(node))
    yield _by(CounterMetricFamily("aiopipe_device_lost_epochs", "Finished epochs during "
                                  "which the device was lost.", labels=["device"]),
              _epochs_naming(node, "devices_lost", devices))
    yield _by(CounterMetricFamily("aiopipe_device_refused_epochs", "Finished epochs in which "
                                  "the device's update was refused, clipped or dropped.",
                                  labels=["device"]),
              _epochs_naming(node, "updates_refused", devices))
    yield _by(GaugeMetricFamily("aiopipe_device_epoch_samples", "Samples the device "
                                "trained in the last finished epoch.", labels=["device"]),
              {str(k): float(n) for k, n in enumerate(last.device_samples)} if last else {})
    yield _by(GaugeMetricFamily("aiopipe_device_held_out_accuracy", "Accuracy after the last "
                                "finished epoch on the device's own held-out data.",
                                labels=["device"]),
              {str(k): float(v) for k, v in (last.device_accuracy if last else {}).items()
               if not math.isnan(v)})
    plan = _plan_by_device(node.system.plan_entries())
    for key, documentation in (("split_point", "The device's split point (model units it "
                                "runs) in the current plan."),
                               ("parallel_batches", "Micro-batches per iteration in the "
                                "device's current plan.")):
        yield _by(GaugeMetricFamily(f"aiopipe_device_{key}", documentation,
                                    labels=["device"]),
                  {k: float(entry[key]) for k, entry in plan.items() if key in entry})


def _device_loss(node: Coordinator) -> dict[str, float]:
    """Each device's mean training loss in the last finished epoch, where known: in a
    pipeline only the last stage's devices compute the loss (by the epoch's plan)."""
    if not node.epochs:
        return {}
    last = node.epochs[-1]
    losses = node.device_loss.get(last.epoch - 1, {})  # kept by the loop's 0-based index
    if last.plan and all("stage" in entry for entry in last.plan):  # a pipeline's
        stage = max(int(entry["stage"]) for entry in last.plan)
        computing = {int(entry["device"]) for entry in last.plan if entry["stage"] == stage}
        losses = {k: v for k, v in losses.items() if k in computing}
    return {str(k): loss_sum / n for k, (loss_sum, n) in sorted(losses.items()) if n > 0}


def _epochs_naming(node: Coordinator, field: str, devices: list[str]) -> dict[str, float]:
    """Per device: how many finished epochs list it in ``field`` (of `EpochMetrics`)."""
    counts = dict.fromkeys(devices, 0.0)
    for epoch in node.epochs:
        for k in getattr(epoch, field):
            counts[str(k)] = counts.get(str(k), 0.0) + 1
    return counts


def _plan_by_device(entries: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The plan's entries by their device (entries that name none are left out)."""
    return {str(entry["device"]): entry for entry in entries if "device" in entry}
