"""``python -m aiopipe.auth``: make a token secret (``secret``) or mint a device token (``mint``).

A package ``__main__`` rather than a ``main`` in ``aiopipe/auth/__init__.py``: the library
imports ``aiopipe.auth``, and running an already imported module with ``-m`` makes runpy
warn.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from aiopipe.auth import generate_secret, load_secret, mint_token
from aiopipe.cli import ArgumentParser
from aiopipe.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.auth``; bad arguments: one line, exit 2."""
    parser = ArgumentParser(
        prog="python -m aiopipe.auth",
        description="Make a server token secret, or mint a device's bearer token from one.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{secret,mint}")
    commands.add_parser(
        "secret",
        help="print a new random token secret",
        description="Print a new random token secret (43 URL-safe "
        "characters). Keep it in a file readable by the server "
        "only and pass --token-secret file:PATH.",
    )
    mint = commands.add_parser(
        "mint",
        help="print one device's token",
        description="Print device K's bearer token under the server's secret; give it to "
        "that device as --token or $AIOPIPE_TOKEN.",
    )
    mint.add_argument(
        "--secret",
        default=os.environ.get("AIOPIPE_TOKEN_SECRET"),
        help="the server's secret: VALUE or file:PATH (default: $AIOPIPE_TOKEN_SECRET)",
    )
    mint.add_argument("--device-id", type=int, required=True, help="the device's id, 0..K-1")
    args = parser.parse_args(argv)
    if args.command == "secret":
        print(generate_secret())
        sys.exit(0)
    if not args.secret:
        mint.error("--secret is required (or set $AIOPIPE_TOKEN_SECRET)")
    if args.device_id < 0:
        mint.error("--device-id must be >= 0")
    try:
        token = mint_token(load_secret(args.secret), args.device_id)
    except ConfigError as exc:
        print(f"{mint.prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(token)
    sys.exit(0)


if __name__ == "__main__":
    main()
