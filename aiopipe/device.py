"""``python -m aiopipe.device``: one device on its own data; the rest comes from the server's
plan."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from aiopipe.auth import client_ssl_context, unverified_token
from aiopipe.cli import ArgumentParser, run_command
from aiopipe.errors import ConfigError, TrainingError
from aiopipe.wording import plural

if TYPE_CHECKING:
    from aiopipe.data import Dataset

log = logging.getLogger("aiopipe.device")


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.device``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.device",
        description="Connect to an aiopipe server and train this device's part of the "
                    "model on its local data until the server says goodbye.")
    device = parser.add_argument_group("this device: its server, id and data")
    device.add_argument("--server", required=True,
                        help="server websocket URL, ws://HOST:PORT/ws (or wss://)")
    device.add_argument("--device-id", type=int, required=True, help="this device's id, 0..K-1")
    device.add_argument("--data", metavar="SPEC",
                        help="this device's training data: mnist:DIR, cifar10:DIR, "
                             "cifar100:DIR (the standard files' training split), "
                             "synthetic-cifar10 and the like (--samples of them, drawn "
                             "with --seed), or module:function (returns a map-style torch "
                             "dataset of (input, label)); default: an emulated fleet's "
                             "shard, this device's share of the run's dataset")
    device.add_argument("--held-out", metavar="SPEC",
                        help="this device's held-out data (the forms of --data; files and "
                             "module:function give their test split): every epoch's global "
                             "model is evaluated on it here, and the server reports how it "
                             "did; the device then receives the whole model")
    device.add_argument("--samples", type=int, metavar="N",
                        help="with --data: keep the first N samples (synthetic data: "
                             "draw N; default all, or 2000 synthetic)")
    device.add_argument("--seed", type=int, default=0,
                        help="with --data: the seed synthetic data is drawn with "
                             "(default 0)")
    operations = parser.add_argument_group("security and operations")
    operations.add_argument("--token", default=os.environ.get("AIOPIPE_TOKEN"),
                            help="this device's token (python -m aiopipe.auth mint; "
                                 "default: $AIOPIPE_TOKEN); a server that refuses it says why, "
                                 "and this device prints it")
    operations.add_argument("--tls-ca", metavar="FILE",
                            help="verify a wss:// server against these PEM CA certificates "
                                 "(default for wss://: the system's)")
    operations.add_argument("--connect-timeout", type=float, default=300.0, metavar="S",
                            help="wait up to S seconds for a server that is not listening yet, "
                                 "retrying with backoff (default 300: start the fleet in any "
                                 "order)")
    operations.add_argument("--torch-device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                            help="where this node's stages compute (default auto: a CUDA GPU "
                                 "when torch sees one, else the CPU); wire tensors stay CPU bytes")
    peers = parser.add_argument_group("peer links (runs that link devices directly: "
                                      "modes pipeline, ftpipehd, asteroid, hadfl)")
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
    if args.data is None and args.samples is not None:
        parser.error("--samples needs --data")
    if args.samples is not None and args.samples < 1:
        parser.error("--samples must be >= 1")
    if not args.connect_timeout >= 0:
        parser.error("--connect-timeout must be >= 0")
    claims = unverified_token(args.token) if args.token else None
    if claims is not None and claims.device_id != args.device_id:  # the server would refuse it
        parser.error(f"the token (--token or AIOPIPE_TOKEN) is for device {claims.device_id}, "
                     f"not device {args.device_id}: give this device its own, from `python -m "
                     f"aiopipe.auth mint --secret file:server.secret --device-id {args.device_id}`")

    async def run() -> int:
        tls = None
        if args.tls_ca is not None:
            if not args.server.startswith("wss://"):
                raise ConfigError(f"--tls-ca needs a wss:// server URL, got {args.server!r}")
            tls = client_ssl_context(args.tls_ca)
        dataset = held_out = None
        if args.data is not None:
            dataset = await asyncio.to_thread(_open_data, args.data, args.samples, args.seed)
            log.info("device %d: %s of %s", args.device_id, plural(len(dataset), "sample"),
                     args.data)
        if args.held_out is not None:
            held_out = await asyncio.to_thread(_open_data, args.held_out, None, args.seed,
                                               "test")
        from aiopipe.api import Device  # torch: after the arguments parsed
        from aiopipe.protocol import TRAINING_FINISHED

        async with Device(args.server, args.device_id, token=args.token or None,
                          ssl=tls, listen=args.listen, advertise=args.advertise,
                          dataset=dataset, torch_device=args.torch_device,
                          held_out=held_out, connect_timeout=args.connect_timeout) as device:
            summary = await device.run()
        if summary.reason != TRAINING_FINISHED:
            raise TrainingError(f"the server ended the run: {summary.reason} (after "
                                f"{plural(summary.rounds, 'round')}, "
                                f"{plural(summary.samples, 'sample')})")
        print(f"device {args.device_id}: done: {plural(summary.rounds, 'round')}, "
              f"{plural(summary.samples, 'sample')} trained", flush=True)
        return 0

    run_command(f"{parser.prog} [device {args.device_id}]", run)


def _open_data(spec: str, samples: int | None, seed: int, split: str = "train") -> Dataset:
    from aiopipe.data import DATASET_NAMES, open_device_data

    if samples is None and spec in DATASET_NAMES:
        samples = SYNTHETIC_DEFAULT_SAMPLES if split == "train" else SYNTHETIC_HELD_OUT
    return open_device_data(spec, split=split, seed=seed, size=samples)


#: Samples a device draws of a synthetic dataset when --samples does not say, and of its
#: held-out (test) split.
SYNTHETIC_DEFAULT_SAMPLES = 2000
SYNTHETIC_HELD_OUT = 500


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


if __name__ == "__main__":
    main()
