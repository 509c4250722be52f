"""Where training stands, as the coordinator's checkpoints keep it, and reading it back.

A checkpoint (aiopipe.runtime.checkpoint) holds, besides tensors, this meta: the run's
config, the epoch and round it was written before, the run's round count, the epoch's
tally (aiopipe.runtime.epoch_figures) and the finished epochs' metrics. A resumed run
takes it back only when the checkpoint is the same run's.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from aiopipe.config import RunConfig
from aiopipe.config_options import flat_config
from aiopipe.errors import ConfigError
from aiopipe.metrics.epoch import counts_by_device
from aiopipe.metrics.results import EpochMetrics
from aiopipe.runtime.checkpoint import load_checkpoint
from aiopipe.runtime.epoch_figures import new_tally

__all__ = ["checkpoint_meta", "epoch_from", "read_resumable"]

log = logging.getLogger("aiopipe.server")


def checkpoint_meta(config: RunConfig, *, epoch: int, next_round: int, elapsed: float,
                    rounds: int, tally: Mapping[str, Any],
                    epochs: Sequence[EpochMetrics]) -> dict[str, Any]:
    """What a checkpoint holds besides tensors: config, position, tally, epochs (before
    ``epoch``'s round ``next_round``; ``elapsed``: seconds of the epoch so far)."""
    # a deep copy: the next round adds to the tally's lists while the file is written
    kept = copy.deepcopy(dict(tally)) if next_round else new_tally(epoch, config.devices)
    kept["elapsed_before"] = float(kept.get("elapsed_before", 0.0)) + elapsed
    return {"config": config.to_mapping(), "epoch": epoch,
            "rounds": rounds, "tally": {**kept, "epoch": epoch, "next_round": next_round},
            "epochs": [e.to_mapping() for e in epochs]}


class Resumable(Protocol):
    """What `read_resumable` asks of a system (aiopipe.runtime.systems.base.System)."""

    #: config keys a resumed run takes from its checkpoint (the plans "auto" chose)
    planned_keys: tuple[str, ...]

    def resumed_config(self, mode: str) -> RunConfig:
        """The config a checkpoint written in ``mode`` must hold."""
        ...


def read_resumable(directory: Path, system: Resumable
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint in ``directory``, once it is for the run ``system`` trains (its
    config as it runs the mode the checkpoint was written in: `System.resumed_config`;
    the ``planned_keys``, what "auto" chose, are the checkpoint's). Its meta's config
    becomes one level of keys (`flat_config`), as `System.restore` reads it.

    Raises:
        ConfigError: none there, or it is another run's.
    """
    tensors, meta = load_checkpoint(directory)
    saved_config = dict(meta.get("config", {}))
    # a key the checkpoint's version did not have ran as its default does; one level of
    # keys, the system's options among them (an older checkpoint's are already so)
    run = system.resumed_config(str(saved_config.get("mode", "")))
    defaults = RunConfig(mode=str(saved_config.get("mode", run.mode))).to_mapping()
    meta["config"] = {**flat_config(defaults), **flat_config(saved_config)}
    saved = dict(meta["config"])
    current = flat_config(run.to_mapping())
    for key in ("out_dir", *system.planned_keys):  # "auto" plans: the checkpoint's
        saved.pop(key, None)
        current.pop(key, None)
    if saved != current:
        changed = sorted(k for k in set(saved) | set(current)
                         if saved.get(k) != current.get(k))
        raise ConfigError(f"the checkpoint in {str(directory)!r} is for another run "
                          f"(different {', '.join(changed)})")
    log.warning("resuming at epoch %d, its round %d, from %s", int(meta["epoch"]) + 1,
                int(meta["tally"]["next_round"]) + 1, directory)
    return tensors, meta


def epoch_from(values: Mapping[str, Any]) -> EpochMetrics:
    """A finished epoch's metrics as a checkpoint keeps them (`EpochMetrics.to_mapping`)."""
    fields = dict(values)
    fields["epoch"] = int(fields["epoch"])  # from 1, as in metrics.jsonl and EpochMetrics
    fields["device_samples"] = counts_by_device(fields.get("device_samples", ()))
    fields["devices_lost"] = tuple(fields.get("devices_lost", ()))
    fields["updates_refused"] = tuple(fields.get("updates_refused", ()))
    fields["stages"] = tuple(fields.get("stages", ()))
    fields["links"] = dict(fields.get("links", {}))
    fields["device_accuracy"] = dict(fields.get("device_accuracy", {}))
    fields["changes"] = tuple(fields.get("changes", ()))
    fields["peer_bytes"] = tuple(fields.get("peer_bytes", ()))
    fields["sampled"] = tuple(tuple(r) for r in fields.get("sampled", ()))
    fields["devices_excluded"] = tuple(fields.get("devices_excluded", ()))
    fields["device_epsilon"] = dict(fields.get("device_epsilon", {}))
    for name in ("held_out_accuracy", "accuracy", "loss", "train_accuracy", "perplexity",
                 "epsilon", "delta"):
        if fields.get(name) is None:  # NaN is null in JSON
            fields[name] = math.nan
    return EpochMetrics(**fields)
