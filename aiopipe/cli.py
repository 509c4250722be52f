"""What the three commands share: argument parsing into a `RunConfig`, one-line errors,
the per-epoch table. The commands themselves (``aiopipe.__main__``, ``aiopipe.server``,
``aiopipe.device``) stay thin: parse, configure, run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from aiopipe.config import (
    AGGREGATIONS,
    MODES,
    OUTLIERS,
    PRIVACY_METHODS,
    RESCHEDULINGS,
    SCHEDULES,
    RunConfig,
)
from aiopipe.errors import AiopipeError, ConfigError
from aiopipe.metrics.results import EpochMetrics, RunResult

__all__ = [
    "RUN_OPTION_KEYS",
    "ArgumentParser",
    "add_run_options",
    "config_from_args",
    "done_line",
    "epoch_row",
    "run_command",
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_list(text: str) -> int | str | list[int]:
    if text == "auto":
        return text
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, an integer or a comma list, got {text!r}"
                                         ) from None
    return values[0] if len(values) == 1 else values


def _groups(text: str) -> str | list[list[int]]:
    if text == "auto":
        return text
    try:
        return [[int(v) for v in group.split(",")] for group in text.split("/")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or device ids per stage, e.g. "
                                         f"0,1/2 (stage 0 on devices 0 and 1, stage 1 on "
                                         f"device 2), got {text!r}") from None


def _steps(text: str) -> int | str:
    return text if text == "capacity" else int(text) if text.isdigit() else text


def _float_list(text: str) -> float | list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma list, got {text!r}"
                                         ) from None
    return values[0] if len(values) == 1 else values


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """Options that override the config file's keys."""
    run = parser.add_argument_group("run options (override the config file)")
    run.add_argument("--config", type=Path, help="TOML file with run keys (see README)")
    run.add_argument("--mode", choices=MODES, help="training mode (default pipar)")
    run.add_argument("--model", help="model name (vgg5, resnet18, mobilenetv3-small, vgg16, "
                                     "resnet101, mobilenetv3-large) or module:function, a "
                                     "factory of the nn.Sequential of split units "
                                     "(default vgg5)")
    run.add_argument("--loss", help="cross-entropy (default) or module:function, a factory "
                                    "of loss(logits, labels)")
    run.add_argument("--optimizer", help="sgd (default) or module:function, a factory "
                                         "called with params, learning_rate, momentum")
    run.add_argument("--dataset", help="the server's evaluation data and an emulated fleet's "
                                       "data: synthetic-cifar10 (default), cifar10:DIR, "
                                       "mnist:DIR... or module:function")
    run.add_argument("--test-samples", type=int,
                     help="size of the server's evaluation set (0: none; default 1000)")
    run.add_argument("--devices", type=int, help="number of devices K (default 2)")
    run.add_argument("--samples-per-device", type=_int_list,
                     help="an emulated fleet's training samples per device: an integer or a "
                          "comma list per device (default 2000)")
    run.add_argument("--batch-size", type=int, help="samples per optimizer step B")
    run.add_argument("--epochs", type=int, help="epochs to train")
    run.add_argument("--split-point", type=_int_list,
                     help="units on the device P: an integer, a comma list per device, or "
                          "auto (the planner picks per device)")
    run.add_argument("--parallel-batches", type=_int_list,
                     help="micro-batches per iteration N: an integer, a comma list per "
                          "device, or auto (the planner picks; best with N dividing B)")
    run.add_argument("--partition", type=_int_list,
                     help="modes pipeline, ftpipehd, asteroid: the S-1 cut points (comma "
                          "list) or auto (balanced; asteroid: its planner's)")
    run.add_argument("--stage-groups", type=_groups,
                     help="mode asteroid: the devices of each stage, e.g. 0,1/2 (stage 0 on "
                          "devices 0 and 1, which split every micro-batch, stage 1 on "
                          "device 2), or auto (the planner's, with --partition auto)")
    run.add_argument("--rescheduling", choices=RESCHEDULINGS,
                     help="mode asteroid: how to re-plan when a device is lost: lightweight "
                          "(default: adjust the plan) or heavy (plan again from scratch)")
    run.add_argument("--schedule", choices=SCHEDULES,
                     help="modes pipeline and asteroid: 1f1b (default) or gpipe")
    run.add_argument("--version-aggregation", type=int,
                     help="mode ftpipehd: stage p averages its S - p in-flight weight "
                          "versions every this many times S - p updates (0: never)")
    run.add_argument("--global-replication-every", type=int,
                     help="mode ftpipehd: batches between global replications (a flush; "
                          "where re-partitioning happens and a fault's replay starts; "
                          "0: once per epoch; default 100)")
    run.add_argument("--first-repartition-after", type=int,
                     help="mode ftpipehd with auto cuts: batches before the first "
                          "re-partition (then at each global replication; 0: none before "
                          "the first global replication; default 10)")
    run.add_argument("--chain-replication-every", type=int,
                     help="modes ftpipehd and asteroid: batches between chain replications "
                          "(ftpipehd: each stage's weights to the next stage's device; "
                          "asteroid: a stage's only device backs its stage up to the next "
                          "stage's first device, the last stage to the first); a fault's "
                          "replay starts from the latest one that survived; 0: none; "
                          "default 50")
    run.add_argument("--warmup-epochs", type=int,
                     help="mode hadfl: epochs of the mutual negotiation (each device one "
                          "epoch at --warmup-learning-rate, then the whole fleet averages); "
                          "its times size the local steps")
    run.add_argument("--warmup-learning-rate", type=float,
                     help="mode hadfl: the negotiation's small learning rate")
    run.add_argument("--local-steps", type=_steps,
                     help="mode hadfl: capacity (each device as many mini-batches as fit "
                          "its speed in a period) or a number every device trains a round")
    run.add_argument("--sync-periods", type=int,
                     help="mode hadfl: T_sync, hyperperiods between synchronisations")
    run.add_argument("--ring-size", type=int,
                     help="mode hadfl: N_p, devices that average each round (0: half)")
    run.add_argument("--version-smoothing", type=float,
                     help="mode hadfl: Holt's smoothing factor for version prediction")
    run.add_argument("--group-size", type=int,
                     help="mode hadfl: devices per group, each averaging within itself "
                          "(0: one group)")
    run.add_argument("--inter-group-every", type=int,
                     help="mode hadfl with groups: rounds between inter-group averages")
    run.add_argument("--ring-timeout", type=float,
                     help="mode hadfl: seconds a ring member waits for its upstream before "
                          "it asks it; as long again without an answer and it is bypassed")
    run.add_argument("--network", help="network preset: 4g, 4g+, wifi or lan")
    run.add_argument("--device-timeout", type=float,
                     help="seconds of silence before a device connection is given up "
                          "(mode ftpipehd: also how long device 0 waits for the same "
                          "gradients before its round stops and is played again)")
    run.add_argument("--reconnect-grace", type=float,
                     help="seconds a disconnected device has to reconnect before its round "
                          "goes on without it (default 10)")
    run.add_argument("--replan", dest="replan", action="store_true", default=None,
                     help='with "auto" plans, re-plan between rounds from live measurements '
                          "(experimental: off by default)")
    run.add_argument("--no-device-profiles", dest="profile_devices", action="store_false",
                     default=None,
                     help='with "auto" (asteroid: any plan), plan from the server\'s own '
                          "table times each device's --device-slowdown instead of the "
                          "devices' own measurements (by default devices profile "
                          "themselves)")
    run.add_argument("--device-memory-mb", type=_float_list,
                     help='memory budget per device for "auto" plans, MB (0 = unlimited)')
    run.add_argument("--heartbeat-interval", type=float, help="seconds between heartbeats")
    run.add_argument("--no-shaping", dest="shape_links", action="store_false", default=None,
                     help="do not pace websocket senders at the network's rates (use when "
                          "the network is really shaped, e.g. by tc; by default they are)")
    run.add_argument("--device-slowdown", type=_float_list,
                     help="compute slowdown factor(s) >= 1 to emulate slow devices")
    run.add_argument("--aggregation-every", type=int,
                     help="FedAvg every this many iterations (0 = every epoch)")
    run.add_argument("--aggregation", choices=AGGREGATIONS,
                     help="how device models are combined (default fedavg; the others "
                          "bound what a few bad devices can do)")
    run.add_argument("--outliers", choices=OUTLIERS,
                     help="a device update far above the round's median: keep (default), "
                          "clip or drop it")
    run.add_argument("--privacy", choices=PRIVACY_METHODS,
                     help="modes fl, sl, sfl, pipar: differential privacy on the devices: "
                          "classic (noise on the uploaded model half) or pixeldp (noise "
                          "on every training input)")
    run.add_argument("--privacy-noise", type=float,
                     help="the privacy noise's standard deviation")
    run.add_argument("--server-lanes", type=int,
                     help="modes sfl, pipar: server passes of different devices' replicas "
                          "run at once (threads; for a server with that many cores or a GPU)")
    run.add_argument("--devices-per-round", type=_count_or_fraction,
                     help="modes fl, sl, sfl, pipar: devices sampled to train in each round: "
                          "a count, or a fraction in (0, 1) of the devices; 0: every device")
    run.add_argument("--learning-rate", type=float, help="SGD learning rate")
    run.add_argument("--momentum", type=float, help="SGD momentum")
    run.add_argument("--seed", type=int, help="random seed")
    run.add_argument("--out-dir", help="results directory (default runs/<date-time>; one "
                                       "that holds results is refused)")
    defaults = RunConfig()
    for action in run._group_actions:  # say each default, from the config's own
        if (action.dest in RUN_OPTION_KEYS and action.help and "default" not in action.help
                and not isinstance(action, argparse._StoreFalseAction)):
            action.help += f" (default {_shown(getattr(defaults, action.dest))})"


def _count_or_fraction(text: str) -> int | float:
    """``--devices-per-round``'s value: an integer count, or a fraction."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a count or a fraction, got {text!r}") from None


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


RUN_OPTION_KEYS = ("mode", "model", "loss", "optimizer", "dataset", "test_samples", "devices",
                   "samples_per_device", "batch_size", "epochs", "split_point",
                   "parallel_batches", "network", "device_slowdown", "aggregation_every",
                   "learning_rate", "seed", "out_dir", "shape_links", "device_timeout",
                   "heartbeat_interval", "reconnect_grace", "replan", "device_memory_mb",
                   "partition", "stage_groups", "rescheduling", "schedule", "profile_devices",
                   "aggregation", "outliers",
                   "version_aggregation", "momentum", "global_replication_every",
                   "chain_replication_every", "first_repartition_after", "warmup_epochs",
                   "warmup_learning_rate", "local_steps", "sync_periods", "ring_size",
                   "version_smoothing", "ring_timeout", "group_size", "inter_group_every",
                   "privacy", "privacy_noise", "server_lanes", "devices_per_round")


def config_from_args(args: argparse.Namespace, **defaults: Any) -> RunConfig:
    """The config file (if any), then ``defaults`` for keys it lacks, then the options.

    Raises:
        ConfigError: the file or a value is invalid.
    """
    overrides = {k: getattr(args, k) for k in RUN_OPTION_KEYS if getattr(args, k) is not None}
    if args.config is not None:
        base = RunConfig.from_toml(args.config).to_mapping()
        if base.get("model") == "custom":
            raise ConfigError("a config file cannot hold a custom model")
        given = _toml_keys(args.config)
        values = {**{k: v for k, v in defaults.items() if k not in given},
                  **{k: base[k] for k in given}}
    else:
        values = dict(defaults)
    values.update(overrides)
    return RunConfig.from_mapping(values)


def _toml_keys(path: Path) -> set[str]:
    import tomllib

    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return set(data["run"] if isinstance(data.get("run"), dict) else data)


TABLE_HEADER = (f"{'epoch':>5} {'time s':>8} {'loss':>7} {'test acc':>8} {'train acc':>9} "
                f"{'dev busy':>8} {'srv busy':>8} {'up MB':>7} {'down MB':>7}")


def epoch_row(m: EpochMetrics) -> str:
    """One line of the per-epoch table (and the devices' held-out accuracy, if any)."""
    row = (f"{m.epoch:>5} {m.time_s:>8.2f} {m.loss:>7.4f} {m.accuracy:>8.3f} "
           f"{m.train_accuracy:>9.3f} {m.busy_s['device']:>8.2f} {m.busy_s['server']:>8.2f} "
           f"{m.bytes_up / 1e6:>7.1f} {m.bytes_down / 1e6:>7.1f}")
    if m.device_accuracy:
        row += f"  held-out {m.held_out_accuracy:.3f}"
    return row


def done_line(prog: str, result: RunResult) -> str:
    """The last line of ``python -m aiopipe`` and of ``python -m aiopipe.server``: the
    final test accuracy (and the devices' held-out accuracy, if any) and where the results
    are; one function so that both commands end on the same figures."""
    final = result.final if result.epochs else None
    if final is None or math.isnan(final.accuracy):
        figures = "no test accuracy (no test set)" if final is not None else "no epoch"
    else:
        figures = f"test accuracy {final.accuracy:.3f}"
    if final is not None and not math.isnan(final.held_out_accuracy):
        figures += f"; held-out accuracy {final.held_out_accuracy:.3f}"
    return f"{prog}: done; {figures}; results in {result.out_dir}"


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def run_command(prog: str, main: Callable[[], Coroutine[Any, Any, int]]) -> NoReturn:
    """Run ``main`` on uvloop when available; aiopipe errors become one line and exit 2.

    SIGINT (Ctrl-C) and SIGTERM stop it in order: ``main`` is cancelled (a server tells
    its devices and keeps its finished epochs' metrics). SIGINT is handled even when the
    process inherited it ignored (started in the background by a shell).

    Exit codes: 0 success, 1 training failed at run time, 2 bad arguments or config,
    130 interrupted (SIGINT), 143 terminated (SIGTERM).
    """
    level = os.environ.get("AIOPIPE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level if level in _LEVELS else "INFO",
                        format=f"%(asctime)s {prog}: %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    terminated = False

    async def until_terminated() -> int:
        nonlocal terminated
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None

        def terminate() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            return await main()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        try:
            import uvloop
        except ImportError:
            code = asyncio.run(until_terminated())
        else:
            code = uvloop.run(until_terminated())
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except AiopipeError as exc:
        print(f"{prog}: failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except asyncio.CancelledError:
        if not terminated:
            raise
        print(f"{prog}: terminated", file=sys.stderr)
        sys.exit(143)
    sys.exit(code)


def parse(parser: ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``)."""
    return parser.parse_args(argv)
