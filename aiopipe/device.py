"""``python -m aiopipe.device``: one device; everything else comes from the server's plan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NoReturn

from aiopipe.api import Device
from aiopipe.auth import client_ssl_context
from aiopipe.cli import ArgumentParser, run_command
from aiopipe.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.device``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.device",
        description="Connect to an aiopipe server and train this device's part of the "
                    "model on its local data until the server says goodbye.")
    parser.add_argument("--server", required=True,
                        help="server websocket URL, ws://HOST:PORT/ws (or wss://)")
    parser.add_argument("--device-id", type=int, required=True, help="this device's id, 0..K-1")
    parser.add_argument("--token", default=os.environ.get("AIOPIPE_TOKEN"),
                        help="this device's token (python -m aiopipe.auth mint; "
                             "default: $AIOPIPE_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE",
                        help="verify a wss:// server against these PEM CA certificates "
                             "(default for wss://: the system's)")
    args = parser.parse_args(argv)
    if args.device_id < 0:
        parser.error("--device-id must be >= 0")

    async def run() -> int:
        tls = None
        if args.tls_ca is not None:
            if not args.server.startswith("wss://"):
                raise ConfigError(f"--tls-ca needs a wss:// server URL, got {args.server!r}")
            tls = client_ssl_context(args.tls_ca)
        async with Device(args.server, args.device_id, token=args.token or None,
                          ssl=tls) as device:
            await device.run()
        return 0

    run_command(f"{parser.prog} [device {args.device_id}]", run)


if __name__ == "__main__":
    main()
