"""What the commands show while a run goes: a progress bar (tqdm) on a terminal, for
joining, planning and each epoch's micro-batches, with the per-epoch table above it.

Off when the output is not a terminal (a log file, CI): then only the table's rows are
printed, one per finished epoch, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from aiopipe.runtime.coordinator import Coordinator

__all__ = ["RunDisplay"]

#: Seconds between redraws of the bar.
REFRESH_S = 0.25


class RunDisplay:
    """The table and, on a terminal, a progress bar below it.

    Args:
        stream: where the bar goes (the table rows go to stdout).
        enabled: draw the bar (default: when ``stream`` is a terminal).
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._bar: Any = None

    def row(self, text: str) -> None:
        """Print one line of the table (above the bar, if one is drawn)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    @contextlib.asynccontextmanager
    async def following(self, node: Coordinator) -> AsyncIterator[None]:
        """Draw ``node``'s progress while the body runs (nothing when disabled)."""
        if not self.enabled:
            yield
            return
        from tqdm import tqdm

        self._bar = tqdm(total=0, file=self.stream, leave=False, dynamic_ncols=True,
                         bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} "
                                    "[{elapsed}<{remaining}]")
        from tqdm.contrib.logging import logging_redirect_tqdm

        task = asyncio.ensure_future(self._follow(node))
        try:
            with logging_redirect_tqdm():  # log lines go above the bar, not through it
                yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._bar.close()
            self._bar = None

    async def _follow(self, node: Coordinator) -> None:
        bar, config = self._bar, node.config
        while True:
            joined = len(node.announced)
            if joined < config.devices:
                desc, done, total = (f"waiting for devices ({joined}/{config.devices} "
                                     "joined)"), joined, config.devices
            elif not node.prepared:
                desc, done, total = "planning", 0, 0
            else:
                done, total = node.epoch_progress()
                desc = f"epoch {node.epoch + 1}/{config.epochs}" + (
                    "" if total else " (devices training)")
            if bar.total != total:
                bar.reset(total=total)
            bar.set_description_str(desc, refresh=False)
            bar.n = done
            bar.refresh()
            await asyncio.sleep(REFRESH_S)
