"""The live dashboard: ``GET {prefix}/`` (a page) and ``GET {prefix}/events`` (its feed).

The page (dashboard.html and dashboard.js beside this module, served inline: no other
request, no external asset, works offline) draws what ``/status`` says, the finished
epochs' figures and the latest epoch's timeline (`aiopipe.metrics.dashboard`), and keeps
them live from ``/events``, a ``text/event-stream`` of ``state``, ``epochs`` and
``timeline`` events (server-sent events: the browser's ``EventSource`` reconnects by
itself).

Authentication is ``/status``'s: none, and the guard's bounds before authentication
([Note: bounded before authentication]). A page viewer is a stranger to the guard, so its
connection is closed ``handshake_timeout`` after its accept; the event stream therefore
ends itself cleanly before then (`stream_end`) and the browser reconnects within
`RETRY_MS`, getting the whole state again ([Note: streams that end]).

The run's state is polled, at most every `POLL_S` for all viewers together (`Feed`):
the coordinator has no listeners to call, and one look costs what a ``/status`` costs
(which grows with the slices recorded: looks take at most `LOOK_SHARE` of the loop).
An epoch's end is seen within `POLL_S` while a look takes under 25 ms.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from aiopipe.metrics.dashboard import (
    device_states,
    epoch_points,
    legend,
    server_sent_event,
    timeline_view,
)
from aiopipe.metrics.trace import Slice
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.transport.guard import ConnectionGuard

__all__ = ["POLL_S", "RETRY_MS", "Feed", "add_dashboard", "page", "stream_end", "stream_margin"]

#: Seconds between looks at the run's state (shared by every viewer).
POLL_S = 0.5
#: Most of the event loop's time the looks at the run take: ``describe`` sums the busy
#: time of every slice recorded so far, so in a long run looks come less often.
LOOK_SHARE = 0.05
#: Milliseconds the browser waits before it reopens an event stream that ended.
RETRY_MS = 1000
#: Most slices of the latest epoch that its timeline is chosen from (its last ones).
TIMELINE_SLICES = 50_000


@dataclass(slots=True)
class _Seen:
    """What one viewer's stream has sent so far."""

    state: dict[str, Any] | None = None
    epochs: int = 0
    timeline: int = -1


class Feed:
    """The run's state as the page shows it, shared by the viewers of one coordinator:
    refreshed on demand, at most every `POLL_S`; a viewer takes what changed since it
    last looked (`news`)."""

    def __init__(self, node: Coordinator) -> None:
        self.node = node
        self.state: dict[str, Any] = {}
        self.epochs: list[dict[str, Any]] = []
        self.timeline: dict[str, Any] | None = None
        self.timeline_version = 0
        #: set when the application shuts down: every stream ends at once
        self.closed = asyncio.Event()
        self._next_look = -math.inf  # (the loop's time)
        self._lock = asyncio.Lock()
        self._drawn = 0  # finished epochs when the timeline was last chosen
        self._starts: dict[int, int] = {}  # epoch -> index of its first slice
        self._scanned = 0

    async def refresh(self) -> None:
        """Look at the run again unless that was done less than `POLL_S` ago (or longer,
        `LOOK_SHARE`); the timeline is chosen again (in a thread) when an epoch has
        ended."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            started = loop.time()
            if started < self._next_look:
                return
            node = self.node
            status = node.describe()
            finished = status.pop("finished_epochs")
            if len(finished) != len(self.epochs):
                self.epochs = epoch_points(finished)
            status["finished"] = node.finished
            if node.finished:  # (``/status`` goes on dividing by the time since)
                status["busy_fraction"] = {}
            status["device_states"] = device_states(status, finished=node.finished)
            self.state = status
            took = loop.time() - started
            self._next_look = started + max(POLL_S, took / LOOK_SHARE)
            if len(finished) != self._drawn:
                slices = self._epoch_slices(len(finished) - 1)
                with node.clock.hold():  # (a virtual clock must not jump meanwhile)
                    view = await asyncio.to_thread(timeline_view, slices)
                self._drawn = len(finished)  # (not before: a cancelled look tries again)
                if view is not None:
                    self.timeline, self.timeline_version = view, self.timeline_version + 1

    def news(self, seen: _Seen) -> list[bytes]:
        """The events a viewer that has seen ``seen`` has not (and mark them seen)."""
        frames = []
        if len(self.epochs) != seen.epochs:
            start = seen.epochs if seen.epochs < len(self.epochs) else 0
            frames.append(server_sent_event("epochs", {"from": start,
                                                       "epochs": self.epochs[start:]}))
            seen.epochs = len(self.epochs)
        if self.state != seen.state:
            frames.append(server_sent_event("state", self.state))
            seen.state = self.state
        if self.timeline is not None and self.timeline_version != seen.timeline:
            frames.append(server_sent_event("timeline", self.timeline))
            seen.timeline = self.timeline_version
        return frames

    def _epoch_slices(self, epoch: int) -> list[Slice]:
        """The recorded slices of ``epoch`` (counted from 0; its last `TIMELINE_SLICES`):
        a finished epoch's, whose rounds have all been reported (the epoch under way has
        only the coordinator's own so far). Each slice is looked at once to learn where
        each epoch starts."""
        slices = self.node.recorder.slices
        for i in range(self._scanned, len(slices)):
            self._starts.setdefault(slices[i].epoch, i)
        self._scanned = len(slices)
        if epoch not in self._starts:
            return []
        found = [s for s in slices[self._starts[epoch]:] if s.epoch == epoch]
        return found[-TIMELINE_SLICES:]


def stream_end(guard: ConnectionGuard, transport: asyncio.Transport | None,
               now: float) -> float:
    """When (in the loop's time) an event stream that starts ``now`` on ``transport``
    ends: `stream_margin` before the guard would close its connection (counted from
    the connection's accept, which may be well before its request: a browser opens
    connections ahead), or as long after ``now`` as a connection accepted now may last
    where the guard does not watch it ([Note: streams that end])."""
    limits = guard.limits
    deadline = guard.deadline(transport)
    if deadline is None:
        deadline = now + limits.handshake_timeout
    return deadline - stream_margin(limits.handshake_timeout)


def stream_margin(handshake_timeout: float) -> float:
    """Seconds before the guard's deadline that a stream ends: 2 s, or half the timeout
    if that is shorter (the loop may be late while training holds the interpreter)."""
    return min(2.0, 0.5 * handshake_timeout)


def add_dashboard(app: web.Application, node: Coordinator, *, prefix: str = "",
                  guard: ConnectionGuard) -> Feed:
    """Mount ``{prefix}/`` (the page) and ``{prefix}/events`` (its event stream) of
    ``node`` on ``app``; the `Feed` they share. With a ``prefix``, ``{prefix}`` redirects
    to ``{prefix}/`` (the page asks for ``events`` relative to its own address)."""
    feed = Feed(node)

    async def dashboard(request: web.Request) -> web.Response:
        body, script_hash = page()
        response = web.Response(text=body, content_type="text/html", headers={
            "Cache-Control": "no-store",
            # nothing but the page's own script, styles and event stream
            "Content-Security-Policy": (
                f"default-src 'none'; script-src '{script_hash}'; style-src 'unsafe-inline'; "
                "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")})
        response.force_close()  # [Note: bounded before authentication]
        return response

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-store"})
        response.force_close()
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        end, seen = stream_end(guard, request.transport, loop.time()), _Seen()
        try:
            await response.write(f"retry: {RETRY_MS}\n\n".encode())
            while True:
                await feed.refresh()
                for frame in feed.news(seen):
                    await response.write(frame)
                left = end - loop.time()
                if left <= 0 or feed.closed.is_set():
                    break
                # the viewer's time is the wall clock's, whatever the node's clock
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(feed.closed.wait(), min(POLL_S, left))
            await response.write_eof()
        except ConnectionResetError:  # the viewer went away
            pass
        return response

    async def close(_: web.Application) -> None:
        feed.closed.set()

    app.on_shutdown.append(close)
    app.router.add_get(f"{prefix}/", dashboard)
    app.router.add_get(f"{prefix}/events", events)
    if prefix:
        async def to_page(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"{prefix}/")

        app.router.add_get(prefix, to_page)
    return feed


@cache
def page() -> tuple[str, str]:
    """The page's HTML, its script and the slice kinds' legend inlined, and the script's
    CSP source (``'sha256-...'``)."""
    folder = resources.files(__package__)
    html = (folder / "dashboard.html").read_text(encoding="utf-8")
    script = (folder / "dashboard.js").read_text(encoding="utf-8")
    script = script.replace("/*LEGEND*/null", orjson.dumps(legend()).decode())
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    return html.replace("<script></script>", f"<script>{script}</script>"), f"sha256-{digest}"


# Note [streams that end]
# ~~~~~~~~~~~~~~~~~~~~~~~
# An event stream is a long request from someone who proved nothing, which is what the
# guard bounds ([Note: bounded before authentication]): it would cut the connection at
# `handshake_timeout`, mid-chunk, and the browser would log a network error before
# reconnecting (net::ERR_INCOMPLETE_CHUNKED_ENCODING, seen in Chromium). So the server
# ends each stream itself a little earlier, with a proper end of its chunked body, and
# the browser's EventSource reopens it after `RETRY_MS`; a new stream starts with the
# whole state, so an epoch that ended in between is not missed. Chosen over admitting
# viewers past the guard: a stranger could then hold connections for as long as it
# likes, which the guard exists to prevent; the price is a reconnection every few
# seconds. The end is counted from the guard's own deadline for the connection
# (`ConnectionGuard.deadline`), not from the request: a browser may send the request on
# a connection it opened earlier. What is left: a loop held up for longer than the
# margin at a stream's end lets the guard's timer (due too, and run in the same turn)
# cut the stream first; the browser then logs the error and reconnects all the same.
