"""The run's model, loss and optimizer, built the same way on every node from its config.

`RunConfig.model`, ``loss`` and ``optimizer`` name either aiopipe's own (a zoo model,
"cross-entropy", "sgd") or a user's factory as ``module:function`` (`aiopipe.entrypoints`):

- a model factory is called with ``num_classes`` and ``in_shape`` (those it declares) and
  returns the ``nn.Sequential`` of split units (or a list of units); torch's generator is
  seeded with ``config.seed`` first, so every node builds the same initial weights;
- a loss factory is called with nothing and returns ``loss(logits, labels)``, the mean
  loss of a micro-batch (a scalar tensor);
- an optimizer factory is called with ``params`` and, if it declares them,
  ``learning_rate`` and ``momentum``, and returns a ``torch.optim.Optimizer``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.entrypoints import call_factory, is_entry_point, load_entry_point
from aiopipe.errors import ConfigError

__all__ = ["Loss", "build_model", "make_loss", "make_optimizer"]

#: The mean loss of a micro-batch from its logits and labels.
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_model(config: RunConfig, *, num_classes: int, in_shape: Sequence[int]
                ) -> nn.Sequential:
    """The whole model, initialized deterministically from ``config.seed``.

    Raises:
        ConfigError: an unknown model name, shapes it cannot take, or a factory that
            fails or returns something else than split units.
    """
    torch.manual_seed(config.seed)
    model = config.model
    if not isinstance(model, str):
        return copy.deepcopy(models.as_sequential(model))
    if is_entry_point(model):
        made = call_factory(load_entry_point(model, what="model"), model, what="model",
                            num_classes=num_classes, in_shape=tuple(in_shape))
        try:
            return models.as_sequential(made)
        except ConfigError as exc:
            raise ConfigError(f"model {model!r} returned {type(made).__name__}: {exc}"
                              ) from None
    shape = tuple(in_shape)
    if len(shape) != 3:
        raise ConfigError(f"model {model!r} takes images (channels, height, width); the "
                          f"data's inputs have shape {shape}")
    return models.build(model, num_classes=num_classes, in_shape=(shape[0], shape[1],
                                                                   shape[2]))


def make_loss(config: RunConfig) -> Loss:
    """The run's loss.

    Raises:
        ConfigError: the factory fails or returns something that is not callable.
    """
    if config.loss == "cross-entropy":
        return nn.functional.cross_entropy
    made = call_factory(load_entry_point(config.loss, what="loss"), config.loss, what="loss")
    if not callable(made):
        raise ConfigError(f"loss {config.loss!r} returned {type(made).__name__}, not a "
                          "callable loss(logits, labels)")
    return made  # type: ignore[no-any-return]


def make_optimizer(module: nn.Module, config: RunConfig, *,
                   previous: tuple[nn.Module, torch.optim.Optimizer] | None = None
                   ) -> torch.optim.Optimizer:
    """The run's optimizer for one stage; with ``previous`` (an older stage of the same
    model and its optimizer), each parameter both hold by name keeps its state (SGD's
    momentum; see aiopipe.runtime.replan [Note: switching]).

    Raises:
        ConfigError: the factory fails or returns no optimizer.
    """
    if config.optimizer == "sgd":
        optimizer: Any = torch.optim.SGD(module.parameters(), lr=config.learning_rate,
                                         momentum=config.momentum)
    else:
        optimizer = call_factory(load_entry_point(config.optimizer, what="optimizer"),
                                 config.optimizer, what="optimizer",
                                 params=list(module.parameters()),
                                 learning_rate=config.learning_rate,
                                 momentum=config.momentum)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer {config.optimizer!r} returned "
                              f"{type(optimizer).__name__}, not a torch.optim.Optimizer")
    if previous is not None:
        old_module, old_optimizer = previous
        states = {name: old_optimizer.state.get(param)
                  for name, param in old_module.named_parameters()}
        for name, param in module.named_parameters():
            state = states.get(name)
            if state:
                optimizer.state[param] = {key: value.clone() if isinstance(
                    value, torch.Tensor) else value for key, value in state.items()}
    return optimizer  # type: ignore[no-any-return]
