"""Peers authenticate each other on any `Endpoint`: `dial_peer` and `accept_peer`.

Each side proves that it holds the pair key the coordinator issued for the two of them
(`aiopipe.auth.pair_key`, whose docstring says why per-run pair keys, and how a proof
binds names, roles and nonces); only then is the link handed over. A device needs no
server secret, and learns only the keys of its own links.

[Note: the peer handshake] Three raw link frames, not aiopipe messages: codec frames
start with b"APW", these with b"APA" and a version byte, then a kind byte and a fixed
layout, every byte checked (`_decode`)::

    hello      dialer → listener  len(dialer) dialer len(listener) listener nonce_d[32]
    challenge  listener → dialer  nonce_l[32] proof_l[32]   (the dialer checks proof_l)
    proof      dialer → listener  proof_d[32]               (the listener checks proof_d)
    refusal    either way         a reason code[1], instead of its next frame

Each side's fresh nonce makes the other's proof good for this handshake only, so a
recorded transcript replays to nothing. A refusal carries a code, never free text: each
side logs and raises only its own words, and a remote name is checked to be a node name
(printable ASCII) before it is quoted; keys, nonces and proofs are never shown. Frames
before the handshake ends are bounded by the endpoint: a websocket endpoint's incoming
link takes only handshake-sized frames (``hello_frame_bytes`` of its `ConnectionLimits`,
1 KiB by default) until `accept_peer` admits it (`GuardedLink.admit`), and only then
the link's own ``max_frame_bytes``; its connection is also closed if it is not admitted
within ``handshake_timeout`` of its TCP accept, or when it is the oldest of more than
``max_pending`` strangers, and a peer may hold at most ``max_per_device`` admitted
links at once (aiopipe/transport/guard.py, [Note: bounded before authentication]). A
memory endpoint's links keep their fabric's limit. The handshake's frames count in the
link's statistics.

[Note: a dial that is turned away] A listener under a flood may turn an honest dial
away: HTTP 503 (its accept queue is full), a reset (the guard closed the connection as
the oldest stranger), a link closed during the handshake (`turned_away` tells these
apart). `dial_peer` then tries again, after 0.1 s, 0.2 s, ... (doubling, at most 2 s,
with jitter, on the injected clock), until the handshake is done or its ``timeout`` is
spent. A refusal by the listener or a wrong proof is final (trying again would not
change the answer), and so is a dial that reaches nobody or a wrong path (nothing
listens there: a peer that is gone is reported at once, as before, for the runtime to
recover from).

[Note: paused handshakes] `accept_peer` runs every pending handshake of its endpoint at
once (a silent connection costs its timeout, and honest peers are admitted meanwhile)
inside its own call, and leaves no task behind when it returns. Handshakes still under
way then are paused, not dropped: their state (the link, its deadline, where it stands)
is kept for the endpoint, and the next `accept_peer` on it resumes them, so peers that
dial at once are all admitted by successive calls. A paused receive loses no frame (the
Link contract). At most `MAX_HANDSHAKES` run at once: a flood of silent connections
waits in the endpoint's accept queue (and beyond a websocket endpoint's backlog, is
refused with HTTP 503; its guard closes the oldest beyond ``max_pending`` and each at its
``handshake_timeout``) instead of growing the listener without bound. Refused links
close concurrently; those still closing when `accept_peer` returns are dropped at once
(a websocket's connection is aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiopipe.auth import (
    MIN_SECRET_BYTES,
    PEER_NONCE_BYTES,
    PEER_PROOF_BYTES,
    check_node_name,
    check_peer_proof,
    peer_proof,
)
from aiopipe.clock import Clock, wait_for
from aiopipe.errors import (
    AiopipeError,
    AuthenticationError,
    ConfigError,
    LinkBrokenError,
    LinkClosedError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
)
from aiopipe.transport.base import Link
from aiopipe.transport.fabric import Endpoint
from aiopipe.transport.guard import GuardedLink
from aiopipe.transport.network import LinkSpec
from aiopipe.transport.websocket import turned_away

__all__ = ["MAX_HANDSHAKES", "accept_peer", "dial_peer"]

#: At most this many handshakes of one `accept_peer` call are under way at once; more
#: connections wait in the endpoint's accept queue (a websocket endpoint's ``backlog``).
MAX_HANDSHAKES = 64

log = logging.getLogger("aiopipe.peering")

#: A turned-away dial tries again after this many seconds, doubling up to `_RETRY_MAX_S`
#: ([Note: a dial that is turned away]).
_RETRY_FIRST_S = 0.1
_RETRY_MAX_S = 2.0


_MAGIC = b"APA\x01"  # + a kind byte
_HELLO, _CHALLENGE, _PROOF, _REFUSE = 1, 2, 3, 4
_KINDS = {_HELLO: "hello", _CHALLENGE: "challenge", _PROOF: "proof", _REFUSE: "refusal"}
_BODY_BYTES = {_CHALLENGE: PEER_NONCE_BYTES + PEER_PROOF_BYTES, _PROOF: PEER_PROOF_BYTES,
               _REFUSE: 1}
_NOT_A_PEER, _NOT_ME, _WRONG_PROOF = 1, 2, 3
_REFUSALS = {
    _NOT_A_PEER: "it has no key for us",
    _NOT_ME: "it is not the node we asked for",
    _WRONG_PROOF: "our proof was wrong (the two sides hold different keys for the pair)",
}


@dataclass(frozen=True, slots=True)
class _Hello:
    dialer: str
    listener: str
    nonce: bytes


@dataclass(frozen=True, slots=True)
class _Challenge:
    nonce: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class _Proof:
    proof: bytes


@dataclass(frozen=True, slots=True)
class _Refuse:
    code: int


_Frame = _Hello | _Challenge | _Proof | _Refuse


def _encode_hello(hello: _Hello) -> bytes:
    names = (hello.dialer.encode("ascii"), hello.listener.encode("ascii"))
    return _MAGIC + bytes([_HELLO]) + b"".join(bytes([len(n)]) + n for n in names) + hello.nonce


def _encode(kind: int, *parts: bytes) -> bytes:
    return _MAGIC + bytes([kind]) + b"".join(parts)


def _decode(frame: bytes) -> _Frame:
    """The handshake frame ``frame`` holds.

    Raises:
        RemoteProtocolError: it is not one, or not exactly as laid out (one line that
            quotes none of its bytes).
    """
    if len(frame) < len(_MAGIC) + 1 or frame[:3] != _MAGIC[:3]:
        raise RemoteProtocolError(f"not a peer handshake frame ({len(frame)} bytes)")
    if frame[3] != _MAGIC[3]:
        raise RemoteProtocolError(f"peer handshake version {frame[3]} is not {_MAGIC[3]}")
    kind, body = frame[4], frame[5:]
    if kind not in _KINDS:
        raise RemoteProtocolError(f"unknown peer handshake frame kind {kind}")
    if kind == _HELLO:
        return _decode_hello(body)
    if len(body) != _BODY_BYTES[kind]:
        raise RemoteProtocolError(
            f"a {_KINDS[kind]} of {len(frame)} bytes, not {len(_MAGIC) + 1 + _BODY_BYTES[kind]}")
    if kind == _CHALLENGE:
        return _Challenge(body[:PEER_NONCE_BYTES], body[PEER_NONCE_BYTES:])
    if kind == _PROOF:
        return _Proof(body)
    if body[0] not in _REFUSALS:
        raise RemoteProtocolError(f"a refusal with the unknown reason code {body[0]}")
    return _Refuse(body[0])


def _decode_hello(body: bytes) -> _Hello:
    names: list[str] = []
    at = 0
    for role in ("dialer", "listener"):
        size = body[at] if at < len(body) else 0
        raw = body[at + 1:at + 1 + size]
        at += 1 + size
        try:
            if len(raw) != size:
                raise ValueError
            names.append(check_node_name(raw.decode("ascii")))
        except (ValueError, ConfigError):
            raise RemoteProtocolError(f"a hello whose {role} name is not a node name") from None
    if len(body) - at != PEER_NONCE_BYTES:
        raise RemoteProtocolError(f"a hello of {len(body) + len(_MAGIC) + 1} bytes, not "
                                  f"{at + len(_MAGIC) + 1 + PEER_NONCE_BYTES}")
    return _Hello(names[0], names[1], body[at:])


def _describe(message: _Frame) -> str:
    kind = {_Hello: _HELLO, _Challenge: _CHALLENGE, _Proof: _PROOF, _Refuse: _REFUSE}
    return _KINDS[kind[type(message)]]


def _check_peering(me: str, keys: Mapping[str, bytes], timeout: float) -> dict[str, bytes]:
    check_node_name(me)
    if not isinstance(keys, Mapping) or not keys:
        raise ConfigError("keys must be a non-empty mapping of peer names to pair keys")
    checked: dict[str, bytes] = {}
    for peer, key in keys.items():
        if check_node_name(peer) == me:
            raise ConfigError(f"{me!r} cannot be its own peer")
        if not isinstance(key, bytes | bytearray) or len(key) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the key for peer {peer!r} must be at least {MIN_SECRET_BYTES} bytes "
                "(aiopipe.auth.pair_key makes one)")
        checked[peer] = bytes(key)
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not math.isfinite(timeout) or timeout <= 0):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return checked


@contextlib.asynccontextmanager
async def dial_peer(
    endpoint: Endpoint,
    address: str,
    *,
    me: str,
    peer: str,
    key: bytes,
    clock: Clock,
    timeout: float = 10.0,  # noqa: ASYNC109 - seconds on the injected clock
    shaping: LinkSpec | None = None,
) -> AsyncIterator[Link]:
    """Dial ``peer`` at ``address`` from ``endpoint`` as ``me``; the two prove they hold
    ``key`` (their `aiopipe.auth.pair_key`); yields the link and closes it on exit.

    Connecting and the handshake together get ``timeout`` seconds on ``clock``, every
    try included: a dial the listener turns away (HTTP 503, a reset, a link broken
    during the handshake) is tried again with backoff
    ([Note: a dial that is turned away]). ``shaping``: as the endpoint's ``dial``.

    Raises:
        AuthenticationError: the listener's proof is wrong (it holds another key, or is
            not ``peer``), or it refused us (it has no key for ``me``, or is not ``peer``).
        LinkBrokenError: nothing listens at ``address``, or it kept turning us away and
            the handshake did not finish within ``timeout`` (the message says why the
            last try failed).
        RemoteProtocolError: the listener sent something other than the handshake.
        ConfigError: an invalid name, key, timeout or address.
    """
    key = _check_peering(me, {peer: key}, timeout)[peer]
    async with contextlib.AsyncExitStack() as stack:
        failures: list[_TryAgain] = []

        async def connect() -> Link:
            delay = _RETRY_FIRST_S
            while True:
                try:
                    return await _dial_once(stack, endpoint, address, me, peer, key, shaping)
                except _TryAgain as exc:
                    failures.append(exc)
                    if len(failures) == 1:
                        log.info("%s: %s; trying again within %g s", me, exc, timeout)
                await clock.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, _RETRY_MAX_S)

        try:
            link = await wait_for(clock, connect(), timeout)
        except TimeoutError:
            last = f" ({len(failures)} tries; the last: {failures[-1]})" if failures else ""
            raise LinkBrokenError(f"no peer handshake with {peer} at {address} within "
                                  f"{timeout:g} s{last}") from None
        yield link


class _TryAgain(LinkBrokenError):
    """A try of `dial_peer` was turned away ([Note: a dial that is turned away])."""


async def _dial_once(stack: contextlib.AsyncExitStack, endpoint: Endpoint, address: str,
                     me: str, peer: str, key: bytes, shaping: LinkSpec | None) -> Link:
    """One try of `dial_peer`: the link, once the handshake on it is done; it closes when
    ``stack`` does.

    Raises:
        _TryAgain: the listener turned the dial away, or the link broke during the
            handshake (the link of this try is closed: another try may follow).
        LinkBrokenError: the listener cannot be reached (nothing listens there).
        AuthenticationError, RemoteProtocolError, ConfigError: as `dial_peer`.
    """
    async with contextlib.AsyncExitStack() as attempt:
        try:
            link = await attempt.enter_async_context(endpoint.dial(address, shaping=shaping))
        except LinkBrokenError as exc:
            if turned_away(exc):
                raise _TryAgain(str(exc)) from None
            raise
        try:
            await _dialer_handshake(link, me, peer, key)
        except ProtocolError as exc:
            await link.aclose(f"refused: {exc}")
            raise RemoteProtocolError(f"{peer} at {address}: {exc}") from None
        except AuthenticationError as exc:
            await link.aclose(f"refused: {exc}")
            raise AuthenticationError(f"{peer} at {address}: {exc}") from None
        except LinkBrokenError as exc:
            raise _TryAgain(f"peer handshake with {peer} at {address}: {exc}") from None
        stack.push_async_exit(attempt.pop_all())
        return link


async def _dialer_handshake(link: Link, me: str, peer: str, key: bytes) -> None:
    hello = _Hello(me, peer, secrets.token_bytes(PEER_NONCE_BYTES))
    await link.send(_encode_hello(hello))
    reply = _decode(await link.receive())
    if isinstance(reply, _Refuse):
        raise AuthenticationError(f"it refused {me}: {_REFUSALS[reply.code]}")
    if not isinstance(reply, _Challenge):
        raise RemoteProtocolError(f"a {_describe(reply)} where a challenge was due")
    try:
        check_peer_proof(key, "listener", me, peer, hello.nonce, reply.nonce, reply.proof)
    except AuthenticationError:
        with contextlib.suppress(AiopipeError):
            await link.send(_encode(_REFUSE, bytes([_WRONG_PROOF])))
        raise
    await link.send(_encode(_PROOF, peer_proof(key, "dialer", me, peer, hello.nonce,
                                               reply.nonce)))


@dataclass(eq=False)
class _Handshake:
    """One incoming link's handshake in progress ([Note: paused handshakes])."""

    link: Link
    deadline: float
    hello: _Hello | None = None  # set once its challenge went out
    nonce: bytes = b""  # the challenge's
    receiving: asyncio.Task[bytes] | None = field(default=None, repr=False)


async def accept_peer(
    endpoint: Endpoint,
    *,
    me: str,
    keys: Mapping[str, bytes],
    clock: Clock,
    timeout: float = 10.0,  # noqa: ASYNC109 - seconds on the injected clock
) -> tuple[str, Link]:
    """The next incoming link of ``endpoint`` that proves to be one of ``keys``' peers
    (name → pair key), as ``(peer name, link)``; the caller owns and closes the link.

    Every pending handshake runs at once; a link that fails (an unknown dialer, another
    listener's name, a wrong proof, a malformed frame, no handshake within ``timeout``
    seconds on ``clock``) is closed with a one-line reason and logged at WARNING, and the
    wait goes on. Handshakes under way when this returns go on at the next call
    ([Note: paused handshakes]).

    Raises:
        LinkClosedError: the endpoint is closed.
        ConfigError: an invalid name, key or timeout.
    """
    keys = _check_peering(me, keys, timeout)
    handshakes = _take_paused(endpoint)
    closing: set[asyncio.Future[Any]] = set()  # refused links' closes, cancelled receives
    accepting: asyncio.Task[Link] | None = None
    stepping: _Handshake | None = None  # one whose step was under way
    ended = False  # the endpoint closed: nothing to resume
    try:
        while True:
            if accepting is None and len(handshakes) < MAX_HANDSHAKES:
                accepting = asyncio.ensure_future(endpoint.accept())
            for handshake in handshakes:
                if handshake.receiving is None:
                    handshake.receiving = asyncio.ensure_future(handshake.link.receive())
            waits: set[asyncio.Future[Any]] = {*closing}
            waits.update(a.receiving for a in handshakes if a.receiving is not None)
            if accepting is not None:
                waits.add(accepting)
            await _wait_until(clock, waits, min((a.deadline for a in handshakes), default=None))
            closing = {task for task in closing if not task.done()}
            if accepting is not None and accepting.done():
                try:
                    handshakes.append(_Handshake(accepting.result(), clock.now() + timeout))
                except LinkClosedError:
                    ended = True
                    raise
                accepting = None
            ready = [(a, task) for a in handshakes
                     if (task := a.receiving) is not None and task.done()]
            for handshake, received in ready:
                handshakes.remove(handshake)
                handshake.receiving = None
                stepping = handshake
                try:
                    name = await _step(handshake, received, me, keys)
                except AiopipeError as exc:
                    stepping = None
                    closing.add(_refuse(handshake.link, me, str(exc),
                                        lost=isinstance(exc, TransportError)))
                    continue
                stepping = None
                if name is not None:
                    return name, handshake.link
                handshakes.append(handshake)
            for late in [a for a in handshakes if a.deadline <= clock.now()]:
                handshakes.remove(late)
                if late.receiving is not None:
                    late.receiving.cancel()
                    closing.add(late.receiving)
                closing.add(_refuse(late.link, me, f"no peer handshake within {timeout:g} s"))
    finally:
        if stepping is not None:  # cut short halfway: where it stands is unknown
            closing.add(asyncio.ensure_future(stepping.link.aclose("the listener stopped")))
        handshakes += await _stop(clock, accepting, closing, handshakes, clock.now() + timeout)
        if not ended:
            handshakes = _keep_paused(endpoint, handshakes)
        await asyncio.gather(*(a.link.aclose("the listener stopped") for a in handshakes))


async def _step(handshake: _Handshake, received: asyncio.Task[bytes], me: str,
                keys: Mapping[str, bytes]) -> str | None:
    """Take the frame ``handshake`` ``received``: the peer's name once it is admitted.

    Raises:
        AiopipeError: the link is refused (the message says why).
    """
    message = _decode(received.result())
    hello = handshake.hello
    if hello is None:
        if not isinstance(message, _Hello):
            raise RemoteProtocolError(f"a {_describe(message)} where a hello was due")
        if message.listener != me or message.dialer not in keys:
            mismatch = message.listener != me
            with contextlib.suppress(AiopipeError):
                await handshake.link.send(
                    _encode(_REFUSE, bytes([_NOT_ME if mismatch else _NOT_A_PEER])))
            raise AuthenticationError(
                f"dialer {message.dialer} asked for {message.listener}" if mismatch
                else f"dialer {message.dialer} is not a peer of {me}")
        nonce = secrets.token_bytes(PEER_NONCE_BYTES)
        proof = peer_proof(keys[message.dialer], "listener", message.dialer, me,
                           message.nonce, nonce)
        await handshake.link.send(_encode(_CHALLENGE, nonce, proof))
        handshake.hello, handshake.nonce = message, nonce
        return None
    if isinstance(message, _Refuse):
        raise AuthenticationError(
            f"dialer {hello.dialer} refused us: {_REFUSALS[message.code]}")
    if not isinstance(message, _Proof):
        raise RemoteProtocolError(
            f"a {_describe(message)} from {hello.dialer} where a proof was due")
    if hello.dialer not in keys:  # resumed by a call with other keys
        raise AuthenticationError(f"dialer {hello.dialer} is not a peer of {me}")
    check_peer_proof(keys[hello.dialer], "dialer", hello.dialer, me, hello.nonce,
                     handshake.nonce, message.proof)
    if isinstance(handshake.link, GuardedLink):  # its endpoint's bounds end here
        handshake.link.admit(hello.dialer)
    return hello.dialer


def _refuse(link: Link, me: str, reason: str, *, lost: bool = False) -> asyncio.Task[None]:
    """Close ``link`` for ``reason`` (logged: a warning, or only a debug line when its
    connection was ``lost``: under a flood the guard closes strangers by the hundred,
    and says so itself)."""
    log.log(logging.DEBUG if lost else logging.WARNING, "%s refused a peer link: %s", me,
            reason)
    return asyncio.ensure_future(link.aclose(f"refused: {reason}"))


async def _wait_until(clock: Clock, waits: set[asyncio.Future[Any]],
                      deadline: float | None) -> None:
    """Wait until one of ``waits`` is done or ``clock`` reaches ``deadline``."""
    timer = None
    if deadline is not None:
        timer = asyncio.ensure_future(clock.sleep(deadline - clock.now()))
        waits = waits | {timer}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if timer is not None:
            timer.cancel()
            await asyncio.wait({timer})


async def _stop(clock: Clock, accepting: asyncio.Task[Link] | None,
                closing: set[asyncio.Future[Any]], handshakes: list[_Handshake],
                deadline: float) -> list[_Handshake]:
    """Cancel and reap what `accept_peer` started; a link accepted meanwhile, as a new
    handshake ([Note: paused handshakes]). Closes just started get to begin first: a
    closing link is then dropped at once (a websocket: aborted), not left open. Should
    this be cancelled too, what it started is still cancelled and its errors reaped."""
    started: list[asyncio.Future[Any]] = [a.receiving for a in handshakes
                                          if a.receiving is not None]
    if accepting is not None:
        started.append(accepting)
    for task in started:  # first, before any await: nothing is left running
        task.cancel()
        task.add_done_callback(_reap)
    await clock.sleep(0)
    tasks: list[asyncio.Future[Any]] = [*closing, *started]
    for closing_task in closing:
        closing_task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:  # retrieved, so asyncio does not log them as lost
        if not task.cancelled():
            task.exception()
    for handshake in handshakes:
        if handshake.receiving is not None and handshake.receiving.cancelled():
            handshake.receiving = None  # resumed by a new receive: no frame was lost
    if accepting is None or accepting.cancelled() or accepting.exception() is not None:
        return []
    return [_Handshake(accepting.result(), deadline)]


def _reap(task: asyncio.Future[Any]) -> None:
    """Retrieve ``task``'s error, so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


_paused: weakref.WeakKeyDictionary[Endpoint, list[_Handshake]] = weakref.WeakKeyDictionary()


def _take_paused(endpoint: Endpoint) -> list[_Handshake]:
    try:
        return _paused.pop(endpoint, [])
    except TypeError:  # not weakly referenceable: nothing was kept for it
        return []


def _keep_paused(endpoint: Endpoint, handshakes: list[_Handshake]) -> list[_Handshake]:
    """Keep ``handshakes`` for the next `accept_peer` on ``endpoint``; those it cannot
    keep (the endpoint is not weakly referenceable)."""
    if not handshakes:
        return []
    try:
        _paused.setdefault(endpoint, []).extend(handshakes)
    except TypeError:
        return handshakes
    return []
