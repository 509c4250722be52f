"""Plans, re-plans and device profiles as a person reads them in the log: one short
line per device (devices with the same plan share a line), instead of the plain values
``metrics.jsonl`` keeps (`System.plan_entries`: a list of dicts, which the log used to
print as it is).

A plan entry is described by the keys it has, so every system's entries read alike:
``split_point`` (the star modes: units on the device and on the server),
``units`` (a pipeline stage's), ``rows`` (an Asteroid member's share of each
micro-batch), ``parallel_batches``, ``batches`` and ``in_flight`` (FTPipeHD),
``schedule``, ``local_steps`` and ``step_s`` (HADFL's strategy), and ``stage`` with
``device`` naming whose line it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiopipe.wording import id_ranges, plural

__all__ = ["change_lines", "log_lines", "log_plan", "plan_lines", "profile_text"]

#: Lines of a plan logged at most; the rest are counted (a fleet of hundreds).
MAX_LINES = 12


def log_plan(logger: logging.Logger, level: int, header: str,
             entries: Sequence[Mapping[str, Any]], *, units: int, batch_size: int,
             iterations: Callable[[int], int] | None = None, notes: Sequence[str] = ()
             ) -> None:
    """Log a plan under ``header`` (`log_lines`): a line per device (`plan_lines`), what
    every line would repeat said once, in the header after ``notes``, e.g. ``"planned
    pipeline (4 micro-batches of 12, 1f1b, 41 iterations an epoch):"`` then ``"  stage
    0, device 0: units 0-1"``..."""
    shared, lines = plan_lines(entries, units=units, batch_size=batch_size,
                               iterations=iterations)
    said = ", ".join([*notes, shared] if shared else notes)
    log_lines(logger, level, f"{header} ({said}):" if said else f"{header}:", lines)


def plan_lines(entries: Sequence[Mapping[str, Any]], *, units: int, batch_size: int,
               iterations: Callable[[int], int] | None = None) -> tuple[str, list[str]]:
    """What every device's plan says alike (when there are several lines), and one line
    per device without it, e.g. ``"devices 0-1: units 0-1 on the device, units 2-4 on
    the server (split 2), 4 micro-batches of 12, 41 iterations an epoch"``; devices
    whose plans read the same share a line; at most `MAX_LINES` lines. ``units``: the
    model's split units; ``iterations``: a device's iterations per epoch."""
    groups: dict[tuple[Any, tuple[str, ...]], list[int]] = {}
    for entry in entries:
        device = int(entry["device"])
        said = _describe(entry, units, batch_size,
                         iterations(device) if iterations is not None else None)
        groups.setdefault((entry.get("stage"), tuple(said)), []).append(device)
    common: list[str] = []
    if len(groups) > 1:
        first, *others = [described for _, described in groups]
        common = [p for p in first if all(p in described for described in others)]
    lines = []
    for (stage, parts), devices in groups.items():
        who = f"{'device' if len(devices) == 1 else 'devices'} {id_ranges(devices)}"
        who = who if stage is None else f"stage {stage}, {who}"
        own = [p for p in parts if p not in common]
        lines.append(f"{who}: {', '.join(own)}" if own else f"{who}: likewise")
    return ", ".join(common), _capped(lines)


def change_lines(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
                 ) -> list[str]:
    """What changed per device between two plans, e.g. ``"device 1: split 2 -> 3, 4 ->
    2 micro-batches"``; devices whose changes read the same share a line, devices that
    kept their plan are left out (``["no change"]`` when none changed)."""
    old = {int(e["device"]): e for e in before}
    new = {int(e["device"]): e for e in after}
    groups: dict[str, list[int]] = {}
    for device in sorted(set(old) | set(new)):
        if device not in new:
            text = "left the plan"
        elif device not in old:
            text = "joined the plan"
        else:
            text = ", ".join(_difference(key, old[device].get(key), new[device].get(key))
                             for key in new[device] if key != "estimate_s"
                             and old[device].get(key) != new[device].get(key))
        if text:
            groups.setdefault(text, []).append(device)
    lines = [f"{'device' if len(ds) == 1 else 'devices'} {id_ranges(ds)}: {text}"
             for text, ds in groups.items()]
    return _capped(lines) or ["no change"]


def profile_text(figures: Mapping[str, float | None]) -> str:
    """A device's profile (`aiopipe.runtime.profiling.profile_figures`) in words, e.g.
    ``"trains a sample through the whole model in 0.999 ms; uplink 1399 Mbit/s,
    downlink too fast to time"``."""
    parts = []
    per_sample = figures.get("train_s_per_sample")
    if per_sample is not None:
        parts.append(f"trains a sample through the whole model in {_seconds(per_sample)}")
    links = [f"{name} {'too fast to time' if rate is None else f'{_number(rate)} Mbit/s'}"
             for name, rate in (("uplink", figures.get("uplink_mbps")),
                                ("downlink", figures.get("downlink_mbps")))]
    return "; ".join([*parts, ", ".join(links)])


def log_lines(logger: logging.Logger, level: int, header: str, lines: Sequence[str]) -> None:
    """Log ``header`` with ``lines``: one record when there is one line (``"header
    line"``), else the header and then each line indented, a record each (a short
    table under the log's timestamps)."""
    if len(lines) == 1:
        logger.log(level, "%s %s", header, lines[0])
        return
    logger.log(level, "%s", header)
    for line in lines:
        logger.log(level, "  %s", line)


def _describe(entry: Mapping[str, Any], units: int, batch: int, iterations: int | None
              ) -> list[str]:
    """One device's plan entry in words (module docstring), part by part."""
    parts = []
    split = entry.get("split_point")
    if isinstance(split, int):
        if split >= units:
            parts.append(f"the whole model ({_span(0, units)})")
        else:
            parts.append(f"{_span(0, split)} on the device, {_span(split, units)} on the "
                         f"server (split {split})")
    elif "units" in entry:
        first, stop = entry["units"]
        parts.append(_span(int(first), int(stop)))
    n = entry.get("parallel_batches")
    if isinstance(n, int) and n >= 1:
        micro = batch // n
        parts.append(f"batches of {batch}" if n == 1
                     else f"{plural(n, 'micro-batch')} of {micro}")
        rows = entry.get("rows")
        if rows is not None and list(rows) != [0, micro]:
            parts.append(f"rows {rows[0]}-{rows[1] - 1} of each")
    if isinstance(entry.get("batches"), int):
        parts.append(f"{plural(entry['batches'], 'batch')} of {batch} a round")
    if isinstance(entry.get("in_flight"), int):
        parts.append(f"up to {entry['in_flight']} in flight")
    if entry.get("schedule"):
        parts.append(str(entry["schedule"]))
    if isinstance(entry.get("local_steps"), int):
        parts.append(f"{plural(entry['local_steps'], 'local step')} a round")
    if isinstance(entry.get("step_s"), float):
        parts.append(f"{_seconds(entry['step_s'])} a step")
    if iterations is not None:
        parts.append(f"{plural(iterations, 'iteration')} an epoch")
    return parts


def _difference(key: str, old: Any, new: Any) -> str:
    """One key's change, in words."""
    if key == "split_point":
        return f"split {old} -> {new}"
    if key == "parallel_batches":
        return f"{old} -> {new} micro-batches"
    if key == "units" and old is not None and new is not None:
        return f"{_span(*old)} -> {_span(*new)}"
    if key == "rows" and old is not None and new is not None:
        return f"rows {old[0]}-{old[1] - 1} -> {new[0]}-{new[1] - 1}"
    return f"{key} {old} -> {new}"


def _span(first: int, stop: int) -> str:
    """Units ``first..stop-1``: ``"unit 3"`` or ``"units 0-2"``."""
    return f"unit {first}" if stop - first == 1 else f"units {first}-{stop - 1}"


def _seconds(value: float) -> str:
    """``0.0012`` -> ``"1.2 ms"``, ``0.3104`` -> ``"310 ms"``, ``2.5`` -> ``"2.5 s"``."""
    return f"{_number(value * 1e3)} ms" if value < 1 else f"{_number(value)} s"


def _number(value: float) -> str:
    """Three significant digits, a whole number from 100 up (never ``1.4e+03``)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _capped(lines: list[str]) -> list[str]:
    """At most `MAX_LINES` lines, the last saying how many more there are."""
    if len(lines) <= MAX_LINES:
        return lines
    rest = len(lines) - MAX_LINES + 1
    return [*lines[:MAX_LINES - 1], f"... and {plural(rest, 'more line')} like these "
                                    "(metrics.jsonl's plan has them all)"]
