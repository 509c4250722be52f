"""Draw a trace as a pipeline timeline (like PiPar Fig. 2): one row per resource track,
one bar per stage, colored by stage kind, labelled with the micro-batch number.

Needs matplotlib (the ``plot`` extra); importing this module without it raises
ImportError, which `aiopipe.metrics.results.write_results` treats as "no picture".
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["draw_timeline"]

COLORS = {"f": "#4C72B0", "u": "#55A868", "s": "#C44E52", "d": "#8172B2", "b": "#CCB974",
          "step": "#64B5CD", "m": "#999999", "agg": "#333333", "ckpt": "#333333"}


def draw_timeline(trace: Mapping[str, Any], path: str | Path, *, max_events: int = 5000,
                  title: str = "aiopipe timeline") -> Path:
    """Render a Chrome trace object (``{"traceEvents": [...]}``) to a PNG at ``path``.

    Only the first ``max_events`` slices are drawn so huge traces stay readable.

    Raises:
        OSError: the file cannot be written.
    """
    events = trace.get("traceEvents", [])
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"][:max_events]
    tids = sorted(names)
    rows = {tid: i for i, tid in enumerate(tids)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(tids) + 1.2))
    for e in slices:
        row = rows.get(e["tid"])
        if row is None:
            continue
        start, width = e["ts"] / 1e3, e["dur"] / 1e3
        ax.barh(row, width, left=start, height=0.7, color=COLORS.get(e.get("cat", ""), "#777"),
                edgecolor="white", linewidth=0.3)
        if len(slices) <= 400 and e["name"] not in ("step", "m", "agg", "ckpt"):
            ax.text(start + width / 2, row, e["name"], ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    ax.set_yticks(range(len(tids)), [names[t] for t in tids])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
