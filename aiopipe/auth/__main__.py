"""``python -m aiopipe.auth``: make a token secret (``secret``), mint a device token
(``mint``), or revoke one (``revoke``).

A package ``__main__`` rather than a ``main`` in ``aiopipe/auth/__init__.py``: the library
imports ``aiopipe.auth``, and running an already imported module with ``-m`` makes runpy
warn.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from aiopipe.auth import (
    DEFAULT_TOKEN_LIFETIME_S,
    Revocations,
    generate_secret,
    load_secret,
    mint_token,
    token_id_of,
)
from aiopipe.cli import ArgumentParser
from aiopipe.errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_lifetime(text: str) -> float | None:
    """Seconds in ``text`` (``90s``, ``15m``, ``12h``, ``30d``, or plain seconds);
    ``never``: None.

    Raises:
        ConfigError: anything else, or not > 0.
    """
    if text.strip().lower() == "never":
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(f"a lifetime is a positive number with s, m, h or d, or 'never'; "
                          f"got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.auth``; bad arguments: one line, exit 2."""
    parser = ArgumentParser(
        prog="python -m aiopipe.auth",
        description="Make a server token secret, mint a device's bearer token from one, or "
                    "revoke a token.",
    )
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{secret,mint,revoke}")
    commands.add_parser(
        "secret",
        help="print a new random token secret",
        description="Print a new random token secret (43 URL-safe "
        "characters). Keep it in a file readable by the server "
        "only and pass --token-secret file:PATH.",
    )
    mint = commands.add_parser(
        "mint",
        help="print a new token for one device",
        description="Print a new bearer token for device K under the server's secret; give "
                    "it to that device as --token or $AIOPIPE_TOKEN. Each call mints a "
                    "token of its own (revocable on its own).",
    )
    mint.add_argument(
        "--secret",
        default=os.environ.get("AIOPIPE_TOKEN_SECRET"),
        help="the server's secret: VALUE or file:PATH (default: $AIOPIPE_TOKEN_SECRET)",
    )
    mint.add_argument("--device-id", type=int, required=True, help="the device's id, 0..K-1")
    days = DEFAULT_TOKEN_LIFETIME_S / 86400
    mint.add_argument("--expires-in", default=f"{days:g}d", metavar="DURATION",
                      help="how long the token is good for: 90s, 15m, 12h, 30d or never "
                           f"(default {days:g}d)")
    revoke = commands.add_parser(
        "revoke",
        help="withdraw one token",
        description="Add a token's id to the revocation file that the server reads "
                    "(python -m aiopipe.server --revoked FILE): the server refuses that "
                    "token from its next use and closes a connection that uses it; the "
                    "device's other tokens stay good.",
    )
    revoke.add_argument("--file", required=True, help="the revocation file (made if missing)")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--token", help="the token to revoke (its id is what is written)")
    which.add_argument("--token-id", help="the id of the token to revoke (its 4th field)")
    args = parser.parse_args(argv)
    if args.command == "secret":
        print(generate_secret())
        sys.exit(0)
    try:
        if args.command == "revoke":
            token_id = args.token_id if args.token_id else token_id_of(args.token)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            Revocations.add(args.file, token_id, f"revoked {stamp}")
            print(f"revoked token {token_id} (in {args.file})")
            sys.exit(0)
        if not args.secret:
            mint.error("--secret is required (or set $AIOPIPE_TOKEN_SECRET)")
        if args.device_id < 0:
            mint.error("--device-id must be >= 0")
        token = mint_token(load_secret(args.secret), args.device_id,
                           lifetime_s=parse_lifetime(args.expires_in))
    except ConfigError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(token)
    sys.exit(0)


if __name__ == "__main__":
    main()
