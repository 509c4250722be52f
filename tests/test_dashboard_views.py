"""What the dashboard shows, as plain values (aiopipe/metrics/dashboard.py): no event loop,
no server."""

from __future__ import annotations

import math

import orjson

from aiopipe.metrics.dashboard import (
    MAX_TIMELINE_BARS,
    device_states,
    epoch_points,
    legend,
    server_sent_event,
    timeline_view,
)
from aiopipe.metrics.timeline import COLORS, OTHER_COLOR
from aiopipe.metrics.trace import Slice

STATUS = {"devices": 5, "joined": [0, 1, 2, 3], "connected": [0, 3],
          "plan": [{"device": 0, "split_point": 2, "parallel_batches": 2},
                   {"device": 1, "split_point": 3, "parallel_batches": 1}],
          "profiles": {"1": {"compute_scale": 2.5}},
          "excluded": {"3": "sent values out of range"}}


def test_each_device_has_a_state_its_plan_and_its_profile() -> None:
    states = device_states(STATUS, finished=False)
    assert [(d["device"], d["state"]) for d in states] == [
        (0, "connected"), (1, "away"), (2, "away"), (3, "excluded"), (4, "waiting")]
    assert states[0]["plan"] == {"split_point": 2, "parallel_batches": 2}
    assert states[1]["profile"] == {"compute_scale": 2.5}
    assert states[2]["plan"] == {}
    assert states[3]["excluded"] == "sent values out of range"


def test_a_device_that_left_a_finished_run_is_done() -> None:
    states = device_states({**STATUS, "connected": []}, finished=True)
    assert [d["state"] for d in states] == ["done", "done", "done", "excluded", "waiting"]


def test_a_plan_without_devices_is_no_device_s_plan() -> None:
    status = {**STATUS, "plan": [{"stage": 0, "units": [0, 3]}]}  # a pipeline's stages
    assert all(d["plan"] == {} for d in device_states(status, finished=False))


def test_epoch_points_keep_what_the_page_charts() -> None:
    epoch = {"epoch": 1, "time_s": 1.5, "loss": 2.3, "accuracy": 0.1, "train_accuracy": 0.2,
             "samples": 160, "busy_s": {"server": 1.0}, "idle_s": {"server": 0.5},
             "devices_lost": [], "plan": [{"device": 0}], "stages": []}
    (point,) = epoch_points([epoch])
    assert point["loss"] == 2.3
    assert point["busy_s"] == {"server": 1.0}
    assert "plan" not in point


def _iteration(epoch: int, iteration: int, start: float) -> list[Slice]:
    """One PiPar iteration of one device and the server, a millisecond per stage."""
    ms = 1e-3
    return [Slice("device0/compute", "f", start, start + ms, epoch, iteration, 0),
            Slice("device0/uplink", "u", start + ms, start + 2 * ms, epoch, iteration, 0),
            Slice("server/compute", "s", start + 2 * ms, start + 3 * ms, epoch, iteration, 0),
            Slice("device0/downlink", "d", start + 3 * ms, start + 4 * ms, epoch, iteration, 0),
            Slice("device0/compute", "b", start + 4 * ms, start + 5 * ms, epoch, iteration, 0)]


def test_the_timeline_is_one_iteration_of_the_latest_epoch_in_rows_and_milliseconds() -> None:
    slices = [Slice("device0/downlink", "m", 0.0, 0.5, 0),  # a model transfer: no iteration
              *_iteration(0, 0, 1.0), *_iteration(1, 0, 2.0), *_iteration(1, 1, 3.0)]
    view = timeline_view(slices)
    assert view is not None
    assert view["caption"].startswith("epoch 2, iteration")
    assert view["rows"] == ["device0 compute", "device0 uplink", "server compute",
                            "device0 downlink"]
    kinds = [bar[1] for bar in view["bars"]]
    assert kinds == ["f", "u", "s", "d", "b"]
    assert view["bars"][0][2] == "f1"  # labelled with its micro-batch, as timeline.png
    assert view["bars"][0][3] == 0.0
    assert math.isclose(view["span_ms"], 5.0)
    assert all(kind in COLORS for kind in kinds)


def test_no_timeline_without_iterations() -> None:
    assert timeline_view([Slice("device0/downlink", "m", 0.0, 0.5, 0)]) is None
    assert timeline_view([]) is None


def test_a_timeline_carries_at_most_its_bound_of_bars() -> None:
    many = [Slice("server/compute", "s", i * 1e-4, i * 1e-4 + 5e-5, 0, 0, i)
            for i in range(MAX_TIMELINE_BARS + 100)]
    view = timeline_view(many)
    assert view is not None
    assert len(view["bars"]) == MAX_TIMELINE_BARS


def test_an_event_is_one_json_line_with_nan_as_null() -> None:
    frame = server_sent_event("state", {"loss": math.nan, "text": "two\nlines"})
    assert frame.startswith(b"event: state\ndata: ")
    assert frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 3
    assert orjson.loads(frame.split(b"data: ")[1]) == {"loss": None, "text": "two\nlines"}


def test_the_legend_is_the_timeline_picture_s() -> None:
    assert legend()["colors"] == COLORS
    assert set(legend()["names"]) == set(COLORS)
    assert legend()["other"] == OTHER_COLOR
