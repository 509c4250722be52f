"""``python -m aiopipe.device``: one device; everything else comes from the server's plan."""

from __future__ import annotations

import argparse
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
    peers = parser.add_argument_group("peer links (runs that link devices directly: "
                                      "mode pipeline)")
    peers.add_argument("--listen", metavar="HOST:PORT", type=_host_port,
                       help="accept peer devices' links here (port 0: any free port)")
    peers.add_argument("--advertise", metavar="URL",
                       help="the address peers dial (default ws://HOST:PORT/peer of "
                            "--listen; give one when HOST is 0.0.0.0 or behind NAT)")
    args = parser.parse_args(argv)
    if args.device_id < 0:
        parser.error("--device-id must be >= 0")
    if args.advertise is not None and args.listen is None:
        parser.error("--advertise needs --listen")

    async def run() -> int:
        tls = None
        if args.tls_ca is not None:
            if not args.server.startswith("wss://"):
                raise ConfigError(f"--tls-ca needs a wss:// server URL, got {args.server!r}")
            tls = client_ssl_context(args.tls_ca)
        async with Device(args.server, args.device_id, token=args.token or None,
                          ssl=tls, listen=args.listen, advertise=args.advertise) as device:
            await device.run()
        return 0

    run_command(f"{parser.prog} [device {args.device_id}]", run)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


if __name__ == "__main__":
    main()
