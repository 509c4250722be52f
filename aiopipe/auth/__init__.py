"""Credentials: per-device tokens and TLS contexts (stdlib only, no I/O but reading files).

A device token binds one device id to the server's secret::

    v1.<device_id>.<base64url(HMAC-SHA256(secret, b"aiopipe-device:" + id))>

The server keeps only the secret; it recomputes the MAC of the id a token names and
compares it in constant time, so it needs no list of tokens, and a token for device 1
cannot be turned into one for device 0. A device sends its token as
``Authorization: Bearer <token>`` at the websocket handshake; the server then admits that
connection for that one id only.

``python -m aiopipe.auth secret`` prints a new random secret; ``python -m aiopipe.auth
mint --secret VALUE|file:PATH --device-id K`` prints device K's token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
import ssl
from pathlib import Path

from aiopipe.errors import AuthenticationError, ConfigError

__all__ = [
    "MIN_SECRET_BYTES",
    "TOKEN_VERSION",
    "authenticate_bearer",
    "check_secret",
    "client_ssl_context",
    "generate_secret",
    "load_secret",
    "mint_token",
    "server_ssl_context",
    "verify_token",
]

TOKEN_VERSION = "v1"
MIN_SECRET_BYTES = 16
_DOMAIN = b"aiopipe-device:"  # keeps these MACs apart from any other use of the secret
_MAX_ID_DIGITS = 10
_MAC_CHARS = 43  # 32 bytes of SHA-256, base64url without padding
_MAC = re.compile(rf"[A-Za-z0-9_-]{{{_MAC_CHARS}}}")


def check_secret(secret: bytes) -> bytes:
    """``secret`` as bytes once it is long enough to sign device tokens.

    Raises:
        ConfigError: it is not bytes, or shorter than `MIN_SECRET_BYTES`.
    """
    if not isinstance(secret, bytes | bytearray):
        raise ConfigError(f"a token secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the token secret has {len(secret)} bytes; at least "
            f"{MIN_SECRET_BYTES} are needed (python -m aiopipe.auth secret "
            "makes one)"
        )
    return bytes(secret)


def _mac(secret: bytes, device_id: int) -> str:
    digest = hmac.digest(secret, _DOMAIN + str(device_id).encode("ascii"), hashlib.sha256)
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


def mint_token(secret: bytes, device_id: int) -> str:
    """Device ``device_id``'s token under ``secret`` (URL-safe ASCII, no padding).

    Raises:
        ConfigError: the secret is too short, or the id is not a non-negative int.
    """
    secret = check_secret(secret)
    device_id = _check_device_id(device_id)
    return f"{TOKEN_VERSION}.{device_id}.{_mac(secret, device_id)}"


def verify_token(secret: bytes, token: str) -> int:
    """The device id ``token`` was minted for under ``secret``.

    The MAC is compared in constant time. Error messages never quote the token.

    Raises:
        AuthenticationError: the token is malformed, of another version, or its MAC is
            not the secret's (one line saying which).
        ConfigError: the secret is too short.
    """
    secret = check_secret(secret)
    if not isinstance(token, str) or token.count(".") != 2:
        raise AuthenticationError("malformed token: expected v1.<device id>.<mac>")
    version, id_text, mac = token.split(".")
    if version != TOKEN_VERSION:
        shown = version if re.fullmatch(r"v\d{1,4}", version) else "unknown"
        raise AuthenticationError(f"token version {shown} is not {TOKEN_VERSION}")
    if (
        not id_text.isascii()
        or not id_text.isdigit()
        or len(id_text) > _MAX_ID_DIGITS
        or str(int(id_text)) != id_text
    ):
        raise AuthenticationError("malformed token: the device id is not a plain decimal")
    if not _MAC.fullmatch(mac):
        raise AuthenticationError(
            f"malformed token: the mac is not {_MAC_CHARS} base64url characters"
        )
    device_id = int(id_text)
    if not hmac.compare_digest(mac.encode("ascii"), _mac(secret, device_id).encode("ascii")):
        raise AuthenticationError(
            f"token for device {device_id} has a bad mac (minted with another secret, or altered)"
        )
    return device_id


def authenticate_bearer(authorization: str | None, secret: bytes) -> int:
    """The device id that an HTTP ``Authorization`` header's bearer token was minted for.

    Raises:
        AuthenticationError: no ``Bearer`` token, or one `verify_token` refuses.
        ConfigError: the secret is too short.
    """
    if not authorization:
        raise AuthenticationError("no device token (send Authorization: Bearer <token>)")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("the Authorization header is not 'Bearer <token>'")
    return verify_token(secret, token.strip())


def generate_secret() -> str:
    """A new random secret: 32 bytes of entropy as 43 URL-safe characters."""
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
