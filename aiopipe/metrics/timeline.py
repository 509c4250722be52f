"""Pictures of a run: a trace drawn as a pipeline timeline (like PiPar Fig. 2) and an
overview of the epochs' figures.

`draw_timeline` draws any trace: one row per resource track, one bar per stage, coloured
by stage kind (legend below), labelled with the micro-batch number where it fits; a
server slice is also marked with the device it serves (`server_devices`). A run's
``timeline.png`` (`draw_run_timeline`) shows one iteration only, picked by
`representative_window`; its ``overview.png`` (`draw_overview`) the epoch time, training
loss and test accuracy per epoch.

matplotlib is optional (the ``plot`` extra) and imported only by the drawing functions,
which raise ImportError without it; `aiopipe.metrics.results.write_results` then draws
nothing. Choosing windows and devices needs no matplotlib.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiopipe.metrics.epoch import EpochMetrics
from aiopipe.metrics.trace import device_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["COLORS", "OTHER_COLOR", "STAGES", "draw_overview", "draw_run_timeline", "draw_timeline",
           "overview_figure", "representative_window", "select_window", "server_devices"]

COLORS = {"f": "#4C72B0", "u": "#55A868", "s": "#C44E52", "d": "#8172B2", "b": "#CCB974",
          "step": "#64B5CD", "m": "#999999", "agg": "#333333", "ckpt": "#333333"}
#: The colour of a slice kind that is not in `COLORS` (a system's own, as HADFL's "FB").
OTHER_COLOR = "#777777"
#: Characters of a timeline's title per line (13-inch figure, 10-point type).
TITLE_CHARS = 150

#: What each slice kind (a slice's ``cat``) is, in legend order.
STAGES = {"f": "forward", "u": "upload", "s": "server (last stage) fwd+bwd", "d": "download",
          "b": "backward", "step": "optimizer step", "m": "model transfer",
          "agg": "aggregation", "ckpt": "checkpoint"}

#: Matching a server slice to the device it serves (`server_devices`): a gap that runs
#: backwards (a download that starts before the slice ends, an upload that ends after
#: it starts) costs this many times its length; an upload's gap counts `_UPLOAD_WEIGHT`
#: times (the server may queue an upload a long time, and the device's clock is not
#: quite the server's), a download's fully (the server's own send, at once).
_EARLY_PENALTY = 10.0
_UPLOAD_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class _Bar:
    """One complete ("X") event of a trace."""

    index: int  # in traceEvents
    tid: Any
    track: str
    kind: str
    name: str
    start: float  # µs
    dur: float
    epoch: int
    iteration: int
    micro_batch: int

    @property
    def end(self) -> float:
        return self.start + self.dur


def select_window(
    trace: Mapping[str, Any], *, epoch: int | None = None, iterations: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The trace's slices of one epoch and/or iterations ``first..last`` (inclusive),
    shifted so that the window starts at time 0; metadata events are kept.

    Slices without the attribute asked for (model transfers have no iteration) are left
    out when filtering by it.
    """
    events = list(trace.get("traceEvents", []))
    meta = [e for e in events if e.get("ph") != "X"]
    slices = [e for e in events if e.get("ph") == "X"]

    def keep(e: Mapping[str, Any]) -> bool:
        args = e.get("args") or {}
        if epoch is not None and args.get("epoch") != epoch:
            return False
        if iterations is not None:
            it = args.get("iteration")
            return isinstance(it, int) and iterations[0] <= it <= iterations[1]
        return True

    chosen = [e for e in slices if keep(e)]
    if chosen and (epoch is not None or iterations is not None):
        origin = min(e["ts"] for e in chosen)
        chosen = [{**e, "ts": e["ts"] - origin} for e in chosen]
    return {**trace, "traceEvents": meta + chosen}


def server_devices(trace: Mapping[str, Any]) -> dict[int, int]:
    """Which device each server slice serves: index in ``traceEvents`` -> device number.

    A trace does not record it, so it is inferred. A server "s" slice of micro-batch
    (epoch, iteration, n) serves the device whose "d" slice of that micro-batch (the
    server sending the gradient back, timed on the server's clock) starts right after
    it ends, its "u" slice ending before it starts breaking near ties (each device's
    micro-batch once, the best fits first). The server's "step" slices of an iteration
    serve its devices in the order their last "s" slices ended (the server's compute is
    one FIFO queue), when there are as many steps as devices; other server slices are
    left out.
    """
    return _server_devices(_bars(trace))


def _server_devices(bars: Sequence[_Bar]) -> dict[int, int]:
    """`server_devices` of these slices."""
    ups: dict[tuple[int, int, int], dict[int, list[float]]] = {}
    downs: dict[tuple[int, int, int], dict[int, list[float]]] = {}
    for bar in bars:
        device = device_of(bar.track)
        key = (bar.epoch, bar.iteration, bar.micro_batch)
        if device is not None and bar.kind == "u" and bar.track.endswith("/uplink"):
            ups.setdefault(key, {}).setdefault(device, []).append(bar.end)
        elif device is not None and bar.kind == "d" and bar.track.endswith("/downlink"):
            downs.setdefault(key, {}).setdefault(device, []).append(bar.start)
    served = [b for b in bars if b.track.startswith("server/") and b.kind == "s"]
    pairs: list[tuple[float, int, int]] = []  # (cost, position in served, device)
    for position, bar in enumerate(served):
        key = (bar.epoch, bar.iteration, bar.micro_batch)
        up, down = ups.get(key, {}), downs.get(key, {})
        for device in sorted(set(up) | set(down)):
            cost = min((_gap_cost(bar.start - end) for end in up.get(device, ())), default=0.0)
            if device in down:
                cost = cost * _UPLOAD_WEIGHT + min(_gap_cost(start - bar.end)
                                                   for start in down[device])
            pairs.append((cost, position, device))
    left: dict[tuple[tuple[int, int, int], int], int] = {}  # how often each may still serve
    for table in (ups, downs):
        for key, per_device in table.items():
            for device, times in per_device.items():
                left[(key, device)] = max(left.get((key, device), 0), len(times))
    found: dict[int, int] = {}
    for _, position, device in sorted(pairs):
        bar = served[position]
        key = (bar.epoch, bar.iteration, bar.micro_batch)
        if bar.index in found or left.get((key, device), 0) <= 0:
            continue
        found[bar.index] = device
        left[(key, device)] -= 1
    last: dict[tuple[int, int], dict[int, float]] = {}
    for bar in served:
        device = found.get(bar.index)
        if device is not None:
            ends = last.setdefault((bar.epoch, bar.iteration), {})
            ends[device] = max(ends.get(device, bar.end), bar.end)
    steps: dict[tuple[int, int], list[_Bar]] = {}
    for bar in bars:
        if bar.track.startswith("server/") and bar.kind == "step":
            steps.setdefault((bar.epoch, bar.iteration), []).append(bar)
    for round_key, chosen in steps.items():
        ends = last.get(round_key, {})
        if len(chosen) == len(ends):
            order = sorted(ends, key=lambda device: (ends[device], device))
            for bar, device in zip(sorted(chosen, key=lambda b: b.start), order, strict=True):
                found[bar.index] = device
    return found


def representative_window(trace: Mapping[str, Any]) -> tuple[dict[str, Any], str] | None:
    """One typical iteration of a run: the trace's slices of it, shifted to start at time
    0 with the metadata events kept, and a caption saying which one it is; None when no
    slice belongs to an iteration.

    It is the iteration of median duration (the shorter of the two middle ones) in the
    last epoch. Devices that work on the same iteration at overlapping times (pipar,
    sfl, pipeline, fl) share it; a device that runs its iteration alone (sl, where
    devices take turns) has its own, and the caption names the device.
    """
    bars = [b for b in _bars(trace) if b.epoch >= 0 and b.iteration >= 0]
    if not bars:
        return None
    last = max(b.epoch for b in bars)
    bars = [b for b in bars if b.epoch == last]
    owners = _server_devices(bars)
    groups: dict[tuple[int, int], list[_Bar]] = {}
    for bar in bars:
        groups.setdefault((bar.epoch, bar.iteration), []).append(bar)
    candidates: list[tuple[float, int, int, list[_Bar]]] = []  # span (whole µs), ...
    devices_per_iteration: dict[int, set[int]] = {}
    for (_, iteration), members in groups.items():
        for cluster in _clusters(members, owners):
            span = float(round(max(b.end for b in cluster) - min(b.start for b in cluster)))
            candidates.append((span, iteration, min(b.index for b in cluster), cluster))
        for bar in members:
            device = owners.get(bar.index, device_of(bar.track))
            if device is not None:
                devices_per_iteration.setdefault(device, set()).add(iteration)
    candidates.sort(key=lambda c: c[:3])
    span, iteration, _, cluster = candidates[(len(candidates) - 1) // 2]
    chosen = {b.index for b in cluster}
    events = list(trace.get("traceEvents", []))
    origin = min(b.start for b in cluster)
    window = [e if i not in chosen else {**e, "ts": e["ts"] - origin}
              for i, e in enumerate(events) if e.get("ph") != "X" or i in chosen]
    count = max((len(its) for its in devices_per_iteration.values()), default=len(groups))
    own = {owners.get(b.index, device_of(b.track)) for b in cluster} - {None}
    everyone = {owners.get(b.index, device_of(b.track)) for b in groups[(last, iteration)]}
    who = f"device {own.pop()}, " if len(own) == 1 and len(everyone - {None}) > 1 else ""
    total = len(candidates)
    caption = f"epoch {last + 1} of {last + 1}, {who}iteration {iteration + 1} of {count}"
    if total > 1:
        caption += (f" ({span / 1e3:.1f} ms, the median duration of the last epoch's "
                    f"{_candidates_text(candidates, owners)})")
    else:
        caption += f" ({span / 1e3:.1f} ms)"
    return {**trace, "traceEvents": window}, caption


def _candidates_text(candidates: Sequence[tuple[float, int, int, list[_Bar]]],
                     owners: Mapping[int, int]) -> str:
    """What the median was taken over, truthfully: ``"41 iterations"`` when devices
    shared every one, ``"82 device iterations"`` when each device ran every one alone,
    else both kinds counted (devices that drift apart share some iterations and not
    others: ``"16 iterations: 12 of one device alone, 4 of 2 devices at once"``)."""
    sizes = [len({owners.get(b.index, device_of(b.track)) for b in cluster} - {None})
             for *_, cluster in candidates]
    alone, shared = [n for n in sizes if n <= 1], sorted({n for n in sizes if n > 1})
    if not shared:
        many = len({owners.get(b.index, device_of(b.track)) for *_, cluster in candidates
                    for b in cluster} - {None}) > 1
        return f"{len(sizes)} {'device ' if many else ''}iterations"
    if not alone:
        return f"{len(sizes)} iterations"
    together = f"{shared[0]} devices" if len(shared) == 1 else "several devices"
    return (f"{len(sizes)} iterations: {len(alone)} of one device alone, "
            f"{len(sizes) - len(alone)} of {together} at once")


def draw_timeline(trace: Mapping[str, Any], path: str | Path, *, max_events: int = 5000,
                  title: str = "aiopipe timeline") -> Path:
    """Render a Chrome trace object (``{"traceEvents": [...]}``) to a PNG at ``path``.

    One row per track that has slices (links' rows thinner than compute rows), one bar
    per slice coloured by its kind (legend below the plot), labelled where it fits; a
    server slice whose device `server_devices` finds has a stripe in that device's
    colour (the colour behind the device's row names) and names it (``dev3``) where it
    fits. Only the first ``max_events`` slices are drawn so huge traces stay readable.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    names = _track_names(trace.get("traceEvents", []))
    bars = [b for b in _bars(trace) if b.tid in names][:max_events]
    owners = server_devices(trace)
    tids = sorted({b.tid for b in bars})
    heights = [1.4 if names[t].startswith("server/") else
               1.0 if names[t].endswith("/compute") else 0.6 for t in tids]
    rows = {tid: sum(heights[:i]) + h / 2 for i, (tid, h) in enumerate(zip(tids, heights,
                                                                           strict=True))}
    size = dict(zip(tids, heights, strict=True))
    devices = sorted({d for d in (device_of(names[t]) for t in tids) if d is not None}
                     | set(owners.values()))
    tint = _device_colors(devices)
    unit_in = 0.42 if sum(heights) <= 12 else max(0.22, 6.0 / sum(heights))
    fig = Figure(figsize=(13, unit_in * sum(heights) + 1.7), dpi=120, layout="constrained")
    ax = fig.subplots()
    first = min((b.start for b in bars), default=0.0)
    last = max((b.end for b in bars), default=1.0)
    span_ms = max((last - first) / 1e3, 1e-3)
    thinnest = span_ms / 1500  # a zero-length slice still shows as a line
    for bar in bars:
        row, height = rows[bar.tid], 0.75 * size[bar.tid]
        start, width = bar.start / 1e3, max(bar.dur / 1e3, thinnest)
        ax.barh(row, width, left=start, height=height, color=COLORS.get(bar.kind, OTHER_COLOR),
                edgecolor="white", linewidth=0.3)
        device = owners.get(bar.index)
        if device is not None:  # the lower third (the y axis points down)
            ax.barh(row + height / 3, width, left=start, height=height / 3,
                    color=tint[device], edgecolor="white", linewidth=0.8)
    ax.set_xlim(first / 1e3 - span_ms * 0.01, last / 1e3 + span_ms * 0.01)
    ax.set_ylim(max(sum(heights), 1.0), 0.0)  # an empty trace: one empty row
    ax.set_yticks([rows[t] for t in tids], [_row_name(names[t]) for t in tids],
                  fontsize=8 if len(tids) <= 24 else 7)
    ax.tick_params(axis="y", length=0)
    for tid, label in zip(tids, ax.get_yticklabels(), strict=True):
        device = device_of(names[tid])
        if device is not None:
            label.set_bbox({"facecolor": tint[device], "alpha": 0.35, "edgecolor": "none",
                            "pad": 1.0})
        elif names[tid].startswith("server"):
            label.set_fontweight("bold")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12))
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_xlabel("time (ms)")
    ax.set_title(textwrap.fill(title, TITLE_CHARS), fontsize=10)  # a long caption wraps
    kinds = [k for k in STAGES if any(b.kind == k for b in bars)]
    kinds += sorted({b.kind for b in bars} - set(STAGES))
    handles = [Patch(facecolor=COLORS.get(k, OTHER_COLOR), label=f"{k}: {STAGES.get(k, k)}")
               for k in kinds]
    if any(b.index in owners for b in bars):
        handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="////",
                             label="lower stripe: the device served (devK; colour as its rows)"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", fontsize=8, frameon=False,
                   ncol=len(handles) if len(handles) <= 7 else math.ceil(len(handles) / 2))
    fig.draw_without_rendering()  # lay out, to know how wide a millisecond is
    box = ax.get_window_extent()
    px_per_ms = box.width / (ax.get_xlim()[1] - ax.get_xlim()[0])
    px_per_row = box.height / max(sum(heights), 1.0)
    char_px, line_px = 0.62 * 6.5 / 72 * fig.dpi, 6.5 / 72 * fig.dpi
    for bar in bars:
        device = owners.get(bar.index)
        options = ([f"{bar.name} dev{device}", f"dev{device}", str(device)] if device is not None
                   else [bar.name] if bar.kind not in ("step", "m", "agg", "ckpt") else [])
        wide = bar.dur / 1e3 * px_per_ms - 3
        high = 0.75 * size[bar.tid] * px_per_row * (2 / 3 if device is not None else 1) - 2
        text = next((o for o in options if len(o) * char_px <= wide), None)
        turn = 0
        if (text is None and device is not None and line_px <= wide
                and len(options[-1]) * char_px <= high):
            text, turn = options[-1], 90  # the device, upright in a narrow server slice
        if text is not None:  # above the stripe, if any
            lift = 0.75 * size[bar.tid] / 6 if device is not None else 0.0
            ax.text((bar.start + bar.dur / 2) / 1e3, rows[bar.tid] - lift, text, ha="center",
                    va="center", fontsize=6.5, color="white", clip_on=True, rotation=turn)
    out = Path(path)
    fig.savefig(out)
    return out


def draw_run_timeline(trace: Mapping[str, Any], path: str | Path, *,
                      label: str = "aiopipe") -> Path:
    """A run's ``timeline.png``: the `representative_window` of ``trace`` drawn by
    `draw_timeline`, titled ``label`` and the window's caption; the whole trace (its
    first 5000 slices) when no slice belongs to an iteration.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    picked = representative_window(trace)
    if picked is None:
        return draw_timeline(trace, path, title=f"{label}: the whole run")
    window, caption = picked
    return draw_timeline(window, path, title=f"{label}: {caption}")


def draw_overview(epochs: Sequence[EpochMetrics], path: str | Path, *,
                  title: str = "aiopipe run") -> Path:
    """A run's ``overview.png``: `overview_figure` of ``epochs`` saved at ``path``.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    out = Path(path)
    overview_figure(epochs, title=title).savefig(out)
    return out


def overview_figure(epochs: Sequence[EpochMetrics], *,
                    title: str = "aiopipe run") -> Figure:
    """Per epoch (numbered from 1), the epoch time, the training loss and the test
    accuracy (with the devices' held-out accuracy where they have any), in three small
    titled panels; the accuracy panel is left out when neither is known (no test set:
    NaN). Values missing in some epochs (NaN: no round completed) are left out of their
    line.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    numbers = [e.epoch for e in epochs]
    # (title, lines (label, values), value format, y range: "zero" starts at 0, "unit" is 0..1)
    panels: list[tuple[str, list[tuple[str, list[float]]], str, str]] = [
        ("epoch time (s)", [("", _values(epochs, "time_s"))], ".2f", "zero"),
        ("training loss", [("", _values(epochs, "loss"))], ".3f", ""),
    ]
    accuracy = [(name, values) for name, values in (
        ("test set", _values(epochs, "accuracy")),
        ("devices' held-out data", _values(epochs, "held_out_accuracy")),
    ) if any(math.isfinite(v) for v in values)]
    if [name for name, _ in accuracy] == ["test set"]:
        panels.append(("test accuracy", [("", accuracy[0][1])], ".3f", "unit"))
    elif accuracy:
        panels.append(("accuracy", accuracy, ".3f", "unit"))
    fig = Figure(figsize=(3.6 * len(panels) + 0.4, 3.0), dpi=120, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, lines, form, span) in zip(axes, panels, strict=True):
        for line, values in lines:
            _plot_epochs(ax, numbers, values, line, form)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("epoch", fontsize=9)
        if len(numbers) <= 12:
            ax.set_xticks(numbers)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if numbers:
            ax.set_xlim(min(numbers) - 0.5, max(numbers) + 0.5)
        known = [v for _, values in lines for v in values if math.isfinite(v)]
        if span == "unit":
            ax.set_ylim(0.0, 1.1)  # room for the values written above the points
        elif known:
            low = 0.0 if span == "zero" else min(known)
            gap = (max(known) - low) or abs(max(known)) or 1.0
            ax.set_ylim(low - (0.0 if span == "zero" else 0.15 * gap), max(known) + 0.2 * gap)
        if any(line for line, _ in lines):
            ax.legend(fontsize=7, frameon=False, loc="best")
        ax.grid(color="#dddddd", linewidth=0.5)
        ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def _plot_epochs(ax: Axes, numbers: Sequence[int], values: Sequence[float], label: str,
                 form: str) -> None:
    """One line over the epochs (a gap where a value is NaN). Unlabelled, it has every
    point's value written above it when there are few, else the last one's; labelled
    (one of several lines), its legend entry ends with its last value."""
    points = [(n, v) for n, v in zip(numbers, values, strict=True) if math.isfinite(v)]
    if not points:
        return
    if label:
        label = f"{label} (last {format(points[-1][1], form)})"
    line = ax.plot(numbers, values, marker="o", markersize=4, linewidth=1.2,
                   label=label or None)[0]
    if label:
        return
    if len(points) <= 8:
        for n, v in points:
            ax.annotate(format(v, form), (n, v), textcoords="offset points", xytext=(0, 5),
                        ha="center", fontsize=7, color=line.get_color())
    else:  # left of the last point, inside the panel
        n, v = points[-1]
        ax.annotate(format(v, form), (n, v), textcoords="offset points", xytext=(-2, 5),
                    ha="right", fontsize=7, color=line.get_color())


def _values(epochs: Iterable[EpochMetrics], name: str) -> list[float]:
    """Field ``name`` of each epoch as a float; NaN where it is None."""
    out = []
    for e in epochs:
        value = getattr(e, name)
        out.append(float(value) if isinstance(value, int | float) else math.nan)
    return out


def _track_names(events: Iterable[Mapping[str, Any]]) -> dict[Any, str]:
    return {e["tid"]: str(e["args"]["name"]) for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def _bars(trace: Mapping[str, Any]) -> list[_Bar]:
    """The trace's complete events, in trace order, with their track's name."""
    events = trace.get("traceEvents", [])
    names = _track_names(events)
    bars = []
    for index, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        bars.append(_Bar(index, e.get("tid"), names.get(e.get("tid"), ""),
                         str(e.get("cat") or e.get("name", "")), str(e.get("name", "")),
                         float(e["ts"]), float(e["dur"]), _int(args.get("epoch")),
                         _int(args.get("iteration")), _int(args.get("micro_batch"))))
    return bars


def _int(value: Any) -> int:
    return value if isinstance(value, int) else -1


def _row_name(track: str) -> str:
    """"device3/uplink" -> "device3 uplink", "device0->device1" -> "device0 → device1"."""
    return track.replace("->", " → ").replace("/", " ")


def _gap_cost(gap: float) -> float:
    return gap if gap >= 0 else -gap * _EARLY_PENALTY


def _clusters(members: Sequence[_Bar], owners: Mapping[int, int]) -> list[list[_Bar]]:
    """An iteration's slices split into groups of devices whose spans overlap; a slice of
    no known device joins the group it overlaps most (else the nearest)."""
    own: dict[int, list[_Bar]] = {}
    loose: list[_Bar] = []
    for bar in members:
        device = owners.get(bar.index, device_of(bar.track))
        if device is None:
            loose.append(bar)
        else:
            own.setdefault(device, []).append(bar)
    spans = sorted((min(b.start for b in bars), max(b.end for b in bars), device)
                   for device, bars in own.items())
    groups: list[tuple[float, float, list[_Bar]]] = []
    for start, end, device in spans:
        if groups and start <= groups[-1][1]:
            first, reach, bars = groups[-1]
            groups[-1] = (first, max(reach, end), bars + own[device])
        else:
            groups.append((start, end, list(own[device])))
    if not groups:
        return [list(members)]
    for bar in loose:
        best = max(range(len(groups)), key=lambda g: (
            min(bar.end, groups[g][1]) - max(bar.start, groups[g][0]),
            -min(abs(bar.start - groups[g][0]), abs(bar.start - groups[g][1]))))
        groups[best][2].append(bar)
    return [bars for _, _, bars in groups]


def _device_colors(devices: Sequence[int]) -> dict[int, str]:
    """A colour per device: tab10's (tab20's beyond 10 devices, dark shades first; cycled
    beyond 20), red and cyan last as a server's slices are red ("s") and cyan ("step")."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    hues = [1, 0, 2, 4, 5, 6, 8, 7, 9, 3]  # tab10: orange, blue, green, purple, ...
    if len(devices) <= 10:
        order, palette = hues, colormaps["tab10"]
    else:
        order, palette = [2 * h for h in hues] + [2 * h + 1 for h in hues], colormaps["tab20"]
    return {d: to_hex(palette(order[i % len(order)])) for i, d in enumerate(devices)}
