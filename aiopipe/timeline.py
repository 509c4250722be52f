"""``python -m aiopipe.timeline TRACE.json``: draw any ``trace.json`` as a pipeline timeline
(like PiPar Fig. 2) into a PNG.

A thin command over `aiopipe.metrics.timeline.draw_timeline`. ``--epoch`` and
``--iterations`` cut a window out of a long trace (the window's first slice is drawn at
time 0), which is how a readable figure is made from a run of many epochs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from aiopipe.cli import ArgumentParser, run_command
from aiopipe.errors import ConfigError
from aiopipe.metrics.timeline import draw_timeline, select_window

__all__ = ["load_trace", "main", "select_window"]


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a Chrome trace file (``{"traceEvents": [...]}``, or a bare list of events).

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or not a trace.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read trace file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"trace file {str(path)!r} is not text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"trace file {str(path)!r} is not valid JSON: {exc}") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ConfigError(f"trace file {str(path)!r} has no traceEvents list")
    for e in events:
        if e.get("ph") == "X" and not (
            isinstance(e.get("ts"), int | float)
            and isinstance(e.get("dur"), int | float)
            and "tid" in e
            and isinstance(e.get("name"), str)
        ):
            raise ConfigError(
                f"trace file {str(path)!r}: a slice lacks a name, numeric ts/dur or a tid"
            )
        if (
            e.get("ph") == "M"
            and e.get("name") == "thread_name"
            and not ("tid" in e and isinstance(e.get("args"), dict) and "name" in e["args"])
        ):
            raise ConfigError(f"trace file {str(path)!r}: a thread_name event lacks args.name")
    trace: dict[str, Any] = data
    return trace


def _iterations(text: str) -> tuple[int, int]:
    first, _, last = text.partition(":")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST or FIRST:LAST, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= FIRST <= LAST, got {text!r}")
    return lo, hi


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.timeline``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.timeline",
        description="Draw a trace.json (Chrome trace events, as written in a results "
        "directory) as a pipeline timeline PNG: one row per resource, one bar "
        "per stage and micro-batch.",
    )
    parser.add_argument("trace", type=Path, help="trace.json to draw")
    parser.add_argument(
        "-o", "--output", type=Path, help="PNG to write (default: the trace's name with .png)"
    )
    parser.add_argument("--title", help="figure title (default: the trace's path)")
    parser.add_argument("--epoch", type=int,
                        help="draw only this epoch (the first is 1, as in the table)")
    parser.add_argument(
        "--iterations",
        type=_iterations,
        metavar="FIRST[:LAST]",
        help="draw only these iterations of each epoch (the first is 1; inclusive)",
    )
    parser.add_argument(
        "--max-events", type=int, default=5000, help="draw at most this many slices (default 5000)"
    )
    args = parser.parse_args(argv)
    if args.max_events < 1:
        parser.error("--max-events must be >= 1")
    if args.epoch is not None and args.epoch < 1:
        parser.error("--epoch must be >= 1")

    async def run() -> int:
        trace = load_trace(args.trace)
        if args.epoch is not None or args.iterations is not None:
            # people count from 1; the trace's indices from 0
            epoch = args.epoch - 1 if args.epoch is not None else None
            iterations = (None if args.iterations is None
                          else (args.iterations[0] - 1, args.iterations[1] - 1))
            trace = select_window(trace, epoch=epoch, iterations=iterations)
        if not any(e.get("ph") == "X" for e in trace["traceEvents"]):
            raise ConfigError(
                f"trace file {str(args.trace)!r} has no slices to draw"
                + (
                    " in that window"
                    if args.epoch is not None or args.iterations is not None
                    else ""
                )
            )
        out = args.output or args.trace.with_suffix(".png")
        try:
            draw_timeline(
                trace, out, max_events=args.max_events, title=args.title or str(args.trace)
            )
        except ImportError:
            raise ConfigError("drawing needs matplotlib: pip install 'aiopipe[plot]'") from None
        except OSError as exc:
            raise ConfigError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None
        print(out)
        return 0

    run_command(parser.prog, run)


if __name__ == "__main__":
    main()
