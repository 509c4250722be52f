"""The server's aiohttp routes: the device websocket, ``/status``, ``/metrics`` and the
dashboard.

``GET {prefix}/ws`` admits a device, ``GET {prefix}/status`` answers JSON about the run,
``GET {prefix}/metrics`` answers Prometheus text, ``GET {prefix}/`` a live page of the run
fed by ``{prefix}/events`` (`aiopipe.runtime.dashboard`). `add_routes` mounts them on any aiohttp
application, so an existing service can host an aiopipe server next to its own routes.

With a token secret, ``/ws`` wants ``Authorization: Bearer <token>`` minted for one device
(`aiopipe.auth`); a missing or invalid token gets HTTP 401 before any upgrade, with its
reason for the device in ``WWW-Authenticate`` (RFC 6750: ``Bearer error="invalid_token",
error_description="expired"``, a fixed phrase; plain ``Bearer`` when no token was sent;
`aiopipe.auth.refusals`) and the server log's one line as the body, and the connection it
admits may only say hello as that token's device.
Without a secret every connection is admitted (bind loopback only, or say --insecure).
Before its hello is taken a websocket takes only hello-sized frames and holds no device
slot; from its hello on it holds one of its token's ``max_per_device`` slots (HTTP 429
beyond, [Note: device slots]); the guard's other bounds hold where the server listens
itself (`aiopipe.runtime.guard`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import orjson
from aiohttp import web

from aiopipe.auth import (
    Revocations,
    Token,
    authenticate_bearer,
    bearer_challenge,
    check_secret,
)
from aiopipe.errors import AiopipeError, AuthenticationError, RemoteProtocolError
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.dashboard import add_dashboard
from aiopipe.transport import WebSocketLink, accept_websocket
from aiopipe.transport.guard import ConnectionGuard, ConnectionLimits
from aiopipe.wording import plural

__all__ = ["add_routes"]

log = logging.getLogger("aiopipe.server")


def add_routes(app: web.Application, node: Coordinator, *,
               token_secret: str | bytes | None = None,
               prefix: str = "", shape_downlinks: bool = False,
               guard: ConnectionGuard | None = None,
               revocations: Revocations | None = None) -> None:
    """Mount the device websocket, the status routes and the dashboard of ``node`` on
    ``app``: ``{prefix}/ws``, ``/status``, ``/metrics``, ``/`` and ``/events`` (and
    ``{prefix}`` itself, redirected to ``{prefix}/``, with a prefix).

    ``token_secret``: devices must present a token minted under it (bytes, or str as
    UTF-8; None: no authentication). ``shape_downlinks``: pace what goes to device k at its
    ``network``'s downlink (sender-side shaping, to emulate the network on one machine).
    ``guard``: the listening site's `ConnectionGuard`, told when a connection becomes a
    device's (default: one with the default limits, of which only the per-device and
    hello-frame bounds act here). ``revocations``: tokens listed there are refused, and
    a live connection whose token is revoked is closed within a second.

    Raises:
        ConfigError: the secret is shorter than `aiopipe.auth.MIN_SECRET_BYTES`.
    """
    secret = check_secret(token_secret) if token_secret is not None else None
    guard = guard if guard is not None else ConnectionGuard(ConnectionLimits())
    per_device: Counter[int] = Counter()  # websockets past their hello per token's device

    def authenticate(request: web.Request) -> Token | None:
        if secret is None:
            return None
        try:
            token = authenticate_bearer(request.headers.get("Authorization"), secret,
                                        revocations=revocations)
        except AuthenticationError as exc:
            log.warning("refused a connection from %s: %s", request.remote, exc)
            raise web.HTTPUnauthorized(
                text=f"{exc}\n", headers={"WWW-Authenticate": bearer_challenge(exc)}) from None
        k = token.device_id
        if per_device[k] >= guard.limits.max_per_device:  # [Note: device slots]
            log.warning("refused a connection from %s: device %d already has %s past "
                        "their hello (max_per_device)", request.remote, k,
                        plural(per_device[k], "connection"))
            raise web.HTTPTooManyRequests(
                text=f"device {k} already has {per_device[k]} connections open\n")
        return token

    async def websocket(request: web.Request) -> web.StreamResponse:
        token = authenticate(request)
        try:
            link = await accept_websocket(request, clock=node.clock,
                                          max_frame_bytes=node.max_frame_bytes)
        except RemoteProtocolError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        link.set_frame_limit(min(guard.limits.hello_frame_bytes, node.max_frame_bytes))

        holds_slot = False  # [Note: device slots]: only from its hello on

        def admitted(k: int) -> None:
            nonlocal holds_slot
            guard.admit(request.transport)
            link.set_frame_limit(node.max_frame_bytes)
            if shape_downlinks:
                link.reshape(node.config.device_network(k).down)
            if token is not None:
                per_device[k] += 1
                holds_slot = True

        device_id = token.device_id if token is not None else None
        watch = (asyncio.ensure_future(_close_when_revoked(link, token, revocations))
                 if token is not None and revocations is not None else None)
        try:
            await node.serve_link(link, device_id=device_id, admitted=admitted)
        except AiopipeError as exc:
            log.warning("device connection from %s ended: %s", request.remote, exc)
        finally:
            if token is not None and holds_slot:
                per_device[token.device_id] -= 1
            if watch is not None:
                watch.cancel()
            await link.aclose()
        return link.response

    async def status(request: web.Request) -> web.Response:
        response = web.Response(body=orjson.dumps(node.describe()),
                                content_type="application/json")
        response.force_close()  # [Note: bounded before authentication]
        return response

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = _prometheus(node)
        response = web.Response(body=body, headers={"Content-Type": content_type})
        response.force_close()
        return response

    app.router.add_get(f"{prefix}/ws", websocket)
    app.router.add_get(f"{prefix}/status", status)
    app.router.add_get(f"{prefix}/metrics", metrics)
    add_dashboard(app, node, prefix=prefix, guard=guard)  # ``/``, ``/events``: as /status


#: Seconds between looks at the revocation file while a device is connected.
REVOCATION_POLL_S = 1.0


async def _close_when_revoked(link: WebSocketLink, token: Token,
                              revocations: Revocations) -> None:
    """Close ``link`` once ``token`` is revoked (the device cannot reconnect with it)."""
    while True:
        await asyncio.sleep(REVOCATION_POLL_S)
        try:
            revocations.check(token)
        except AuthenticationError as exc:
            log.warning("closing device %d's connection: %s", token.device_id, exc)
            await link.aclose(str(exc))
            return


def _prometheus(node: Coordinator) -> tuple[bytes, str]:
    """``/metrics``' body and content type: ``node``'s own prometheus-client registry
    (`aiopipe.runtime.prometheus`, imported here: prometheus-client is not loaded at
    ``import aiopipe``)."""
    from aiopipe.runtime.prometheus import exposition

    return exposition(node)


# Note [device slots]
# ~~~~~~~~~~~~~~~~~~~
# `max_per_device` bounds the connections of one token's device that are past their
# hello: the device's live connection and the reconnection that takes it over (a hello
# with the session's secret retires the old one; one without it is refused as busy,
# [Note: a session is bound to its connection]), so a token buys at most that many
# plan-sized frame limits. A connection that has not said hello holds no slot: a stolen
# token whose connections never say hello cannot keep the device's reconnection out
# with HTTP 429. Such connections are strangers' to the guard: closed at
# `handshake_timeout` (the admission's own hello timeout where the routes are mounted
# on another app), at most `max_pending` of them with the oldest evicted, and each takes
# only hello-sized frames. Chosen over letting a newer connection evict the token's
# oldest silent one: a squatter reconnecting in a loop would then evict the honest
# device's own connection in the milliseconds between its upgrade and its hello. A slot
# is given back when its connection's handler ends, which for a broken connection is
# after its session's `reconnect_grace`: with `max_per_device` = 1 a device cannot
# reconnect within the grace, hence the default of 2.
