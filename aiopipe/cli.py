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
import warnings
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn

from aiopipe.cli_help import (
    COMMON,
    OPERATIONS,
    TopicHelp,
    group_title,
    option_help,
    system_groups,
    with_default,
)
from aiopipe.config import (
    MODES,
    OUTLIERS,
    PRIVACY_METHODS,
    RESCHEDULINGS,
    SCHEDULES,
    RunConfig,
)
from aiopipe.config_options import fold_system_tables, system_keys, warn_flat_keys
from aiopipe.config_toml import read_run_keys
from aiopipe.config_values import HPP_PLANNERS, LOCAL_OPTIMIZERS
from aiopipe.errors import AiopipeError, ConfigError
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.runtime.systems.fedbuff.options import STALENESS
from aiopipe.runtime.systems.registry import option_owners, options_of

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
    """Options that override the config file's keys, in groups (aiopipe.cli_help): the
    common options, each system's, the network's and operations'. On a parser made
    with ``add_help=False``, ``-h, --help [MODE]`` too: every option, or the common
    options and one mode's (`aiopipe.cli_help.TopicHelp`)."""
    if "--help" not in parser._option_string_actions:
        parser.add_argument("-h", "--help", action=TopicHelp,
                            help="show the options and exit; with a MODE (pipar, hadfl...): "
                                 "the common options and that mode's alone")
        if parser.usage is None:
            parser.usage = "%(prog)s [-h [MODE]] [--config FILE] [--mode MODE] [OPTION ...]"
    run = parser.add_argument_group(COMMON)
    systems = []
    for modes, own, elsewhere in system_groups():
        tables = " or ".join(f"[{options_of(mode).table}]" for mode in modes)
        also = (f" Also: {', '.join(_flag(key) for key in elsewhere)} (listed above)."
                if elsewhere else "")
        systems.append((parser.add_argument_group(
            group_title(modes), f"In a config file: under {tables}.{also}"), modes, own))
    operations = parser.add_argument_group(OPERATIONS)
    run.add_argument("--config", type=Path, metavar="FILE",
                     help="TOML file with run keys (see docs/systems/index.md)")
    run.add_argument("--mode", help=f"training mode: {', '.join(MODES)} or module:attribute, "
                                    "a system of your own (default pipar); --help MODE: its "
                                    "options")
    run.add_argument("--model", help="model name (vgg5, resnet18, mobilenetv3-small, vgg16, "
                                     "resnet101, mobilenetv3-large) or module:function, a "
                                     "factory of the nn.Sequential of split units "
                                     "(default vgg5)")
    run.add_argument("--loss", help="cross-entropy (default; over the output's last "
                                    "dimension), mse, or module:function, a factory of "
                                    "loss(output, target)")
    run.add_argument("--metric", help="what is reported as accuracy: accuracy (default), "
                                      "none (the loss alone) or module:function, a factory "
                                      "of metric(output, target), a micro-batch's "
                                      "per-sample scores in [0, 1] summed")
    run.add_argument("--optimizer", help="sgd (default) or module:function, a factory "
                                         "called with params, learning_rate, momentum")
    run.add_argument("--train-hook", help="module:function, a factory of a hook that may "
                                          "change the devices' loss and gradients before "
                                          "each step, with the round's global weights at "
                                          "hand (fl, sl, sfl, pipar; default none; "
                                          "aggregation fedprox brings its own)")
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
    run.add_argument("--aggregation-every", type=int,
                     help="FedAvg every this many iterations (0 = every epoch)")
    run.add_argument("--devices-per-round", type=_count_or_fraction,
                     help="devices sampled to train in each round: a count, or a fraction "
                          "in (0, 1) of the devices; 0: every device (fl, sl, sfl, pipar)")
    run.add_argument("--learning-rate", type=float, help="SGD learning rate")
    run.add_argument("--momentum", type=float, help="SGD momentum")
    run.add_argument("--seed", type=int, help="random seed")
    run.add_argument("--out-dir", help="results directory (default runs/<date-time>; one "
                                       "that holds results is refused)")
    run.add_argument("--explain", action="store_true",
                     help="with --mode auto: print each candidate system's predicted epoch "
                          "for the declared fleet (device slowdown, network, samples) and "
                          "what auto would choose, then exit without training")
    for group, modes, keys in systems:  # each one's help is its system's
        for key in keys:
            group.add_argument(_flag(key), help=option_help(key, modes),
                               **_SYSTEM_FLAGS[key])
    operations.add_argument("--network", help="network preset: 4g, 4g+, wifi or lan")
    operations.add_argument("--device-slowdown", type=_float_list,
                            help="compute slowdown factor(s) >= 1 to emulate slow devices")
    operations.add_argument("--no-shaping", dest="shape_links", action="store_false",
                            default=None,
                            help="do not pace websocket senders at the network's rates (use "
                                 "when the network is really shaped, e.g. by tc; by default "
                                 "they are)")
    operations.add_argument("--device-timeout", type=float,
                            help="seconds of silence before a device connection is given up "
                                 "(mode ftpipehd: also how long device 0 waits for the same "
                                 "gradients before its round stops and is played again)")
    operations.add_argument("--reconnect-grace", type=float,
                            help="seconds a disconnected device has to reconnect before its "
                                 "round goes on without it (default 10)")
    operations.add_argument("--heartbeat-interval", type=float,
                            help="seconds between heartbeats")
    operations.add_argument("--no-device-profiles", dest="profile_devices",
                            action="store_false", default=None,
                            help='with "auto" (asteroid: any plan), plan from the server\'s '
                                 "own table times each device's --device-slowdown instead of "
                                 "the devices' own measurements (by default devices profile "
                                 "themselves, once per machine and model: kept in the cost "
                                 "cache, $AIOPIPE_COST_CACHE, 'off' to measure every run)")
    operations.add_argument("--device-memory-mb", type=_float_list,
                            help='memory budget per device for "auto" plans, MB (0 = '
                                 "unlimited)")
    defaults = RunConfig().to_mapping()
    owners = option_owners()
    for action in (a for group in (run, *(g for g, _, _ in systems), operations)
                   for a in group._group_actions):
        if action.dest in RUN_OPTION_KEYS and action.help:
            key = action.dest
            default = (options_of(owners[key][0]).defaults()[key] if key in owners
                       else defaults[key])
            action.help = with_default(action.help, default, action)


def _flag(key: str) -> str:
    """A config key's command-line flag: ``ring_size``, ``--ring-size``."""
    return "--" + key.replace("_", "-")


def _keyword_arguments(text: str) -> dict[str, Any]:
    """``--aggregation-options``'s value: ``key=value,key=value``, each value an
    integer, a number, true/false or else a string."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, equals, value = item.partition("=")
        if not equals or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(f"expected key=value,key=value, got {text!r}")
        out[key.strip()] = _scalar(value.strip())
    return out


def _scalar(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


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


#: How each system option's flag reads its value (what it means: its system's words).
_SYSTEM_FLAGS: dict[str, dict[str, Any]] = {
    "partition": {"type": _int_list},
    "stage_groups": {"type": _groups},
    "rescheduling": {"choices": RESCHEDULINGS},
    "planner": {"choices": HPP_PLANNERS},
    "schedule": {"choices": SCHEDULES},
    "local_steps": {"type": _steps},
    "staleness": {"choices": STALENESS},
    "candidates": {"type": lambda text: text.split(","), "metavar": "MODE,..."},
    "replan": {"action": "store_true", "default": None},
    "rechoose": {"action": argparse.BooleanOptionalAction, "default": None},
    "secure_aggregation": {"action": "store_true", "default": None},
    "aggregation": {"metavar": "STRATEGY"},
    "aggregation_options": {"type": _keyword_arguments, "metavar": "K=V,..."},
    "outliers": {"choices": OUTLIERS},
    "privacy": {"choices": PRIVACY_METHODS},
    "local_optimizer": {"choices": LOCAL_OPTIMIZERS},
    **{key: {"type": int} for key in (
        "version_aggregation", "global_replication_every", "first_repartition_after",
        "chain_replication_every", "warmup_epochs", "sync_periods", "ring_size", "group_size",
        "inter_group_every", "buffer_size", "concurrency", "server_lanes")},
    **{key: {"type": float} for key in (
        "warmup_learning_rate", "version_smoothing", "ring_timeout", "server_learning_rate",
        "privacy_noise", "dp_noise_multiplier", "dp_max_grad_norm", "dp_delta",
        "secure_aggregation_clip", "trim_fraction", "outlier_limit", "replan_threshold")},
}


RUN_OPTION_KEYS = ("mode", "model", "loss", "metric", "optimizer", "dataset", "test_samples",
                   "devices", "samples_per_device", "batch_size", "epochs", "split_point",
                   "parallel_batches", "network", "device_slowdown", "aggregation_every",
                   "learning_rate", "seed", "out_dir", "shape_links", "device_timeout",
                   "heartbeat_interval", "reconnect_grace", "replan", "device_memory_mb",
                   "partition", "stage_groups", "planner", "rescheduling", "schedule",
                   "profile_devices", "aggregation", "aggregation_options", "train_hook",
                   "outliers",
                   "version_aggregation", "momentum", "global_replication_every",
                   "chain_replication_every", "first_repartition_after", "warmup_epochs",
                   "warmup_learning_rate", "local_steps", "sync_periods", "ring_size",
                   "version_smoothing", "ring_timeout", "group_size", "inter_group_every",
                   "buffer_size", "server_learning_rate", "staleness", "concurrency", "privacy",
                   "privacy_noise", "dp_noise_multiplier", "dp_max_grad_norm", "dp_delta",
                   "server_lanes", "devices_per_round", "secure_aggregation",
                   "secure_aggregation_clip", "candidates", "trim_fraction", "outlier_limit",
                   "replan_threshold", "rechoose", "local_optimizer")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The config file (if any), then the options given on the command line (a system's
    among them: ``--ring-size`` sets the run's ``[hadfl]`` ring_size).

    Raises:
        ConfigError: the file or a value is invalid.
    """
    overrides = {k: getattr(args, k) for k in RUN_OPTION_KEYS if getattr(args, k) is not None}
    flags = system_keys(overrides)
    values: dict[str, Any] = {}
    if args.config is not None:
        where = f"config file {str(args.config)!r}"
        data = read_run_keys(args.config)
        mode = str(overrides.get("mode") or data.get("mode") or RunConfig().mode)
        values, flat = fold_system_tables(data, mode, where=where)
        if flat:
            warn_flat_keys(flat, f"{where}'s top level", table=options_of(mode).table)
        if values.get("model") == "custom":
            raise ConfigError("a config file cannot hold a custom model")
    values.update(overrides)
    values["options"] = {**values.get("options", {}), **flags}
    return RunConfig.from_mapping(values)


TABLE_HEADER = (f"{'epoch':>5} {'time s':>8} {'loss':>7} {'test acc':>8} {'train acc':>9} "
                f"{'dev busy':>8} {'srv busy':>8} {'up MB':>7} {'down MB':>7}")


def explained(args: argparse.Namespace) -> bool:
    """With ``--explain``: print mode auto's predicted epochs and choice for the config
    (`aiopipe.api.explain_auto`); whether it did (the command then ends).

    Raises:
        ConfigError: the config is invalid, or not mode auto's.
    """
    if not args.explain:
        return False
    from aiopipe.api import explain_auto  # torch: only when asked

    print(explain_auto(config_from_args(args)), flush=True)
    return True


def epoch_row(m: EpochMetrics) -> str:
    """One line of the per-epoch table (and the devices' held-out accuracy, if any)."""
    row = (f"{m.epoch:>5} {m.time_s:>8.2f} {m.loss:>7.4f} {m.accuracy:>8.3f} "
           f"{m.train_accuracy:>9.3f} {m.busy_s['device']:>8.2f} {m.busy_s['server']:>8.2f} "
           f"{m.bytes_up / 1e6:>7.1f} {m.bytes_down / 1e6:>7.1f}")
    if m.device_accuracy:
        row += f"  held-out {m.held_out_accuracy:.3f}"
    if not math.isnan(m.epsilon):  # differential privacy's, from the accountant
        row += f"  epsilon {m.epsilon:.3g} (delta {m.delta:g}, per {m.privacy_unit})"
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


def _log_warning(message: Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None) -> None:
    """A warning (the old flat config keys' `FutureWarning`...) as one log line."""
    logging.getLogger("aiopipe").warning("%s: %s", category.__name__, message)


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
    warnings.showwarning = _log_warning
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
