"""``python -m aiopipe``: a server and K device processes on this machine, over real
loopback websockets; prints a per-epoch table and writes the results directory.

With no arguments it runs the `RunConfig` defaults: vgg5 on synthetic-cifar10 with PiPar
(P=2, N=4) on 2 devices x 2000 samples for 3 epochs (under a minute on 2 cores).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from aiopipe.auth import generate_secret, mint_token
from aiopipe.cli import (
    TABLE_HEADER,
    ArgumentParser,
    add_run_options,
    config_from_args,
    epoch_row,
    run_command,
)
from aiopipe.config import LINKED_MODES, RunConfig
from aiopipe.errors import TrainingError
from aiopipe.metrics.results import own_out_dir
from aiopipe.progress import RunDisplay


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe`` (and the ``aiopipe`` script)."""
    parser = ArgumentParser(
        prog="python -m aiopipe",
        description="Train with a server and K device processes on this machine over "
                    "loopback websockets; print a per-epoch table; write a results "
                    "directory (config.toml, metrics.jsonl, trace.json, model.safetensors).")
    add_run_options(parser)
    parser.add_argument("--port", type=int, default=0, help="server port (default: any free)")
    args = parser.parse_args(argv)

    async def run() -> int:
        with own_out_dir(config_from_args(args)) as config:
            return await _train(config, args.port)

    run_command(parser.prog, run)


async def _train(config: RunConfig, port: int) -> int:
    """Serve ``config``'s run on ``port`` with its device processes; the exit status."""
    print(f"aiopipe: {config.mode} | {config.model} on {config.dataset} | "
          f"{config.devices} devices x {_samples(config.samples_per_device)} samples | "
          f"{config.epochs} epochs | network {config.network}", flush=True)
    secret = generate_secret().encode()  # this run's; each device gets its own token
    from aiopipe.api import Server  # torch: after the arguments parsed

    display = RunDisplay()
    async with Server(config, host="127.0.0.1", port=port, token_secret=secret,
                      join_timeout=120.0,
                      progress=lambda m: display.row(epoch_row(m))) as server:
        # a pipeline's devices link to each other: each listens on a free port
        listen = ["--listen", "127.0.0.1:0"] if config.mode in LINKED_MODES else []
        devices = [await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiopipe.device", "--server", server.url,
            "--device-id", str(k), *listen, env=_device_env(mint_token(secret, k)),
            stdout=asyncio.subprocess.DEVNULL)
            for k in range(config.devices)]
        print(TABLE_HEADER, flush=True)
        training = asyncio.ensure_future(server.run())
        exits = {asyncio.ensure_future(p.wait()): k for k, p in enumerate(devices)}
        try:
            async with display.following(server.node):
                pending: set[asyncio.Future[Any]] = {training, *exits}
                while not training.done():
                    done, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        if fut in exits and fut.result() != 0 and not training.done():
                            raise TrainingError(f"device process {exits[fut]} exited with "
                                                f"code {fut.result()}")
            result = training.result()
            await asyncio.wait(list(exits), timeout=30)
        finally:
            training.cancel()
            for p in devices:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
    print(f"aiopipe: done; test accuracy {result.final.accuracy:.3f}; "
          f"results in {result.out_dir}", flush=True)
    return 0


def _samples(value: int | tuple[int, ...]) -> str:
    return str(value) if isinstance(value, int) else "/".join(map(str, value))


def _device_env(token: str) -> dict[str, str]:
    """The device process's environment: ours, its own token, and not the server secret."""
    env = {k: v for k, v in os.environ.items() if k != "AIOPIPE_TOKEN_SECRET"}
    env["AIOPIPE_TOKEN"] = token
    env["AIOPIPE_LOG_LEVEL"] = "WARNING"  # the server's lines say who joined and left
    return env


if __name__ == "__main__":
    main()
