"""``python -m aiopipe.device``: one device; everything else comes from the server's plan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NoReturn

from aiopipe.api import Device
from aiopipe.cli import ArgumentParser, run_command


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.device``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.device",
        description="Connect to an aiopipe server and train this device's part of the "
                    "model on its local data until the server says goodbye.")
    parser.add_argument("--server", required=True, help="server websocket URL, ws://HOST:PORT/ws")
    parser.add_argument("--device-id", type=int, required=True, help="this device's id, 0..K-1")
    parser.add_argument("--token", default=os.environ.get("AIOPIPE_TOKEN"),
                        help="bearer token for the server (default: $AIOPIPE_TOKEN)")
    args = parser.parse_args(argv)
    if args.device_id < 0:
        parser.error("--device-id must be >= 0")

    async def run() -> int:
        async with Device(args.server, args.device_id, token=args.token) as device:
            await device.run()
        return 0

    run_command(f"{parser.prog} [device {args.device_id}]", run)


if __name__ == "__main__":
    main()
