"""The server's aiohttp routes: the device websocket, ``/status`` and ``/metrics``.

``GET {prefix}/ws`` admits a device (``Authorization: Bearer <token>`` when the server
has a token), ``GET {prefix}/status`` answers JSON about the run, ``GET {prefix}/metrics``
answers Prometheus text. `add_routes` mounts them on any aiohttp application, so an
existing service can host an aiopipe server next to its own routes.
"""

from __future__ import annotations

import hmac
import logging

import orjson
from aiohttp import web

from aiopipe.errors import AiopipeError, RemoteProtocolError
from aiopipe.runtime.server import ServerNode
from aiopipe.transport import LinkSpec, accept_websocket

__all__ = ["add_routes"]

log = logging.getLogger("aiopipe.server")


def add_routes(app: web.Application, node: ServerNode, *, token: str | None = None,
               prefix: str = "", downlink: LinkSpec | None = None) -> None:
    """Mount the device websocket and the status routes of ``node`` on ``app``."""

    async def websocket(request: web.Request) -> web.StreamResponse:
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise web.HTTPUnauthorized(text="missing or wrong device token\n")
        try:
            link = await accept_websocket(request, clock=node.clock,
                                          max_frame_bytes=node.max_frame_bytes, shaping=downlink)
        except RemoteProtocolError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        try:
            await node.serve_link(link)
        except AiopipeError as exc:
            log.warning("device connection from %s ended: %s", request.remote, exc)
        finally:
            await link.aclose()
        return link.response

    async def status(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(node.describe()), content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=_prometheus(node), content_type="text/plain")

    app.router.add_get(f"{prefix}/ws", websocket)
    app.router.add_get(f"{prefix}/status", status)
    app.router.add_get(f"{prefix}/metrics", metrics)


def _prometheus(node: ServerNode) -> str:
    lines = [
        "# HELP aiopipe_devices_connected Devices with an open session.",
        "# TYPE aiopipe_devices_connected gauge",
        f"aiopipe_devices_connected {len(node.connected)}",
        "# HELP aiopipe_epochs_finished Epochs finished so far.",
        "# TYPE aiopipe_epochs_finished counter",
        f"aiopipe_epochs_finished {len(node.epochs)}",
    ]
    if node.epochs:
        last = node.epochs[-1]
        lines += ["# HELP aiopipe_epoch_seconds Duration of the last finished epoch.",
                  "# TYPE aiopipe_epoch_seconds gauge", f"aiopipe_epoch_seconds {last.time_s}",
                  "# HELP aiopipe_test_accuracy Test accuracy after the last finished epoch.",
                  "# TYPE aiopipe_test_accuracy gauge", f"aiopipe_test_accuracy {last.accuracy}",
                  "# HELP aiopipe_busy_seconds Busy seconds per resource in the last epoch.",
                  "# TYPE aiopipe_busy_seconds gauge"]
        lines += [f'aiopipe_busy_seconds{{resource="{k}"}} {v}' for k, v in last.busy_s.items()]
    return "\n".join(lines) + "\n"
