"""What the live dashboard shows: plain views of a run's state, and its event frames.

The server's page at ``/`` (`aiopipe.runtime.dashboard`) draws three kinds of event,
each a JSON object built here from what the run already records, with no event loop:
- ``state``: ``/status`` as `Coordinator.describe` answers it, less its finished
  epochs, plus each device's state (`device_states`) and whether the run is over;
- ``epochs``: the figures of finished epochs from index ``from`` on (`epoch_points`),
  the fields of ``metrics.jsonl`` that the page charts;
- ``timeline``: one iteration of the latest epoch's slices (`timeline_view`), the one
  ``timeline.png`` draws (`representative_window`), as rows × milliseconds, coloured
  by slice kind as `aiopipe.metrics.timeline.COLORS` says.
`server_sent_event` frames one for a ``text/event-stream``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from aiopipe.metrics.timeline import COLORS, OTHER_COLOR, STAGES, representative_window
from aiopipe.metrics.trace import Slice, chrome_trace

__all__ = ["DEVICE_STATES", "EPOCH_FIELDS", "MAX_TIMELINE_BARS", "device_states",
           "epoch_points", "legend", "server_sent_event", "timeline_view"]

#: What a device can be, as the page names it: not joined yet, in the run and connected,
#: joined but not connected now (reconnecting, or lost), excluded from the run, or the run
#: is over and it has left.
DEVICE_STATES = ("waiting", "connected", "away", "excluded", "done")

#: An epoch's figures that the page charts (names as in ``metrics.jsonl``).
EPOCH_FIELDS = ("epoch", "time_s", "loss", "accuracy", "train_accuracy", "samples",
                "busy_s", "idle_s", "devices_lost")

#: Most slices a timeline event carries (a long iteration's first ones; as
#: `draw_timeline`'s ``max_events``).
MAX_TIMELINE_BARS = 5000


def device_states(status: Mapping[str, Any], *, finished: bool) -> list[dict[str, Any]]:
    """One entry per device of ``status`` (``/status``'s object): its id, its state
    (one of `DEVICE_STATES`), its plan entry (``{}`` before the plan or where the plan
    has none per device), what it measured of itself (``{}`` if nothing) and why it was
    excluded (``""`` if it was not). ``finished``: the run is over."""
    joined, connected = set(status["joined"]), set(status["connected"])
    excluded: Mapping[str, str] = status.get("excluded", {})
    plans = {int(p["device"]): dict(p) for p in status.get("plan", ())
             if isinstance(p, Mapping) and isinstance(p.get("device"), int)}
    profiles: Mapping[str, Any] = status.get("profiles", {})
    out = []
    for k in range(int(status["devices"])):
        if str(k) in excluded:
            state = "excluded"
        elif k in connected:
            state = "connected"
        elif k not in joined:
            state = "waiting"
        else:
            state = "done" if finished else "away"
        plan = {key: value for key, value in plans.get(k, {}).items() if key != "device"}
        out.append({"device": k, "state": state, "plan": plan,
                    "profile": dict(profiles.get(str(k)) or {}),
                    "excluded": excluded.get(str(k), "")})
    return out


def epoch_points(finished: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The `EPOCH_FIELDS` of each finished epoch (``/status``'s ``finished_epochs``)."""
    return [{name: epoch.get(name) for name in EPOCH_FIELDS} for epoch in finished]


def timeline_view(slices: Sequence[Slice]) -> dict[str, Any] | None:
    """One typical iteration of the latest epoch among ``slices``, as the page draws it
    and ``timeline.png`` does (`representative_window`; None when no slice belongs to an
    iteration):

    ``{"caption": str, "rows": [track names, in the trace's order], "span_ms": float,
    "bars": [[row, kind, label, start_ms, duration_ms], ...]}``, times from the
    iteration's start, at most `MAX_TIMELINE_BARS` bars (the earliest)."""
    if not any(s.iteration >= 0 for s in slices):
        return None
    trace = chrome_trace(slices)
    chosen = representative_window(trace)
    if chosen is None:
        return None
    window, caption = chosen
    # its "epoch N of N" counts the slices given; here they are one epoch of the run's
    epoch = max(s.epoch for s in slices if s.iteration >= 0)
    caption = f"epoch {epoch + 1}, " + caption.partition(", ")[2]
    events = window["traceEvents"]
    names = {e["tid"]: str(e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    complete = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    complete = complete[:MAX_TIMELINE_BARS]
    order = {tid: i for i, tid in enumerate(names)}  # chrome_trace's track order
    used = sorted({e["tid"] for e in complete}, key=lambda tid: order.get(tid, len(order)))
    rows = {tid: i for i, tid in enumerate(used)}
    bars = [[rows[e["tid"]], str(e.get("cat", "")), str(e.get("name", "")),
             round(e["ts"] / 1e3, 4), round(e["dur"] / 1e3, 4)] for e in complete]
    span = max((bar[3] + bar[4] for bar in bars), default=0.0)
    return {"caption": caption, "rows": [_row_name(names.get(tid, "?")) for tid in used],
            "span_ms": round(span, 4), "bars": bars}


def legend() -> dict[str, Any]:
    """Slice kinds' colours and names, for the page (`COLORS`, `STAGES`), and the colour
    of any other kind (`OTHER_COLOR`)."""
    return {"colors": dict(COLORS), "names": dict(STAGES), "other": OTHER_COLOR}


def server_sent_event(name: str, data: Any) -> bytes:
    """One ``text/event-stream`` event: ``name`` with ``data`` as JSON (one line: NaN and
    infinities become null)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _row_name(track: str) -> str:
    """"device3/uplink" -> "device3 uplink", "device0->device1" -> "device0 → device1"
    (as ``timeline.png``'s rows)."""
    return track.replace("->", " → ").replace("/", " ")
