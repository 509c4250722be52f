"""``python -m aiopipe.server``: serve devices over websockets, train, write results."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from typing import NoReturn

from aiopipe.api import Server
from aiopipe.cli import (
    TABLE_HEADER,
    ArgumentParser,
    add_run_options,
    config_from_args,
    epoch_row,
    run_command,
)
from aiopipe.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.server``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.server",
        description="Serve devices at ws://HOST:PORT/ws (plus /status and /metrics), "
                    "train when all have joined, print a per-epoch table, write results.")
    add_run_options(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    parser.add_argument("--token", default=os.environ.get("AIOPIPE_TOKEN"),
                        help="devices must present this bearer token (default: $AIOPIPE_TOKEN)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback address without a token")
    parser.add_argument("--join-timeout", type=float, default=300.0,
                        help="seconds to wait for every device (default 300)")
    args = parser.parse_args(argv)

    async def run() -> int:
        if not args.token and not args.insecure and not _is_loopback(args.host):
            raise ConfigError(f"binding {args.host} without --token needs --insecure")
        config = config_from_args(args)
        if not config.out_dir:
            config = config.replace(out_dir="runs/server")
        async with Server(config, host=args.host, port=args.port, token=args.token,
                          join_timeout=args.join_timeout,
                          progress=lambda m: print(epoch_row(m), flush=True)) as server:
            print(f"aiopipe.server: waiting for {config.devices} devices at {server.url}",
                  flush=True)
            print(TABLE_HEADER, flush=True)
            result = await server.run()
        print(f"aiopipe.server: done; results in {result.out_dir}", flush=True)
        return 0

    run_command(parser.prog, run)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    main()
