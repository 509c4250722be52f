"""Atomic server checkpoints at round boundaries, for ``--resume`` (DESIGN §7).

A checkpoint directory holds ``state-<n>.safetensors`` (tensors: the global model, the
weights of each server-half replica where they differ from the global model's, and each
replica's SGD momentum) and ``checkpoint.json`` (the run config, where training stands,
the finished epochs' metrics and the current epoch's tallies). Each file is written to a
temporary name, fsynced and renamed; ``checkpoint.json`` is written last and names its
state file, so a crash at any moment leaves the previous checkpoint whole. The server
writes it while training goes on ([Note: background checkpoints] in
aiopipe/runtime/checkpointing.py).

Training itself draws no random numbers (data order and initialization derive from the
seed), so no RNG state needs saving. Device-side optimizer state stays on the devices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from aiopipe.errors import ConfigError
from aiopipe.metrics.results import write_atomic

__all__ = ["CHECKPOINT_FILE", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FILE = "checkpoint.json"


def save_checkpoint(directory: str | Path, tensors: Mapping[str, torch.Tensor],
                    meta: Mapping[str, Any]) -> Path:
    """Write a checkpoint atomically; returns the path of ``checkpoint.json``.

    ``tensors`` must not change until it returns (pass a copy to write one while
    training goes on).

    Raises:
        OSError: the directory cannot be written.
    """
    from safetensors.torch import save

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    previous = _read_meta(path)
    generation = int(previous.get("generation", -1)) + 1 if previous else 0
    state_name = f"state-{generation}.safetensors"
    write_atomic(path / state_name,
                  save({k: v.detach().contiguous() for k, v in tensors.items()}))
    write_atomic(path / CHECKPOINT_FILE, json.dumps(
        {**meta, "generation": generation, "state": state_name}).encode())
    for old in path.glob("state-*.safetensors"):
        if old.name != state_name:
            old.unlink(missing_ok=True)
    return path / CHECKPOINT_FILE


def load_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata of the checkpoint in ``directory``.

    Raises:
        ConfigError: no checkpoint there, or it is unreadable.
    """
    from safetensors.torch import load_file

    path = Path(directory)
    meta = _read_meta(path)
    if not meta:
        raise ConfigError(f"no checkpoint in {str(path)!r} (expected {CHECKPOINT_FILE})")
    try:
        tensors = load_file(str(path / str(meta["state"])))
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"checkpoint in {str(path)!r} is unreadable: {exc}") from None
    return tensors, meta


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        text = (path / CHECKPOINT_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path / CHECKPOINT_FILE)!r}: {exc}") from None
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{str(path / CHECKPOINT_FILE)!r} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{str(path / CHECKPOINT_FILE)!r} does not hold a checkpoint")
    return meta
