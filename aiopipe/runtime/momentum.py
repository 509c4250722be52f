"""A stage's SGD momentum on the wire, shared by every system that moves a stage's
state between nodes with its momentum (a pipeline's rounds, FTPipeHD's chain replicas,
Asteroid's backups): momentum buffers travel beside the weights, named ``MOMENTUM`` +
the parameter's name."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aiopipe.config import RunConfig
from aiopipe.models import without_frozen
from aiopipe.runtime.stage import StageWork

__all__ = ["MOMENTUM", "backs_up_momentum", "load_momentum", "split_momentum",
           "stage_snapshot", "trainable_parameters"]

#: How a parameter's momentum buffer is named in a round's tensors (no parameter name
#: holds a colon).
MOMENTUM = "momentum:"


def split_momentum(state: Mapping[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A round's tensors as (the state dict, the momentum buffers by parameter name)."""
    weights = {k: v for k, v in state.items() if not k.startswith(MOMENTUM)}
    momentum = {k[len(MOMENTUM):]: v for k, v in state.items() if k.startswith(MOMENTUM)}
    return weights, momentum


def backs_up_momentum(config: RunConfig) -> bool:
    """Whether replicas and backups hold SGD's momentum buffers: with momentum, when
    the run's optimizer is SGD (another optimizer's state is not backed up: a stage
    restored from a backup restarts it)."""
    return bool(config.momentum) and config.optimizer == "sgd"


def stage_snapshot(work: StageWork, *, momentum: bool) -> dict[str, torch.Tensor]:
    """A CPU copy of a stage's state less its frozen parameters, and with ``momentum``
    each trainable parameter's SGD momentum buffer (zeros where it has none yet): what
    a stage backup holds (`expected_tensors`) and a pipeline's round returns. A frozen
    parameter never changes and every node holds it ([Note: frozen bases] in
    aiopipe/runtime/systems/star/coordinator.py), so it travels nowhere."""
    state = without_frozen(work.trained_state(), work.module)
    if momentum:
        for name, param in trainable_parameters(work.module):
            buffer = work.optimizer.state.get(param, {}).get("momentum_buffer")
            state[MOMENTUM + name] = (buffer.detach().to("cpu", copy=True)
                                      if isinstance(buffer, torch.Tensor)
                                      else torch.zeros_like(param, device="cpu"))
    return state


def trainable_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``module``'s parameters that train (``requires_grad``), by name: the only ones
    with momentum, on the wire or held."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def load_momentum(work: StageWork, momentum: Mapping[str, torch.Tensor]) -> None:
    """Set a stage's SGD momentum buffers, by parameter name, from a snapshot
    (`stage_snapshot`)."""
    for name, param in work.module.named_parameters():
        if name in momentum:
            work.optimizer.state[param]["momentum_buffer"] = momentum[name].to(
                param.device, copy=True)
