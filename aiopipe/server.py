"""``python -m aiopipe.server``: serve devices over websockets, train, write results."""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from aiopipe.auth import load_secret, server_ssl_context
from aiopipe.cli import (
    RUN_OPTION_KEYS,
    TABLE_HEADER,
    ArgumentParser,
    add_run_options,
    config_from_args,
    done_line,
    epoch_row,
    explained,
    run_command,
)
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.metrics.results import own_out_dir
from aiopipe.progress import RunDisplay
from aiopipe.runtime.guard import ConnectionLimits
from aiopipe.wording import plural


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.server``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.server",
        description="Serve devices at ws://HOST:PORT/ws (wss:// with --tls-cert; plus /status, "
                    "/metrics and a live dashboard at /), train when all have joined, print "
                    "a per-epoch table, write results.",
        add_help=False)
    add_run_options(parser)
    listen = parser.add_argument_group("where to listen, what to compute on")
    listen.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    listen.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    security = parser.add_argument_group("security (see docs/howto/security.md)")
    security.add_argument("--token-secret", default=os.environ.get("AIOPIPE_TOKEN_SECRET"),
                          metavar="VALUE|file:PATH",
                          help="device k must present the token minted for k under this secret "
                               "(python -m aiopipe.auth mint); default: $AIOPIPE_TOKEN_SECRET")
    security.add_argument("--tls-cert", metavar="FILE",
                          help="serve wss:// with this PEM certificate chain (needs --tls-key)")
    security.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    security.add_argument("--insecure", action="store_true",
                          help="allow a non-loopback address without a token secret")
    security.add_argument("--revoked", metavar="FILE",
                          help="refuse the tokens whose ids this file lists (python -m "
                               "aiopipe.auth revoke adds one); read again whenever it changes")
    defaults = ConnectionLimits()
    security.add_argument("--handshake-timeout", type=float, default=defaults.handshake_timeout,
                          metavar="S",
                          help="close a connection that is not a device's (its hello taken) S "
                               f"seconds after it opened (default {defaults.handshake_timeout:g})")
    security.add_argument("--max-pending", type=int, default=defaults.max_pending, metavar="N",
                          help="connections open at once that are not a device's yet; one more "
                               f"closes the oldest (default {defaults.max_pending})")
    security.add_argument("--max-per-device", type=int, default=defaults.max_per_device,
                          metavar="N", help="websockets past their hello at once with one device's "
                                            "token; one that has not said hello holds no "
                                            f"slot (default {defaults.max_per_device})")
    # the shared token this option used to take is gone; say so rather than let argparse
    # read `--token X` as an abbreviation of --token-secret
    parser.add_argument("--token", dest="shared_token", help=argparse.SUPPRESS)
    listen.add_argument("--torch-device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                        help="where this node's stages compute (default auto: a CUDA GPU "
                             "when torch sees one, else the CPU); wire tensors stay CPU bytes")
    listen.add_argument("--join-timeout", type=float, default=300.0,
                        help="seconds to wait for every device (default 300)")
    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument("--resume", metavar="DIR",
                             help="continue the run whose results directory is DIR from its "
                                  "last checkpoint (DIR/checkpoint, written after every "
                                  "round); the run's options come from the checkpoint")
    args = parser.parse_args(argv)
    if args.shared_token is not None:
        parser.error("--token is gone: give the server --token-secret and each device its own "
                     "token from python -m aiopipe.auth mint")

    async def run() -> int:
        if explained(args):
            return 0
        if not args.token_secret and not args.insecure and not _is_loopback(args.host):
            raise ConfigError(f"binding {args.host} without --token-secret needs --insecure")
        secret = load_secret(args.token_secret) if args.token_secret else None
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        tls = server_ssl_context(args.tls_cert, args.tls_key) if args.tls_cert else None
        limits = ConnectionLimits(handshake_timeout=args.handshake_timeout,
                                  max_pending=args.max_pending,
                                  max_per_device=args.max_per_device)
        config = resumed_config(args) if args.resume else config_from_args(args)
        from aiopipe.api import Server  # torch: after the arguments parsed

        display = RunDisplay()
        with own_out_dir(config, stem="server") as config:
            async with Server(config, host=args.host, port=args.port, token_secret=secret,
                              ssl=tls, join_timeout=args.join_timeout, resume=bool(args.resume),
                              torch_device=args.torch_device, limits=limits,
                              revoked=args.revoked,
                              progress=lambda m: display.row(epoch_row(m))) as server:
                print(f"aiopipe.server: waiting for {plural(config.devices, 'device')} at "
                      f"{server.url}",
                      flush=True)
                print(f"aiopipe.server: a live dashboard at {server.dashboard_url}", flush=True)
                print(TABLE_HEADER, flush=True)
                async with display.following(server.node):
                    result = await server.run()
        print(done_line("aiopipe.server", result), flush=True)
        return 0

    run_command(parser.prog, run)


def resumed_config(args: argparse.Namespace) -> RunConfig:
    """The config saved with the checkpoint of the run in ``args.resume``.

    Raises:
        ConfigError: no checkpoint there, or run options were given as well.
    """
    given = [k for k in RUN_OPTION_KEYS if getattr(args, k, None) is not None]
    if given or args.config is not None:
        raise ConfigError("--resume takes the run's options from its checkpoint; drop "
                          f"{', '.join('--' + k.replace('_', '-') for k in given) or '--config'}")
    from aiopipe.runtime.checkpoint import load_checkpoint

    meta = load_checkpoint(Path(args.resume) / "checkpoint")[1]
    # (an older checkpoint's config is in the old flat form: read without a warning)
    return RunConfig.from_mapping({**meta["config"], "out_dir": str(args.resume)}, warn=False)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    main()
