"""The server's aiohttp routes: the device websocket, ``/status`` and ``/metrics``.

``GET {prefix}/ws`` admits a device, ``GET {prefix}/status`` answers JSON about the run,
``GET {prefix}/metrics`` answers Prometheus text. `add_routes` mounts them on any aiohttp
application, so an existing service can host an aiopipe server next to its own routes.

With a token secret, ``/ws`` wants ``Authorization: Bearer <token>`` minted for one device
(`aiopipe.auth`); a missing or invalid token gets HTTP 401 with a one-line reason before
any upgrade, and the connection it admits may only say hello as that token's device.
Without a secret every connection is admitted (bind loopback only, or say --insecure).
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from aiopipe.auth import authenticate_bearer, check_secret
from aiopipe.errors import AiopipeError, AuthenticationError, RemoteProtocolError
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.transport import accept_websocket

__all__ = ["add_routes"]

log = logging.getLogger("aiopipe.server")


def add_routes(app: web.Application, node: Coordinator, *, token_secret: bytes | None = None,
               prefix: str = "", shape_downlinks: bool = False) -> None:
    """Mount the device websocket and the status routes of ``node`` on ``app``.

    ``token_secret``: devices must present a token minted under it (None: no
    authentication). ``shape_downlinks``: pace what goes to device k at its
    ``network``'s downlink (sender-side shaping, to emulate the network on one machine).

    Raises:
        ConfigError: the secret is shorter than `aiopipe.auth.MIN_SECRET_BYTES`.
    """
    secret = check_secret(token_secret) if token_secret is not None else None

    async def websocket(request: web.Request) -> web.StreamResponse:
        device_id: int | None = None
        if secret is not None:
            try:
                device_id = authenticate_bearer(request.headers.get("Authorization"), secret)
            except AuthenticationError as exc:
                log.warning("refused a connection from %s: %s", request.remote, exc)
                raise web.HTTPUnauthorized(text=f"{exc}\n",
                                           headers={"WWW-Authenticate": "Bearer"}) from None
        try:
            link = await accept_websocket(request, clock=node.clock,
                                          max_frame_bytes=node.max_frame_bytes)
        except RemoteProtocolError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        try:
            await node.serve_link(link, device_id=device_id,
                                  reshape=link.reshape if shape_downlinks else None)
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


def _prometheus(node: Coordinator) -> str:
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
