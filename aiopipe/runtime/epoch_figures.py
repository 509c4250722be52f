"""An epoch's running tally and the figures it becomes (`EpochMetrics`).

The coordinator's epoch loop adds each round's results to a tally: a plain dict, so that a
checkpoint can keep it and a resumed run finish the epoch exactly. At the epoch's end the
tally, the trace's busy seconds and the bytes the devices moved become the epoch's
`EpochMetrics`. These are functions of what they are given; the loop that measures stays
in the coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiopipe.metrics.epoch import counts_by_device
from aiopipe.metrics.results import EpochMetrics
from aiopipe.metrics.trace import RESOURCE_KINDS, resource_kind
from aiopipe.protocol import RoundResult
from aiopipe.runtime.session import DeviceSession
from aiopipe.runtime.systems.base import System

__all__ = [
    "NUMBERED_FIELDS",
    "add_round",
    "busy_by_kind",
    "epoch_metrics",
    "link_bytes",
    "lost_in",
    "new_tally",
    "numbered_for_people",
    "peer_bytes",
    "perplexity",
    "privacy_status",
    "served_in_epoch",
]

#: What a change's record (`EpochMetrics.changes`, ``/status``'s ``replans``) numbers:
#: an epoch, a round of the run; the systems give them as the runtime's 0-based indices.
NUMBERED_FIELDS = ("epoch", "round", "replayed_as")


def new_tally(epoch: int, devices: int) -> dict[str, Any]:
    """An epoch's running totals (what a checkpoint needs to finish the epoch exactly)."""
    return {"epoch": epoch, "next_round": 0, "device_samples": [0] * devices,
            "loss_sum": 0.0, "correct": 0, "lost": [], "refused": [], "elapsed_before": 0.0}


def add_round(tally: dict[str, Any], participants: Sequence[int],
              done: Mapping[int, RoundResult], refused: Iterable[int]) -> None:
    """Add a round to the epoch's ``tally``: who of its ``participants`` was lost (or is
    excluded), whose update was ``refused``, and the samples, loss and correct answers
    of the results ``done``."""
    tally["lost"] = sorted(set(tally["lost"]) | (set(participants) - set(done))
                           | set(tally.get("excluded", ())))
    tally["refused"] = sorted(set(tally.get("refused", [])) | set(refused))
    for k, result in done.items():
        tally["device_samples"][k] += result.samples
        tally["loss_sum"] += result.loss_sum
        tally["correct"] += result.correct


def lost_in(tally: Mapping[str, Any], devices: int) -> tuple[int, ...]:
    """The epoch's lost devices: those that dropped out of a round it played, and those
    alive at the start of none of its rounds (absent the whole epoch, 0 samples; an
    epoch's tally from before this was kept has no ``present``: nobody absent)."""
    absent = set(range(devices)) - set(tally.get("present", range(devices)))
    return tuple(sorted({*tally["lost"], *absent}))


def numbered_for_people(change: Mapping[str, Any]) -> dict[str, Any]:
    """``change`` with its epoch and round numbers counted from 1, as the rest of
    ``metrics.jsonl`` and the log count them (its iterations stay offsets from 0)."""
    out = dict(change)
    for name in NUMBERED_FIELDS:
        if isinstance(out.get(name), int):
            out[name] += 1
    return out


def busy_by_kind(by_track: Mapping[str, float], devices: int) -> dict[str, float]:
    """Busy seconds per resource kind; device kinds are means over ``devices``."""
    totals = dict.fromkeys(RESOURCE_KINDS, 0.0)
    for track, busy in by_track.items():
        kind = resource_kind(track)
        if kind in totals:
            totals[kind] += busy
    return {kind: value if kind == "server" else value / devices
            for kind, value in totals.items()}


def link_bytes(sessions: Mapping[int, DeviceSession]) -> tuple[int, int]:
    """(up, down): bytes the coordinator received from and sent to the devices so far."""
    up = down = 0
    for session in sessions.values():
        received, sent = session.link_bytes()
        up += received
        down += sent
    return up, down


def peer_bytes(sessions: Mapping[int, DeviceSession], devices: int) -> list[int]:
    """Per device, the bytes it reported sending to its peers so far (this process's
    sessions: a device that restarted counts from its new session)."""
    return [sessions[k].peer_bytes if k in sessions else 0 for k in range(devices)]


def served_in_epoch(system: System) -> int:
    """About how many micro-batches the coordinator's stages serve in an epoch of the
    plan (with devices sampled per round, the sampled devices' share of them)."""
    config = system.config
    total = sum(system.iterations(int(p["device"])) * int(p.get("parallel_batches", 1))
                for p in system.plan_entries())
    if config.devices_per_round:  # about: the sampled devices' share of it
        devices = config.devices
        total = math.ceil(total * config.round_size(devices) / devices)
    return total


def epoch_metrics(epoch: int, tally: Mapping[str, Any], system: System, *, elapsed: float,
                  by_track: Mapping[str, float], traffic: Sequence[int], accuracy: float,
                  held_out: tuple[float, dict[str, float]],
                  sessions: Mapping[int, DeviceSession], changes: Sequence[dict[str, Any]],
                  peers: Sequence[int], last: EpochMetrics | None = None) -> EpochMetrics:
    """Epoch ``epoch``'s figures (0-based) from its ``tally`` and what was measured of it:
    its length (with the time before a restart), the trace's busy seconds per track,
    the (up, down) bytes of the devices' connections, the test-set accuracy, the
    held-out accuracy (overall, per device), the changes the system made and the bytes
    each device sent its peers. ``last``: the epoch before, whose plan this one shares
    when it is the same (a plan is an entry per device: 25 MB an epoch for a
    population of 100,000, which the run's epochs would otherwise each keep)."""
    devices = system.config.devices
    if system.config.metric == "none":  # the loss alone is reported
        held_out = (math.nan, {})
    device_samples = counts_by_device(tally["device_samples"])
    samples = system.epoch_samples(device_samples)
    # an epoch in which nobody trained has no loss (NaN, null in metrics.jsonl)
    loss = float(tally["loss_sum"]) / samples if samples else math.nan
    busy = busy_by_kind(by_track, devices)
    up, down = traffic
    # (a system that accounts differential privacy has `privacy_spent`: the star's)
    spending = getattr(system, "privacy_spent", None)
    spent = spending() if spending is not None else None
    plan = system.plan_entries()
    if last is not None and last.plan == plan:
        plan = last.plan
    return EpochMetrics(
        # people count epochs from 1 (`EpochMetrics.epoch`); the loop's index is 0-based
        epoch=epoch + 1, time_s=elapsed, busy_s=busy,
        idle_s={k: elapsed - v for k, v in busy.items()},
        loss=loss,
        accuracy=accuracy,
        train_accuracy=(float(tally["correct"]) / samples
                        if samples and system.config.metric != "none" else math.nan),
        samples=samples,
        bytes_up=int(up), bytes_down=int(down), plan=plan,
        device_samples=device_samples, devices_lost=lost_in(tally, devices),
        updates_refused=tuple(tally.get("refused", [])),
        stages=system.stage_figures(
            by_track, elapsed, {k: s.peak_live for k, s in sessions.items()},
            {k: s.peak_memory for k, s in sessions.items()}),
        links={track: {"busy_s": seconds, "idle_s": elapsed - seconds}
               for track, seconds in sorted(by_track.items()) if "->" in track},
        held_out_accuracy=held_out[0], device_accuracy=held_out[1],
        changes=tuple(changes),
        perplexity=perplexity(loss) if system.config.loss == "cross-entropy" else math.nan,
        sampled=tuple(tuple(r) for r in tally.get("sampled", ())),
        devices_excluded=tuple(tally.get("excluded", ())),
        peer_bytes=tuple(peers) if system.links_devices else (),
        **({} if spent is None else {
            "epsilon": spent.epsilon, "delta": spent.delta,
            "device_epsilon": dict(spent.device_epsilon), "privacy_unit": spent.unit}),
    )


def privacy_status(last: EpochMetrics | None) -> dict[str, Any] | None:
    """``/status``'s ``privacy``: the run's and each device's epsilon, the delta and the
    unit, as of ``last`` (None without an epoch, or without DP's accounting)."""
    if last is None or math.isnan(last.epsilon):
        return None
    return {"epsilon": last.epsilon, "delta": last.delta, "unit": last.privacy_unit,
            "device_epsilon": dict(last.device_epsilon)}


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a cross-entropy: NaN without a loss, inf past a float's range."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 700 else math.inf
