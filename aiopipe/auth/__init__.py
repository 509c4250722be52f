"""Credentials: device tokens, peer pair keys and TLS contexts (stdlib only, no I/O but
reading files).

Device tokens (`aiopipe.auth.tokens`) bind one device id, an expiry and a token id to the
server's secret by HMAC; the server keeps only the secret (and, optionally, a file of
revoked token ids). A device sends its token as ``Authorization: Bearer <token>`` at the
websocket handshake; the server then admits that connection for that one id only.

A refused token's reason reaches the device in the server's HTTP 401 (RFC 6750's
``WWW-Authenticate: Bearer error=..., error_description=...``), and the device says it
with what to do (`aiopipe.auth.refusals`). A token secret is ``bytes`` or a ``str``
(UTF-8), so `generate_secret`'s string works wherever a secret is taken.

``python -m aiopipe.auth secret`` prints a new random secret; ``python -m aiopipe.auth
mint --secret VALUE|file:PATH --device-id K`` prints a token for device K; ``python -m
aiopipe.auth revoke --file FILE --token TOKEN`` withdraws one.

Peer pair keys: how two nodes (a device and the next stage's device) authenticate each
other without the server's secret. The coordinator draws a run secret
(`new_run_secret`) for one run; the key of the pair {a, b} is::

    HMAC-SHA256(run_secret, b"aiopipe-pair:" + min(a, b) + b"\\0" + max(a, b))

(`pair_key`; node names as UTF-8, sorted, so both directions share one key). The
coordinator hands node a the keys of exactly the peers its plan links it to, over a's
already authenticated link to the coordinator. Why this scheme: a device never holds the
server's token secret (a device that did could mint every device's token); a device
learns only the keys of its own links, so a captured device can impersonate no one but
itself towards its own neighbours; keys die with the run (a new run secret, new keys);
and it is symmetric and stdlib-only (no certificates, no new dependency). Public-key
identities would let nodes meet without the coordinator, but every run has one anyway.

Two nodes prove to each other that they hold their pair's key by challenge and response
(`peer_proof`, `check_peer_proof`; the handshake itself is in
`aiopipe.transport.peering`): each side sends a fresh random nonce, and each proves the
key by a MAC over both nonces, both names and its role. The other side's nonce makes a
proof good for one handshake only (replay-proof); the role makes the listener's proof
useless as a dialer's (no reflection); the names bind it to this pair and direction.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import ssl
from pathlib import Path
from typing import Literal

from aiopipe.auth.refusals import bearer_challenge, explain_refusal
from aiopipe.auth.tokens import (
    DEFAULT_TOKEN_LIFETIME_S,
    MIN_SECRET_BYTES,
    REFUSAL_REASONS,
    TOKEN_VERSION,
    Revocations,
    Token,
    TokenRefused,
    authenticate_bearer,
    check_secret,
    mint_token,
    token_id_of,
    unverified_token,
    verify_token,
)
from aiopipe.errors import AuthenticationError, ConfigError

__all__ = [
    "DEFAULT_TOKEN_LIFETIME_S",
    "MAX_NODE_NAME_BYTES",
    "MIN_SECRET_BYTES",
    "PEER_NONCE_BYTES",
    "PEER_PROOF_BYTES",
    "REFUSAL_REASONS",
    "TOKEN_VERSION",
    "PeerRole",
    "Revocations",
    "Token",
    "TokenRefused",
    "authenticate_bearer",
    "bearer_challenge",
    "check_node_name",
    "check_peer_proof",
    "check_secret",
    "client_ssl_context",
    "explain_refusal",
    "generate_secret",
    "load_secret",
    "mint_token",
    "new_run_secret",
    "pair_key",
    "peer_proof",
    "server_ssl_context",
    "token_id_of",
    "unverified_token",
    "verify_token",
]


def generate_secret() -> str:
    """A new random secret: 32 bytes of entropy as 43 URL-safe characters.

    A ``str``, which every function that takes a token secret accepts as is (its UTF-8
    bytes, as `load_secret` reads it), e.g. ``Server(config, token_secret=s)`` and
    ``mint_token(s, k)``.
    """
    return secrets.token_urlsafe(32)


def load_secret(value: str) -> bytes:
    """The token secret that ``value`` gives.

    ``file:PATH`` (or a value naming an existing file) reads the secret from that file,
    less surrounding whitespace; any other value is the secret itself, UTF-8 encoded. A
    value that looks like a path (it holds a path separator) but names no file is refused
    rather than taken as a guessable literal.

    Raises:
        ConfigError: the file cannot be read, the path names no file, or the secret is
            shorter than `MIN_SECRET_BYTES`.
    """
    if not isinstance(value, str):
        raise ConfigError(f"a token secret must be given as a string, got {type(value).__name__}")
    path: str | None = None
    if value.startswith("file:"):
        path = value.removeprefix("file:")
    elif os.path.isfile(value):
        path = value
    elif os.sep in value or (os.altsep is not None and os.altsep in value):
        raise ConfigError(  # not quoted: it may be a literal secret after all
            "the token secret looks like a path but names no file (use file:PATH for a file; "
            "a literal secret holds no path separator)"
        )
    if path is None:
        return check_secret(value.encode("utf-8"))
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token secret file {path}: {exc.strerror or exc}") from None
    if not data:
        raise ConfigError(f"token secret file {path} is empty")
    try:
        return check_secret(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def server_ssl_context(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 or later) serving ``cert`` (PEM chain) with ``key``.

    Raises:
        ConfigError: a file cannot be read, or the key does not match the certificate.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ConfigError(f"cannot read TLS file {exc.filename}: no such file") from None
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load TLS certificate {cert} with key {key}: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None
    return context


def client_ssl_context(ca: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """A TLS client context that verifies the server's certificate and host name.

    ``ca``: a PEM file of the certificate authorities to trust (a self-signed server
    certificate is its own); None trusts the system's.

    Raises:
        ConfigError: the CA file cannot be read or holds no certificate.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except FileNotFoundError:
            raise ConfigError(f"cannot read TLS CA file {ca}: no such file") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load TLS CA file {ca}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
    return context


# -- peer pair keys -------------------------------------------------------------------------

#: The longest node name, in bytes (names are printable ASCII: one byte per character).
MAX_NODE_NAME_BYTES = 64
#: The size of each side's handshake nonce.
PEER_NONCE_BYTES = 32
#: The size of a peer proof (HMAC-SHA256).
PEER_PROOF_BYTES = 32

PeerRole = Literal["dialer", "listener"]

_RUN_SECRET_BYTES = 32
_PAIR_DOMAIN = b"aiopipe-pair:"
_PROOF_DOMAIN = b"aiopipe-peer-proof:v1\0"
_NODE_NAME = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_NODE_NAME_BYTES}}}")
_ROLES: tuple[PeerRole, ...] = ("dialer", "listener")


def check_node_name(name: str) -> str:
    """``name`` once it is a valid node name: 1 to `MAX_NODE_NAME_BYTES` letters, digits
    or ``-_.:`` (printable ASCII, so no separator or control byte can hide in it).

    Raises:
        ConfigError: it is not a str, is empty, too long or holds another character.
    """
    if not isinstance(name, str):
        raise ConfigError(f"a node name must be a str, got {type(name).__name__}")
    if not _NODE_NAME.fullmatch(name):
        shown = repr(name) if len(name) <= MAX_NODE_NAME_BYTES else f"{len(name)} characters"
        raise ConfigError(
            f"a node name must be 1..{MAX_NODE_NAME_BYTES} letters, digits or -_.:, got {shown}"
        )
    return name


def new_run_secret() -> bytes:
    """A new random run secret (32 bytes from `secrets`) from which `pair_key` derives the
    keys of one run's peer links. The coordinator keeps it; nodes never see it."""
    return secrets.token_bytes(_RUN_SECRET_BYTES)


def pair_key(run_secret: bytes, a: str, b: str) -> bytes:
    """The key the nodes ``a`` and ``b`` share in the run of ``run_secret`` (32 bytes).

    ``pair_key(s, a, b) == pair_key(s, b, a)``: the names are sorted first.

    Raises:
        ConfigError: ``a == b``, a name that `check_node_name` refuses, or a run secret
            that is not bytes of at least `MIN_SECRET_BYTES` bytes.
    """
    if not isinstance(run_secret, bytes | bytearray) or len(run_secret) < MIN_SECRET_BYTES:
        shown = (f"{len(run_secret)} bytes" if isinstance(run_secret, bytes | bytearray)
                 else type(run_secret).__name__)
        raise ConfigError(
            f"a run secret must be at least {MIN_SECRET_BYTES} bytes, got {shown} "
            "(new_run_secret() makes one)"
        )
    first, second = sorted((check_node_name(a), check_node_name(b)))
    if first == second:
        raise ConfigError(f"a pair key needs two different nodes, got {a!r} twice")
    message = _PAIR_DOMAIN + first.encode("ascii") + b"\0" + second.encode("ascii")
    return hmac.digest(bytes(run_secret), message, hashlib.sha256)


def peer_proof(
    key: bytes,
    role: PeerRole,
    dialer: str,
    listener: str,
    dialer_nonce: bytes,
    listener_nonce: bytes,
) -> bytes:
    """The proof that the ``role`` side of the link ``dialer`` → ``listener`` holds ``key``.

    HMAC-SHA256 under ``key`` of a domain tag followed by the role, both names and both
    nonces, each prefixed by its length (so no two different inputs encode alike).

    Raises:
        ConfigError: a key shorter than `MIN_SECRET_BYTES`, an unknown role, a name that
            `check_node_name` refuses, equal names, or a nonce that is not
            `PEER_NONCE_BYTES` bytes.
    """
    if not isinstance(key, bytes | bytearray) or len(key) < MIN_SECRET_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ConfigError(f"a pair key must be at least {MIN_SECRET_BYTES} bytes, got {shown}")
    if role not in _ROLES:
        raise ConfigError(f"a peer role is 'dialer' or 'listener', got {role!r}")
    if check_node_name(dialer) == check_node_name(listener):
        raise ConfigError(f"a peer link needs two different nodes, got {dialer!r} twice")
    for label, nonce in (("dialer", dialer_nonce), ("listener", listener_nonce)):
        if not isinstance(nonce, bytes | bytearray) or len(nonce) != PEER_NONCE_BYTES:
            raise ConfigError(f"the {label}'s nonce must be {PEER_NONCE_BYTES} bytes")
    fields = (role.encode("ascii"), dialer.encode("ascii"), listener.encode("ascii"),
              bytes(dialer_nonce), bytes(listener_nonce))
    message = _PROOF_DOMAIN + b"".join(len(f).to_bytes(2, "big") + f for f in fields)
    return hmac.digest(bytes(key), message, hashlib.sha256)


def check_peer_proof(
    key: bytes,
    role: PeerRole,
    dialer: str,
    listener: str,
    dialer_nonce: bytes,
    listener_nonce: bytes,
    proof: bytes,
) -> None:
    """Check, in constant time, that ``proof`` is `peer_proof` of the other arguments.

    The message names the side and the link, never a key, nonce or proof.

    Raises:
        AuthenticationError: the proof is wrong (the ``role`` side holds another key for
            the pair, or is not who it claims to be).
        ConfigError: as `peer_proof`, or ``proof`` is not bytes.
    """
    expected = peer_proof(key, role, dialer, listener, dialer_nonce, listener_nonce)
    if not isinstance(proof, bytes | bytearray):
        raise ConfigError(f"a peer proof must be bytes, got {type(proof).__name__}")
    if not hmac.compare_digest(expected, bytes(proof)):
        name = dialer if role == "dialer" else listener
        raise AuthenticationError(
            f"the {role} {name} of the link {dialer} -> {listener} sent a wrong proof "
            f"(it holds another key for the pair, or is not {name})"
        )
