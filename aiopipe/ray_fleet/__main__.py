"""``python -m aiopipe.ray_fleet``: serve a run here, its devices as Ray actors over a Ray
cluster; prints the per-epoch table and writes the results directory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from aiopipe.cli import (
    TABLE_HEADER,
    ArgumentParser,
    add_run_options,
    config_from_args,
    epoch_row,
    run_command,
)
from aiopipe.metrics.results import EpochMetrics, own_out_dir


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe.ray_fleet``."""
    parser = ArgumentParser(
        prog="python -m aiopipe.ray_fleet",
        description="Serve the run on this machine and host its devices as Ray actors "
                    "spread over a Ray cluster (pip install 'aiopipe[ray]'; start one with "
                    "ray start --head); the devices dial the server over authenticated "
                    "websockets. Prints a per-epoch table, writes results. Wall-clock time; "
                    "for virtual time use aiopipe.simulate.",
        add_help=False)
    add_run_options(parser)
    ray = parser.add_argument_group("Ray (see docs/howto/ray.md)")
    ray.add_argument("--address", default="auto",
                     help="the Ray cluster: HOST:PORT of its head, or auto ($RAY_ADDRESS, or "
                          "the cluster ray start began on this machine; default auto)")
    ray.add_argument("--host",
                     help="address the server binds and the devices dial (default: this "
                          "node's address as Ray sees it; 0.0.0.0 binds every interface)")
    ray.add_argument("--port", type=int, default=0,
                     help="server port; the other nodes must reach it (default 0: any free)")
    ray.add_argument("--devices-per-actor", type=int, metavar="N",
                     help="devices each Ray actor (one process) hosts (default: one actor per "
                          "free CPU of the cluster, the devices divided among them)")
    ray.add_argument("--join-timeout", type=float, default=300.0, metavar="S",
                     help="seconds for the actors to start and every device to join "
                          "(default 300)")
    ray.add_argument("--torch-device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                     help="where the server's stages compute (default auto: a CUDA GPU when "
                          "torch sees one, else the CPU); the devices use their actors' CPUs")
    args = parser.parse_args(argv)
    if args.devices_per_actor is not None and args.devices_per_actor < 1:
        parser.error("--devices-per-actor must be >= 1")

    async def run() -> int:
        from aiopipe.progress import RunDisplay
        from aiopipe.ray_fleet import run_on_ray

        display = RunDisplay(enabled=False)  # the coordinator is inside run_on_ray
        rows = 0

        def progress(m: EpochMetrics) -> None:
            nonlocal rows
            if not rows:  # once training runs: Ray's and the actors' lines come before
                display.row(TABLE_HEADER)
            rows += 1
            display.row(epoch_row(m))

        with own_out_dir(config_from_args(args), stem="ray") as config:
            print(f"aiopipe.ray_fleet: {config.mode} | {config.model} | {config.devices} "
                  f"devices as Ray actors | Ray at {args.address}", flush=True)
            result = await run_on_ray(config, address=args.address, host=args.host,
                                      port=args.port, devices_per_actor=args.devices_per_actor,
                                      join_timeout=args.join_timeout,
                                      torch_device=args.torch_device, progress=progress)
        print(f"aiopipe.ray_fleet: done; test accuracy {result.final.accuracy:.3f}; results "
              f"in {result.out_dir}", flush=True)
        return 0

    run_command(parser.prog, run)


if __name__ == "__main__":
    main()
