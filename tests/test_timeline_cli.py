"""``python -m aiopipe.timeline``: draws a PNG from a trace.json; bad files give one line
and exit code 2. Also the choices behind a run's ``timeline.png``: which device each
server slice serves, and the one iteration drawn.

Every case is a subprocess (the command imports matplotlib and torch, about two seconds),
so they run side by side once per module and each test reads its own outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiopipe.metrics.timeline import draw_run_timeline, representative_window, server_devices
from aiopipe.metrics.trace import Slice, chrome_trace
from aiopipe.timeline import select_window

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class Outcome:
    code: int
    stdout: str
    stderr: str


def _trace() -> dict[str, object]:
    """Two iterations of a 2-micro-batch PiPar pipeline on one device, plus a model upload."""
    slices = [Slice("device0/uplink", "m", 0.0, 0.05, epoch=0)]
    t = 0.1
    for it in range(2):
        for n in range(2):
            f0 = t + 0.1 * n
            slices += [
                Slice("device0/compute", "f", f0, f0 + 0.1, 0, it, n),
                Slice("device0/uplink", "u", f0 + 0.1, f0 + 0.15, 0, it, n),
                Slice("server/compute", "s", f0 + 0.15, f0 + 0.2, 0, it, n),
                Slice("device0/downlink", "d", f0 + 0.2, f0 + 0.22, 0, it, n),
                Slice("device0/compute", "b", f0 + 0.3, f0 + 0.35, 0, it, n),
            ]
        t += 0.5
    return chrome_trace(slices, origin=0.0)


CASES: dict[str, Callable[[Path], list[str]]] = {}


def _case(name: str) -> Callable[[Callable[[Path], list[str]]], Callable[[Path], list[str]]]:
    def register(make: Callable[[Path], list[str]]) -> Callable[[Path], list[str]]:
        CASES[name] = make
        return make

    return register


@_case("draw")
def _draw(tmp: Path) -> list[str]:
    (tmp / "trace.json").write_text(json.dumps(_trace()))
    return [str(tmp / "trace.json"), "-o", str(tmp / "out.png"), "--title", "two iterations"]


@_case("default_output")
def _default_output(tmp: Path) -> list[str]:
    (tmp / "run.json").write_text(json.dumps(_trace()))
    return [str(tmp / "run.json")]


@_case("window")
def _window(tmp: Path) -> list[str]:
    (tmp / "trace.json").write_text(json.dumps(_trace()))
    return [str(tmp / "trace.json"), "-o", str(tmp / "w.png"), "--epoch", "1", "--iterations", "2"]


@_case("missing")
def _missing(tmp: Path) -> list[str]:
    return [str(tmp / "nope.json")]


@_case("not_json")
def _not_json(tmp: Path) -> list[str]:
    (tmp / "bad.json").write_text("{not json")
    return [str(tmp / "bad.json"), "-o", str(tmp / "bad.png")]


@_case("not_a_trace")
def _not_a_trace(tmp: Path) -> list[str]:
    (tmp / "other.json").write_text(json.dumps({"hello": 1}))
    return [str(tmp / "other.json"), "-o", str(tmp / "other.png")]


@_case("empty_window")
def _empty_window(tmp: Path) -> list[str]:
    (tmp / "trace.json").write_text(json.dumps(_trace()))
    return [str(tmp / "trace.json"), "-o", str(tmp / "e.png"), "--epoch", "8"]


@_case("bad_iterations")
def _bad_iterations(tmp: Path) -> list[str]:
    (tmp / "trace.json").write_text(json.dumps(_trace()))
    return [str(tmp / "trace.json"), "--iterations", "3:1"]


def _run(args: list[str], cwd: Path) -> Outcome:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "aiopipe.timeline", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Outcome]]:
    dirs = {name: tmp_path_factory.mktemp(name) for name in CASES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, CASES[name](dirs[name]), dirs[name]) for name in CASES}
        return {name: (dirs[name], f.result()) for name, f in futures.items()}


def test_draws_a_png(outcomes: dict[str, tuple[Path, Outcome]]) -> None:
    tmp, out = outcomes["draw"]
    assert out.code == 0, out.stderr
    assert (tmp / "out.png").read_bytes()[:8] == PNG_MAGIC
    assert out.stdout.strip() == str(tmp / "out.png")


def test_default_output_is_next_to_the_trace(outcomes: dict[str, tuple[Path, Outcome]]) -> None:
    tmp, out = outcomes["default_output"]
    assert out.code == 0, out.stderr
    assert (tmp / "run.png").read_bytes()[:8] == PNG_MAGIC


def test_window_draws(outcomes: dict[str, tuple[Path, Outcome]]) -> None:
    tmp, out = outcomes["window"]
    assert out.code == 0, out.stderr
    assert (tmp / "w.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("missing", "cannot read trace file"),
        ("not_json", "is not valid JSON"),
        ("not_a_trace", "has no traceEvents list"),
        ("empty_window", "no slices to draw in that window"),
        ("bad_iterations", "1 <= FIRST <= LAST"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    outcomes: dict[str, tuple[Path, Outcome]], case: str, words: str
) -> None:
    tmp, out = outcomes[case]
    assert out.code == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("python -m aiopipe.timeline: error: ")
    assert words in lines[0]
    assert not list(tmp.glob("*.png"))


def test_select_window_keeps_one_iteration_from_zero() -> None:
    trace = _trace()
    window = select_window(trace, epoch=0, iterations=(1, 1))
    slices = [e for e in window["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 10
    assert {e["args"]["iteration"] for e in slices} == {1}
    assert min(e["ts"] for e in slices) == 0
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]  # type: ignore[attr-defined]
    assert [e for e in window["traceEvents"] if e["ph"] == "M"] == meta


def test_select_window_without_filters_is_unchanged() -> None:
    trace = _trace()
    assert select_window(trace) == trace


# -- a run's timeline.png: one representative iteration ----------------------------------


def _pipar_iteration(t: float, scale: float, epoch: int, it: int) -> tuple[list[Slice], float]:
    """One iteration of a 2-device, 2-micro-batch PiPar pipeline starting at ``t``, all of
    it ``scale`` times as long as the unit one; and when it ends. The server serves
    micro-batch 0 of device 1 before that of device 0, and micro-batch 1 the other way
    round (so order alone does not tell whom it serves)."""
    def at(x: float) -> float:
        return t + scale * x

    slices: list[Slice] = []
    for k in range(2):
        for n in range(2):
            f = 0.1 * n + 0.02 * k
            slices += [
                Slice(f"device{k}/compute", "f", at(f), at(f + 0.08), epoch, it, n),
                Slice(f"device{k}/uplink", "u", at(f + 0.08), at(f + 0.09), epoch, it, n),
            ]
    for j, (n, k) in enumerate([(0, 1), (0, 0), (1, 0), (1, 1)]):
        s0 = 0.25 + 0.1 * j
        slices += [
            Slice("server/compute", "s", at(s0), at(s0 + 0.09), epoch, it, n),
            Slice(f"device{k}/downlink", "d", at(s0 + 0.095), at(s0 + 0.105), epoch, it, n),
            Slice(f"device{k}/compute", "b", at(s0 + 0.105), at(s0 + 0.155), epoch, it, n),
        ]
    slices += [  # device 0's last micro-batch was served first: its step comes first
        Slice("server/compute", "step", at(0.66), at(0.7), epoch, it),
        Slice("server/compute", "step", at(0.7), at(0.74), epoch, it),
        Slice("device0/compute", "step", at(0.75), at(0.8), epoch, it),
        Slice("device1/compute", "step", at(0.8), at(0.85), epoch, it),
    ]
    return slices, at(0.85)


def _pipar_trace(scales: list[list[float]]) -> dict[str, object]:
    """Epochs of iterations, ``scales[e][i]``: how long iteration i of epoch e is."""
    slices: list[Slice] = []
    t = 0.0
    for epoch, per_iteration in enumerate(scales):
        slices += [Slice(f"device{k}/downlink", "m", t, t + 0.01, epoch=epoch) for k in (0, 1)]
        t += 0.02
        for it, scale in enumerate(per_iteration):
            made, t = _pipar_iteration(t, scale, epoch, it)
            slices += made
        slices.append(Slice("server/compute", "agg", t, t + 0.01, epoch=epoch))
        t += 0.02
    return chrome_trace(slices, origin=0.0)


def _slices(trace: dict[str, object]) -> list[dict[str, object]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]  # type: ignore[attr-defined]


def _tracks(trace: dict[str, object]) -> dict[object, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]  # type: ignore[attr-defined]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_server_devices_follow_the_uploads_and_downloads_not_the_order() -> None:
    trace = _pipar_trace([[1.0, 2.0]])
    events = trace["traceEvents"]
    found = server_devices(trace)
    server = [i for i, e in enumerate(events)  # type: ignore[arg-type]
              if e["ph"] == "X" and e["tid"] == 5]
    assert _tracks(trace)[5] == "server/compute"
    want = [1, 0, 0, 1, 0, 1] * 2  # s of (mb 0: dev 1, dev 0), (mb 1: dev 0, dev 1), 2 steps
    assert [found.get(i) for i in server if events[i]["cat"] != "agg"] == want  # type: ignore[index]
    assert set(found) == {i for i in server if events[i]["cat"] != "agg"}  # type: ignore[index]


def test_representative_window_is_the_median_iteration_of_the_last_epoch() -> None:
    trace = _pipar_trace([[1.0, 1.0, 1.0], [1.0, 3.0, 2.0]])
    picked = representative_window(trace)
    assert picked is not None
    window, caption = picked
    slices = _slices(window)
    assert {(e["args"]["epoch"], e["args"]["iteration"]) for e in slices} == {(1, 2)}  # type: ignore[index]
    one = select_window(trace, epoch=1, iterations=(2, 2))
    assert sorted(slices, key=repr) == sorted(_slices(one), key=repr)  # all of it, from 0
    assert min(e["ts"] for e in slices) == 0  # type: ignore[type-var]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]  # type: ignore[attr-defined]
    assert [e for e in window["traceEvents"] if e["ph"] == "M"] == meta
    assert caption.startswith("epoch 2 of 2, iteration 3 of 3 (")
    assert "median duration of the last epoch's 3 iterations" in caption


def test_representative_window_of_devices_taking_turns_is_one_device_s() -> None:
    """Sequential split learning: device 0 runs its iterations, then device 1 its; an
    iteration of each is a window of its own."""
    slices: list[Slice] = []
    t = 0.0
    for k, scales in enumerate([[1.0, 4.0], [3.0, 2.0]]):
        for it, scale in enumerate(scales):
            def at(x: float, t: float = t, scale: float = scale) -> float:
                return t + scale * x

            slices += [
                Slice(f"device{k}/compute", "f", at(0.0), at(0.3), 0, it, 0),
                Slice(f"device{k}/uplink", "u", at(0.3), at(0.32), 0, it, 0),
                Slice("server/compute", "s", at(0.32), at(0.6), 0, it, 0),
                Slice(f"device{k}/downlink", "d", at(0.6), at(0.62), 0, it, 0),
                Slice("server/compute", "step", at(0.62), at(0.7), 0, it),
                Slice(f"device{k}/compute", "b", at(0.62), at(0.9), 0, it, 0),
                Slice(f"device{k}/compute", "step", at(0.9), at(1.0), 0, it),
            ]
            t = at(1.0) + 0.1
    trace = chrome_trace(slices)
    picked = representative_window(trace)
    assert picked is not None
    window, caption = picked
    tracks = _tracks(trace)
    drawn = _slices(window)
    assert len(drawn) == 7
    assert {tracks[e["tid"]] for e in drawn} == {  # device 1's second iteration only
        "device1/compute", "device1/uplink", "server/compute", "device1/downlink"}
    assert {e["args"]["iteration"] for e in drawn} == {1}  # type: ignore[index]
    assert caption.startswith("epoch 1 of 1, device 1, iteration 2 of 2 (")
    assert "the last epoch's 4 device iterations" in caption


def test_representative_window_needs_iterations() -> None:
    trace = chrome_trace([Slice("device0/uplink", "m", 0.0, 0.1, epoch=0)])
    assert representative_window(trace) is None


def test_run_timeline_draws_one_iteration(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = draw_run_timeline(_pipar_trace([[1.0, 2.0, 3.0]]), tmp_path / "timeline.png",
                            label="pipar, 2 devices")
    assert out.read_bytes()[:8] == PNG_MAGIC
