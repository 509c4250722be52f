"""Why the server refused a device, told to the device in RFC 6750's words.

The server's HTTP 401 at the ``/ws`` handshake carries its reason in the standard
challenge (`bearer_challenge`)::

    WWW-Authenticate: Bearer error="invalid_token", error_description="expired"

and, for a request with no token at all, plain ``Bearer`` (RFC 6750 §3.1: no error
code when no credentials were sent). The description is one of the fixed phrases of
`aiopipe.auth.tokens.REFUSAL_REASONS`, never the token, the secret or anything the
client sent, so the header leaks nothing the log line would not.

The device reads it (`explain_refusal`) and says in one line what the server said and
what to do about it: which token was refused (its own device id and expiry, read from
its own token), and the command that mints a new one. Before this a device said only
"refused the handshake (a token was sent)"; the reason was in the server's log alone,
which the person at the device often cannot read.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

from aiopipe.auth.tokens import (
    EXPIRED,
    MALFORMED,
    NO_TOKEN,
    NOT_BEARER,
    OLD_VERSION,
    REFUSAL_REASONS,
    REVOCATIONS_UNREADABLE,
    REVOKED,
    UNKNOWN_VERSION,
    WRONG_SECRET,
    TokenRefused,
    unverified_token,
)
from aiopipe.errors import AuthenticationError

__all__ = ["bearer_challenge", "explain_refusal", "read_challenge"]

#: How to hand a device its token, as `python -m aiopipe.device` takes it.
PASS_TOKEN = "pass it with --token or AIOPIPE_TOKEN"
#: The longest description from a server that is shown (a foreign server's, say).
_MAX_SHOWN = 120
_PARAM = re.compile(r'([A-Za-z_]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def bearer_challenge(refusal: AuthenticationError) -> str:
    """The ``WWW-Authenticate`` value of the server's HTTP 401 for ``refusal``.

    A `TokenRefused` says its fixed ``reason`` as ``error_description``; no token at all
    gets plain ``Bearer``; any other refusal says ``invalid_token`` with no description
    (its message is free text, which goes to the server's log only).
    """
    reason = refusal.reason if isinstance(refusal, TokenRefused) else None
    if reason == NO_TOKEN:
        return "Bearer"
    if reason not in REFUSAL_REASONS:
        return 'Bearer error="invalid_token"'
    # not a Bearer header is RFC 6750's invalid_request (which it answers with 400); kept
    # at 401 here so that every client reads it as the refusal of its credentials
    error = "invalid_request" if reason == NOT_BEARER else "invalid_token"
    return f'Bearer error="{error}", error_description="{reason}"'


def read_challenge(challenges: Iterable[str]) -> tuple[str | None, str | None]:
    """``(error, error_description)`` of the first Bearer challenge among the
    ``WWW-Authenticate`` values ``challenges`` (None for what it does not say).

    The description is cut to printable ASCII and a bounded length: it is shown to a
    person, and a server that is not aiopipe's may send anything.
    """
    for challenge in challenges:
        scheme, _, params = challenge.strip().partition(" ")
        if scheme.lower() != "bearer":
            continue
        found = {name.lower(): quoted if quoted is not None else bare
                 for name, quoted, bare in _PARAM.findall(params)}
        description = found.get("error_description")
        if description is not None:
            description = re.sub(r"\\(.)", r"\1", description)
            description = "".join(c for c in description if " " <= c <= "~")[:_MAX_SHOWN]
        return found.get("error"), description or None
    return None, None


def explain_refusal(url: str, status: int, challenges: Iterable[str],
                    token: str | None) -> str:
    """One line for the person at a device: the server at ``url`` answered its websocket
    handshake with ``status`` (401, 403 or 429) and the ``WWW-Authenticate`` values
    ``challenges``; ``token`` is what the device sent (None: nothing).

    It says the server's reason and what to do: with no token, how to give one; with a
    refused token, whose it is and the command that mints a new one. A reason this
    version does not know is shown as the server said it.
    """
    claims = unverified_token(token) if token is not None else None
    whose = f"device {claims.device_id}'s token" if claims is not None else "the token it was sent"
    mint = ("python -m aiopipe.auth mint --secret file:server.secret --device-id "
            f"{claims.device_id if claims is not None else 'ID'}")
    if status == 429 and token is None:
        return f"{url} turned the connection away with HTTP 429 (too many requests)"
    if status == 429:
        return (f"the server at {url} turned {whose} away (HTTP 429): it already has as "
                "many connections with that token as the server allows per device "
                "(--max-per-device); is another device process using it? Its places free "
                "when those connections end")
    error, reason = read_challenge(challenges)
    if token is None:
        if status == 401 and error is None:
            return (f"the server at {url} requires a device token and none was sent "
                    f"(HTTP 401): pass --token or set AIOPIPE_TOKEN to this device's token, "
                    f"minted with `{mint}` where the server's secret is "
                    "(see docs/howto/security.md)")
        return (f"{url} refused the handshake with HTTP {status} (no token was sent"
                f"{': ' + reason if reason else ''}); pass --token or set AIOPIPE_TOKEN "
                "(see docs/howto/security.md)")
    head = f"the server at {url} refused {whose} (HTTP {status}): {reason}"
    if reason == EXPIRED:
        when = (time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(claims.expires_at))
                if claims is not None and claims.expires_at else "")
        return (f"{head}{when}; mint a new one with `{mint}` (--expires-in says how long it "
                f"lasts) and {PASS_TOKEN}")
    if reason == WRONG_SECRET:
        return (f"{head} (or it was altered); mint one under the secret the server was "
                f"started with (its --token-secret): `{mint}`, and {PASS_TOKEN}")
    if reason in (REVOKED, OLD_VERSION, UNKNOWN_VERSION):
        return f"{head}; mint a new one with `{mint}` and {PASS_TOKEN}"
    if reason in (MALFORMED, NOT_BEARER):
        return (f"{head}; pass the whole token, as `python -m aiopipe.auth mint` printed it "
                "(v2.<device id>.<expires>.<token id>.<mac>) and nothing else, with --token "
                "or AIOPIPE_TOKEN")
    if reason == REVOCATIONS_UNREADABLE:
        return (f"{head}; the server cannot read its --revoked file, so it refuses every "
                "token: its operator must fix that (the token itself may be good)")
    said = f": {reason}" if reason else f": {error}" if error else ""
    return (f"{url} refused the handshake with HTTP {status} (a token was sent{said}); "
            "the server's log says why")
