"""``python -m aiopipe``: a server and K device processes on this machine, over real
loopback websockets; prints a per-epoch table and writes the results directory.

With no arguments it runs the `RunConfig` defaults: vgg5 on synthetic-cifar10 with PiPar
(P=2, N=4) on 2 devices x 2000 samples for 3 epochs (under a minute on 2 cores).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from argparse import ArgumentTypeError
from collections.abc import Sequence
from typing import Any, NoReturn

from aiopipe.auth import generate_secret, mint_token
from aiopipe.cli import (
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
from aiopipe.errors import TrainingError
from aiopipe.forkserver import ForkedProcess, ForkServer
from aiopipe.forkserver import available as fork_available
from aiopipe.metrics.results import own_out_dir
from aiopipe.progress import RunDisplay
from aiopipe.wording import plural

log = logging.getLogger("aiopipe.launcher")


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe`` (and the ``aiopipe`` script); ``python -m
    aiopipe new DIR`` writes a project (aiopipe.new)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["new"]:
        from aiopipe.new import main as new

        new(argv[1:])
    parser = ArgumentParser(
        prog="python -m aiopipe",
        description="Train with a server and K device processes on this machine over "
                    "loopback websockets; print a per-epoch table; write a results "
                    "directory (config.toml, metrics.jsonl, trace.json, model.safetensors). "
                    "'python -m aiopipe new DIR' writes a project to start from.",
        add_help=False)
    add_run_options(parser)
    processes = parser.add_argument_group("processes on this machine")
    processes.add_argument("--port", type=int, default=0,
                           help="server port (default: any free)")
    processes.add_argument("--device-restarts", type=_count, default=0, metavar="N",
                           help="start a device process that dies mid-run again, at most N "
                                "times each; it rejoins the run (default 0: the run goes on "
                                "without it)")
    processes.add_argument("--no-fork", dest="fork", action="store_false",
                           help="start each device as a new interpreter, not forked from a "
                                "process that imported torch once (the default on Linux: "
                                "devices start in milliseconds, not seconds)")
    args = parser.parse_args(argv)
    # [Note: fork server]: it imports torch while this process does
    forks = ForkServer.launch() if args.fork and fork_available() and not args.explain else None

    async def run() -> int:
        if explained(args):
            return 0
        with own_out_dir(config_from_args(args)) as config:
            return await _train(config, args.port, args.device_restarts, forks)

    run_command(parser.prog, run)


async def _train(config: RunConfig, port: int, device_restarts: int = 0,
                 forks: ForkServer | None = None) -> int:
    """Serve ``config``'s run on ``port`` with its device processes (each started again at
    most ``device_restarts`` times when it dies mid-run; forked from ``forks`` when
    given, else new interpreters); the exit status."""
    print(_run_line(config), flush=True)
    secret = generate_secret().encode()  # this run's; each device gets its own token
    from aiopipe.api import Server  # torch: after the arguments parsed
    from aiopipe.runtime.systems.base import system_class

    display = RunDisplay()
    async with Server(config, host="127.0.0.1", port=port, token_secret=secret,
                      join_timeout=120.0,
                      progress=lambda m: display.row(epoch_row(m))) as server:
        # a pipeline's devices link to each other: each listens on a free port
        listen = (["--listen", "127.0.0.1:0"] if system_class(config.mode).links_devices
                  else [])

        async def start(k: int) -> asyncio.subprocess.Process | ForkedProcess:
            nonlocal forks
            args = ["aiopipe.device", "--server", server.url, "--device-id", str(k), *listen]
            env = _device_env(mint_token(secret, k))
            process: asyncio.subprocess.Process | ForkedProcess | None = None
            if forks is not None:
                null = os.open(os.devnull, os.O_WRONLY)  # the device's stdout
                try:
                    process = await forks.start(args, env=env, cwd=os.getcwd(), stdout=null,
                                                stderr=2)
                except OSError as exc:
                    log.warning("devices start as new interpreters: %s", exc)
                    forks = None
                finally:
                    os.close(null)
            if process is None:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", *args, env=env, stdout=asyncio.subprocess.DEVNULL)
            log.info("device %d started: pid %d", k, process.pid)
            return process

        devices = [await start(k) for k in range(config.devices)]
        restarts = [device_restarts] * config.devices  # left, per device
        print(TABLE_HEADER, flush=True)
        training = asyncio.ensure_future(server.run())
        exits = {asyncio.ensure_future(p.wait()): k for k, p in enumerate(devices)}
        recovers = system_class(config.mode).recovers_lost_devices
        try:
            async with display.following(server.node):
                pending: set[asyncio.Future[Any]] = {training, *exits}
                while not training.done():
                    done, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        if fut not in exits or fut.result() == 0 or training.done():
                            continue
                        k = exits[fut]
                        if _device_exited(k, fut.result(), restarts=restarts[k],
                                          recovers=recovers and server.node.joined.is_set(),
                                          running=sum(p.returncode is None for p in devices)):
                            restarts[k] -= 1
                            devices[k] = await start(k)  # it rejoins, as the server allows
                            exits[again := asyncio.ensure_future(devices[k].wait())] = k
                            pending.add(again)
            result = training.result()
            await asyncio.wait(list(exits), timeout=30)
        except TrainingError as exc:  # the server keeps what finished, and why it ended
            training.cancel(f"training failed: {exc}")  # [Note: results on every ending]
            await asyncio.wait([training])
            raise
        finally:
            training.cancel()
            await asyncio.wait([training])  # interrupted: it keeps what finished too
            for p in devices:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
    print(done_line("aiopipe", result), flush=True)
    return 0


def _run_line(config: RunConfig) -> str:
    """The first line printed: what the run trains, on what, how long."""
    return (f"aiopipe: {config.mode} | {config.model} on {config.dataset} | "
            f"{plural(config.devices, 'device')} x {_samples(config.samples_per_device)} "
            f"samples | {plural(config.epochs, 'epoch')} | network {config.network}")


def _device_exited(k: int, code: int, *, recovers: bool, running: int, restarts: int
                   ) -> bool:
    """Device process k exited with ``code`` mid-run, ``running`` device processes left:
    the server treats it as a lost device (its liveness gives it up), so the run goes on
    when it ``recovers`` (every device joined, and the mode's system goes on without a
    lost device): with the device started again while it has ``restarts`` left (it
    rejoins as the system allows), else without it while another device process runs.
    Whether to start it again.

    Raises:
        TrainingError: the run cannot go on without the device, or none is left.
    """
    exited = f"device process {k} exited with code {code}"
    if not recovers:
        raise TrainingError(exited)
    if restarts > 0:
        log.warning("%s; starting it again (%d more restart%s allowed)", exited,
                    restarts - 1, "" if restarts == 2 else "s")
        return True
    if not running:
        raise TrainingError(f"{exited}, and every device process has exited")
    log.warning("%s; the run goes on without it", exited)
    return False


def _count(text: str) -> int:
    """A count of 0 or more (``--device-restarts``).

    Raises:
        ArgumentTypeError: it is not one.
    """
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ArgumentTypeError(f"{text!r} is not a count (0, 1, 2...)")
    return value


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
