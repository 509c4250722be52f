"""``python -m aiopipe.timeline``: draws a PNG from a trace.json; bad files give one line
and exit code 2.

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
    return [str(tmp / "trace.json"), "-o", str(tmp / "w.png"), "--epoch", "0", "--iterations", "1"]


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
    return [str(tmp / "trace.json"), "-o", str(tmp / "e.png"), "--epoch", "7"]


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
        ("bad_iterations", "FIRST <= LAST"),
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
