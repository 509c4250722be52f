"""Device tokens: minted from the server's secret, with an expiry and an id to revoke.

A device token binds one device id, an expiry and a random token id to the server's
secret::

    v2.<device_id>.<expires>.<token_id>.<mac>
    mac = base64url(HMAC-SHA256(secret, b"aiopipe-device:v2\\0" + id + b"\\0" + expires
                                + b"\\0" + token_id))

``expires`` is a Unix time in whole seconds (0: never); ``token_id`` is 16 base64url
characters (96 random bits). The server keeps only the secret: it recomputes the MAC of
what a token says and compares it in constant time, so it needs no list of tokens, a
token for device 1 cannot be turned into one for device 0, and an expiry cannot be moved.
To withdraw one token before it expires, its id goes into a revocation file
(`Revocations`; ``python -m aiopipe.auth revoke``) that the server reads whenever it
changes; the device's other tokens stay good.

Every refusal is a `TokenRefused` whose ``reason`` is one of a few fixed phrases
(`REFUSAL_REASONS`): the server sends it to the device in its HTTP 401
(`aiopipe.auth.refusals`), and a fixed phrase can quote nothing secret. Secrets are
``bytes``, or ``str`` taken as UTF-8 (what `generate_secret` prints).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from aiopipe.errors import AuthenticationError, ConfigError

__all__ = [
    "DEFAULT_TOKEN_LIFETIME_S",
    "MIN_SECRET_BYTES",
    "REFUSAL_REASONS",
    "TOKEN_VERSION",
    "Revocations",
    "Token",
    "TokenRefused",
    "authenticate_bearer",
    "check_secret",
    "mint_token",
    "unverified_token",
    "verify_token",
]

TOKEN_VERSION = "v2"
MIN_SECRET_BYTES = 16
#: How long a token is good for unless said otherwise: 30 days.
DEFAULT_TOKEN_LIFETIME_S = 30 * 24 * 3600.0
_DOMAIN = b"aiopipe-device:v2\0"  # keeps these MACs apart from any other use of the secret
_MAX_ID_DIGITS = 10
_MAX_EXPIRY_DIGITS = 12
_MAC_CHARS = 43  # 32 bytes of SHA-256, base64url without padding
_TOKEN_ID_CHARS = 16  # 12 random bytes
_MAC = re.compile(rf"[A-Za-z0-9_-]{{{_MAC_CHARS}}}")
_TOKEN_ID = re.compile(rf"[A-Za-z0-9_-]{{{_TOKEN_ID_CHARS}}}")
_SHAPE = "v2.<device id>.<expires>.<token id>.<mac>"

#: Why a token was refused, as the server tells the device (`TokenRefused.reason`): fixed
#: phrases of printable ASCII without quotes or backslashes, so that one is a valid
#: quoted-string in a ``WWW-Authenticate`` header and never carries the token or the
#: secret. ``"no token"`` is the one refusal that RFC 6750 sends without an error.
NO_TOKEN = "no token"
NOT_BEARER = "not a bearer token"
MALFORMED = "malformed"
OLD_VERSION = "old token version"
UNKNOWN_VERSION = "unknown token version"
WRONG_SECRET = "not minted under this server's secret"
EXPIRED = "expired"
REVOKED = "revoked"
REVOCATIONS_UNREADABLE = "revocation file unreadable"
REFUSAL_REASONS = (NO_TOKEN, NOT_BEARER, MALFORMED, OLD_VERSION, UNKNOWN_VERSION,
                   WRONG_SECRET, EXPIRED, REVOKED, REVOCATIONS_UNREADABLE)

Secret = str | bytes | bytearray


class TokenRefused(AuthenticationError):
    """A device token was refused; ``str()`` says why in one line for the server's log,
    ``reason`` in one of the fixed `REFUSAL_REASONS` for the device (never the token)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Token:
    """What a verified token says.

    Attributes:
        device_id: the one device it speaks for.
        token_id: its own id (what revoking it names).
        expires_at: Unix time after which it is refused (None: never).
    """

    device_id: int
    token_id: str
    expires_at: int | None


def check_secret(secret: Secret) -> bytes:
    """``secret`` as bytes once it is long enough to sign device tokens.

    A ``str`` (such as `aiopipe.auth.generate_secret`'s) is its UTF-8 bytes, as
    `aiopipe.auth.load_secret` reads a literal, so a secret works alike in either type.

    Raises:
        ConfigError: it is neither str nor bytes, or shorter than `MIN_SECRET_BYTES`.
    """
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes | bytearray):
        raise ConfigError(f"a token secret must be str or bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the token secret has {len(secret)} bytes; at least "
            f"{MIN_SECRET_BYTES} are needed (python -m aiopipe.auth secret "
            "makes one)"
        )
    return bytes(secret)


def _mac(secret: bytes, device_id: int, expires: int, token_id: str) -> str:
    message = _DOMAIN + f"{device_id}\0{expires}\0{token_id}".encode("ascii")
    digest = hmac.digest(secret, message, hashlib.sha256)
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _check_device_id(device_id: int) -> int:
    if (
        isinstance(device_id, bool)
        or not isinstance(device_id, int)
        or device_id < 0
        or len(str(device_id)) > _MAX_ID_DIGITS
    ):
        raise ConfigError(
            f"a device id must be an int in 0..{10**_MAX_ID_DIGITS - 1}, got {device_id!r}"
        )
    return device_id


def mint_token(secret: Secret, device_id: int, *,
               lifetime_s: float | None = DEFAULT_TOKEN_LIFETIME_S,
               now: float | None = None) -> str:
    """A new token for device ``device_id`` under ``secret`` (URL-safe ASCII), good for
    ``lifetime_s`` seconds from ``now`` (default: the time now; None: it never expires).
    Each call draws a new token id, so each token can be revoked on its own. ``secret``:
    bytes, or str as UTF-8 (`check_secret`).

    Raises:
        ConfigError: the secret is too short, the id is not a non-negative int, or the
            lifetime is not positive.
    """
    secret = check_secret(secret)
    device_id = _check_device_id(device_id)
    if lifetime_s is None:
        expires = 0
    elif isinstance(lifetime_s, bool) or not isinstance(lifetime_s, int | float) or not (
            0 < lifetime_s < 1e11):
        raise ConfigError(f"a token's lifetime must be > 0 s, got {lifetime_s!r}")
    else:
        expires = int((time.time() if now is None else now) + lifetime_s)
    token_id = secrets.token_urlsafe(12)
    return (f"{TOKEN_VERSION}.{device_id}.{expires}.{token_id}."
            f"{_mac(secret, device_id, expires, token_id)}")


def _plain_decimal(text: str, digits: int) -> bool:
    return (text.isascii() and text.isdigit() and len(text) <= digits
            and str(int(text)) == text)


def verify_token(secret: Secret, token: str, *, now: float | None = None) -> Token:
    """What ``token`` says, once its MAC is ``secret``'s (bytes, or str as UTF-8) and it
    has not expired at ``now`` (default: the time now). Revocation is the caller's
    (`Revocations.check`).

    The MAC is compared in constant time. Error messages never quote the token.

    Raises:
        TokenRefused: the token is malformed, of another version, its MAC is not the
            secret's, or it has expired (one line saying which, and its ``reason``).
        ConfigError: the secret is too short.
    """
    secret = check_secret(secret)
    if not isinstance(token, str) or not token.isascii() or token.count(".") not in (2, 4):
        raise TokenRefused(f"malformed token: expected {_SHAPE}", MALFORMED)
    version, *fields = token.split(".")
    if version != TOKEN_VERSION:
        shown = version if re.fullmatch(r"v\d{1,4}", version) else "unknown"
        hint = " (mint a new one: python -m aiopipe.auth mint)" if shown == "v1" else ""
        raise TokenRefused(f"token version {shown} is not {TOKEN_VERSION}{hint}",
                           OLD_VERSION if shown == "v1" else UNKNOWN_VERSION)
    if len(fields) != 4:
        raise TokenRefused(f"malformed token: expected {_SHAPE}", MALFORMED)
    id_text, expires_text, token_id, mac = fields
    if not _plain_decimal(id_text, _MAX_ID_DIGITS):
        raise TokenRefused("malformed token: the device id is not a plain decimal", MALFORMED)
    if not _plain_decimal(expires_text, _MAX_EXPIRY_DIGITS):
        raise TokenRefused("malformed token: the expiry is not a plain decimal", MALFORMED)
    if not _TOKEN_ID.fullmatch(token_id):
        raise TokenRefused(
            f"malformed token: the token id is not {_TOKEN_ID_CHARS} base64url characters",
            MALFORMED)
    if not _MAC.fullmatch(mac):
        raise TokenRefused(
            f"malformed token: the mac is not {_MAC_CHARS} base64url characters", MALFORMED)
    device_id, expires = int(id_text), int(expires_text)
    if not hmac.compare_digest(mac.encode("ascii"),
                               _mac(secret, device_id, expires, token_id).encode("ascii")):
        raise TokenRefused(
            f"token for device {device_id} has a bad mac (minted with another secret, or "
            "altered)", WRONG_SECRET)
    if expires and (time.time() if now is None else now) > expires:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
        raise TokenRefused(f"token {token_id} for device {device_id} expired at {when}",
                           EXPIRED)
    return Token(device_id, token_id, expires or None)


def authenticate_bearer(authorization: str | None, secret: Secret, *,
                        revocations: Revocations | None = None) -> Token:
    """What an HTTP ``Authorization`` header's bearer token says, once it is good under
    ``secret`` (bytes, or str as UTF-8).

    Raises:
        TokenRefused: no ``Bearer`` token, one `verify_token` refuses, or one that
            ``revocations`` lists.
        ConfigError: the secret is too short.
    """
    if not authorization:
        raise TokenRefused("no device token (send Authorization: Bearer <token>)", NO_TOKEN)
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise TokenRefused("the Authorization header is not 'Bearer <token>'", NOT_BEARER)
    verified = verify_token(secret, token.strip())
    if revocations is not None:
        revocations.check(verified)
    return verified


def unverified_token(token: str) -> Token | None:
    """What ``token`` says without checking its MAC (None: it is not shaped like one).

    For its holder only: a device reads its own token's id and expiry to explain a
    refusal; nothing it says is to be trusted until `verify_token` has checked it.
    """
    fields = token.strip().split(".") if isinstance(token, str) else []
    if (len(fields) != 5 or fields[0] != TOKEN_VERSION
            or not _plain_decimal(fields[1], _MAX_ID_DIGITS)
            or not _plain_decimal(fields[2], _MAX_EXPIRY_DIGITS)
            or not _TOKEN_ID.fullmatch(fields[3])):
        return None
    return Token(int(fields[1]), fields[3], int(fields[2]) or None)


def token_id_of(token: str) -> str:
    """The id of ``token`` without verifying it (what `revoke` writes down).

    Raises:
        ConfigError: it is not shaped like a token.
    """
    fields = token.strip().split(".") if isinstance(token, str) else []
    if len(fields) != 5 or fields[0] != TOKEN_VERSION or not _TOKEN_ID.fullmatch(fields[3]):
        raise ConfigError(f"not a token: expected {_SHAPE}")
    return fields[3]


class Revocations:
    """The token ids listed in a revocation file: one per line, ``#`` starts a comment.

    The file is read again whenever its modification time or size changes, so a token
    revoked while the server runs is refused from its next use; a file that does not
    exist (yet) revokes nothing.

    Raises:
        ConfigError: (at construction) the path is not a string or path.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(f"a revocation file must be a path, got {type(path).__name__}")
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None
        self._ids: frozenset[str] = frozenset()

    def ids(self) -> frozenset[str]:
        """The revoked token ids, as the file says now."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._seen, self._ids = None, frozenset()
            return self._ids
        except OSError as exc:  # unreadable: keep what we knew, and say so
            raise TokenRefused(f"cannot read the revocation file: {exc.strerror}",
                               REVOCATIONS_UNREADABLE) from None
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            try:
                text = self.path.read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                raise TokenRefused(f"cannot read the revocation file: {exc.strerror}",
                                   REVOCATIONS_UNREADABLE) from None
            self._ids = frozenset(
                word for line in text.splitlines()
                if (word := line.split("#", 1)[0].strip()))
            self._seen = (stat.st_mtime_ns, stat.st_size)
        return self._ids

    def check(self, token: Token) -> None:
        """Refuse ``token`` if it is revoked.

        Raises:
            TokenRefused: it is (one line naming its id and device), or the file cannot
                be read (refusing is the safe side).
        """
        if token.token_id in self.ids():
            raise TokenRefused(
                f"token {token.token_id} for device {token.device_id} was revoked", REVOKED)

    @staticmethod
    def add(path: str | os.PathLike[str], token_id: str, note: str = "") -> None:
        """Append ``token_id`` to the revocation file at ``path`` (made if missing), with a
        comment ``note``.

        Raises:
            ConfigError: the id is not a token id, or the file cannot be written.
        """
        if not isinstance(token_id, str) or not _TOKEN_ID.fullmatch(token_id):
            raise ConfigError(f"a token id is {_TOKEN_ID_CHARS} base64url characters")
        comment = f"  # {note}" if note else ""
        try:
            with open(path, "a", encoding="utf-8") as file:
                file.write(f"{token_id}{comment}\n")
        except OSError as exc:
            raise ConfigError(f"cannot write the revocation file {path}: {exc.strerror}") from None
