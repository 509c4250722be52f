"""The run's model, loss and optimizer, built the same way on every node from its config.

`RunConfig.model`, ``loss`` and ``optimizer`` name either aiopipe's own (a zoo model,
"cross-entropy", "sgd") or a user's factory as ``module:function`` (`aiopipe.entrypoints`);
in-process, ``model`` may also be the factory itself (a callable) or a user's module:

- a model factory is called with ``num_classes`` and ``in_shape`` (those it declares) and
  returns the ``nn.Sequential`` of split units (or a list of units); torch's generator is
  seeded with ``config.seed`` first, so every node builds the same initial weights;
- a user's ``nn.Sequential`` is copied, and with ``initial_weights`` "seed" (the
  default) the copy is re-initialised from ``config.seed`` (`reinitialise`): the initial
  weights are a function of the config alone, whatever state the global generator was in
  when the user built the module ([Note: initial weights]); with "given" the copy keeps
  the module's own (pretrained) weights;
- a loss factory is called with nothing and returns ``loss(output, target)``, the mean
  loss of a micro-batch (a scalar tensor), given the model's output and the target as
  they are (`aiopipe.data.DataKind`);
- a metric factory is called with nothing and returns ``metric(output, target)``: a
  score in [0, 1] per sample of the micro-batch, summed (a number or a 0-d tensor; the
  runs report the sum over an epoch's samples divided by their count, as accuracy);
  "accuracy" is a classifier's, "none" reports the loss alone;
- an optimizer factory is called with ``params`` and, if it declares them,
  ``learning_rate`` and ``momentum``, and returns a ``torch.optim.Optimizer``.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.data.kind import DataKind
from aiopipe.entrypoints import call_factory, is_entry_point, load_entry_point
from aiopipe.errors import ConfigError
from aiopipe.models.crossing import Crossing, crossing_of, example, leaves
from aiopipe.models.initialisers import initialiser, parameters_not_reset

__all__ = ["Loss", "Metric", "ModelTemplate", "accuracy", "build_model", "cross_entropy",
           "make_loss", "make_metric", "make_optimizer", "model_template",
           "optimizer_states", "parameters_not_reset", "reinitialise", "scored",
           "unit_crossings"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: The mean loss of a micro-batch from the model's output (one tensor, or a tuple) and
#: the target.
Loss = Callable[[Any, torch.Tensor], torch.Tensor]
#: A micro-batch's per-sample scores in [0, 1], summed, from the model's output and the
#: target.
Metric = Callable[[Any, torch.Tensor], "torch.Tensor | float"]


def build_model(config: RunConfig, *, num_classes: int, in_shape: Sequence[int]
                ) -> nn.Sequential:
    """The whole model, initialized deterministically from ``config.seed``.

    Raises:
        ConfigError: an unknown model name, shapes it cannot take, or a factory that
            fails or returns something that is not a model (any ``nn.Module``: one that
            is not an ``nn.Sequential`` of units is traced, `aiopipe.models.as_units`).
    """
    with _BUILDING:
        return _build(config, num_classes=num_classes, in_shape=in_shape)


def _build(config: RunConfig, *, num_classes: int, in_shape: Sequence[int]) -> nn.Sequential:
    torch.manual_seed(config.seed)
    model = config.model
    if isinstance(model, nn.Module):
        copied = copy.deepcopy(models.as_units(model))
        return copied if config.initial_weights == "given" else reinitialise(copied)
    if not isinstance(model, str) or is_entry_point(model):
        if isinstance(model, str):
            factory, name = load_entry_point(model, what="model"), model
        else:  # the in-process twin of module:function
            factory, name = model, getattr(model, "__qualname__", repr(model))
        made = call_factory(factory, name, what="model", num_classes=num_classes,
                            in_shape=tuple(in_shape))
        try:
            return models.as_units(made)
        except ConfigError as exc:
            raise ConfigError(f"model {name!r} returned {type(made).__name__}: {exc}"
                              ) from None
    return models.build(model, num_classes=num_classes, in_shape=tuple(in_shape))


def reinitialise(model: ModuleT) -> ModuleT:
    """``model`` with every module's parameters drawn again, in place, from the global
    generator (seeded by the caller): each module's `initialiser` is called
    after its children's, as when the model was constructed (a parent such as
    ``nn.MultiheadAttention`` sets some of its children's parameters itself).

    [Note: initial weights] A user's module carries weights drawn from whatever state the
    global generator was in when the user built it: two runs of one config function
    (each building a new module) started from different weights, depending on what ran
    before them in the process. Re-drawing them under ``config.seed`` makes a run's
    initial weights a function of its config alone, as a zoo name's or a factory's are
    (docs/design.md §Initial weights). `RunConfig` refuses a module with parameters that
    no initialiser covers (`parameters_not_reset`) unless its weights are "given".

    Raises:
        ConfigError: an initialiser failed (the message names its module).
    """
    with torch.no_grad():
        for name, module in _children_first(model, ""):
            initialise = initialiser(module)
            if initialise is None:
                continue
            try:
                initialise()
            except Exception as exc:
                raise ConfigError(f"model: re-initialising {name or 'the model'} "
                                  f"({type(module).__name__}) from the seed failed: "
                                  f"{type(exc).__name__}: {exc}") from None
    return model


def _children_first(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s submodules, each after its children (each module once)."""
    seen: set[int] = set()

    def walk(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            yield from walk(child, f"{name}.{child_name}" if name else child_name)
        yield name, module

    return walk(module, name)


@dataclass(frozen=True, slots=True)
class ModelTemplate:
    """The run's initial model, shared: read it or copy its units, never train it."""

    model: nn.Sequential
    #: `aiopipe.models.model_digest` of it
    digest: str
    #: what crosses each cut per sample: the model's input, then after each unit
    #: (`aiopipe.models.crossing`)
    crossings: tuple[Crossing, ...]


#: [Note: shared templates] the templates built, newest last, each with the global
#: generator's state right after it was built, and what it was built from (a user's
#: model object stays alive while its identity is a key)
_TEMPLATES: dict[tuple[Any, ...], tuple[ModelTemplate, torch.Tensor, object]] = {}
_KEPT_TEMPLATES = 4
#: one build at a time (`build_model`, `model_template`): the nodes of an in-process
#: run on the system clock open their holdings in their own compute threads, and two
#: builds drawing from the one global generator at once would get each other's numbers
_BUILDING = threading.RLock()


def model_template(config: RunConfig, data: DataKind) -> ModelTemplate:
    """The run's initial model as `build_model` builds it for data of the kind ``data``,
    shared by every caller in this process with the same model, seed and kind of data
    ([Note: shared templates]).

    [Note: shared templates] Every device of an in-process simulation built its own
    whole model, although it trains only its stage of it and the stage's weights come
    with each round: 2.2 MiB of vgg5 per device, 22 GiB for 10,000 devices. A device
    now copies its stage's units from the process's one template when it trains. A
    template is built once per (model, seed, kind of data), and the global torch
    generator is left as that build left it, on later calls too, so that what draws from
    it next (dropout in training) draws the same numbers as when every device built its
    own. A user's model object (not a name) is keyed by its identity and the state of
    its tensors (`_object_key`), and how its initial weights are chosen; a user's factory
    (a callable) by its identity; either is kept alive while its template is kept.

    Raises:
        ConfigError: as `build_model`.
    """
    model = config.model
    with _BUILDING:
        key = (_model_key(config), config.seed, data)
        found = _TEMPLATES.pop(key, None)
        if found is None:
            built = build_model(config, num_classes=data.classes, in_shape=data.in_shape)
            template = ModelTemplate(built, models.model_digest(built),
                                     (data.inputs, *unit_crossings(built, data.inputs)))
            found = (template, torch.get_rng_state(), model)
            while len(_TEMPLATES) >= _KEPT_TEMPLATES:
                del _TEMPLATES[next(iter(_TEMPLATES))]
        else:
            torch.set_rng_state(found[1])
        _TEMPLATES[key] = found  # newest last
        return found[0]


def _model_key(config: RunConfig) -> tuple[object, ...]:
    """What the template of ``config.model`` depends on (besides the seed and shapes)."""
    model = config.model
    if isinstance(model, str):
        return ("name", model)
    if isinstance(model, nn.Module):
        return (config.initial_weights, *_object_key(model))
    return ("factory", id(model))


def _object_key(model: object) -> tuple[object, ...]:
    """A user's model object as a template key: its identity and, per tensor of its
    state, where it lives and its in-place version counter, so that a model changed
    between two runs (weights loaded or trained) is built again."""
    state = model.state_dict() if isinstance(model, nn.Module) else {}
    return (id(model), *((t.data_ptr(), t._version) for t in state.values()))


def unit_crossings(model: nn.Sequential, inputs: Crossing) -> list[Crossing]:
    """What every unit's output is per sample (one dry forward pass of two samples of
    zeros as ``inputs`` describes the model's input), leaf by leaf.

    Raises:
        ConfigError: a unit's output is not a tensor or a flat tuple of tensors, or a
            value it passes on does not hold the samples' rows first.
    """
    crossings = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            x: object = example(inputs, 2)
            for u, unit in enumerate(model.children()):
                x = unit(x)
                crossing = crossing_of(x)
                rowless = [i for i, t in enumerate(leaves(x)) if t.shape[0] != 2]
                if rowless:
                    shape = tuple(leaves(x)[rowless[0]].shape)
                    raise ConfigError(
                        f"unit {u} passes on value {rowless[0]} of shape {shape}, which "
                        "does not hold the samples' rows first: every value that crosses "
                        "a cut must (make it per sample, e.g. expand a mask to the batch, "
                        "or compute it inside the child that uses it)")
                crossings.append(crossing)
    finally:
        model.train(was_training)
    return crossings


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of scores over the last dimension of ``output`` against
    the class indices ``target`` of its shape without that dimension: a class per sample
    (``[B, C]`` and ``[B]``) or per position (a language model's ``[B, T, V]`` and
    ``[B, T]``, the mean over every position)."""
    if output.dim() > 2:
        return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())
    return nn.functional.cross_entropy(output, target)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sample, the fraction of its class indices in ``target`` that ``output``'s
    highest score over the last dimension names (1 or 0 for a class per sample; the
    fraction of positions right for a class per token), summed over the samples: a
    classifier's correct predictions."""
    right = output.argmax(-1) == target
    if right.dim() == 1:
        return right.sum()
    return right.flatten(1).double().mean(1).sum()


#: The losses and metrics known by name.
_LOSSES: dict[str, Loss] = {"cross-entropy": cross_entropy,
                            "mse": nn.functional.mse_loss}
_METRICS: dict[str, Metric] = {"accuracy": accuracy}


def make_loss(config: RunConfig) -> Loss:
    """The run's loss: "cross-entropy" (`cross_entropy`), "mse" (the mean squared error
    of a float target of the output's shape) or a user's factory.

    Raises:
        ConfigError: the factory fails or returns something that is not callable.
    """
    if config.loss in _LOSSES:
        return _LOSSES[config.loss]
    made = call_factory(load_entry_point(config.loss, what="loss"), config.loss, what="loss")
    if not callable(made):
        raise ConfigError(f"loss {config.loss!r} returned {type(made).__name__}, not a "
                          "callable loss(output, target)")
    return made  # type: ignore[no-any-return]


def make_metric(config: RunConfig) -> Metric | None:
    """The run's metric: "accuracy" (`accuracy`), a user's factory, or None for
    "none" (the loss alone is reported).

    Raises:
        ConfigError: the factory fails or returns something that is not callable.
    """
    if config.metric == "none":
        return None
    if config.metric in _METRICS:
        return _METRICS[config.metric]
    made = call_factory(load_entry_point(config.metric, what="metric"), config.metric,
                        what="metric")
    if not callable(made):
        raise ConfigError(f"metric {config.metric!r} returned {type(made).__name__}, not a "
                          "callable metric(output, target)")
    return made  # type: ignore[no-any-return]


def scored(output: Any, target: torch.Tensor, loss: torch.Tensor, metric: Metric | None
           ) -> tuple[float, float]:
    """A micro-batch's loss and accuracy summed over its samples (the mean ``loss``
    times the rows, and ``metric``'s sum): what a round or an evaluation adds up.

    Raises:
        ValueError: the metric is not a number in [0, rows].
    """
    rows = len(target)
    if metric is None:
        return float(loss.detach()) * rows, 0.0
    value = metric(output.detach() if isinstance(output, torch.Tensor) else output, target)
    score = float(value.detach() if isinstance(value, torch.Tensor) else value)
    if not 0.0 <= score <= rows:
        raise ValueError(f"the metric must be the micro-batch's per-sample scores in [0, 1] "
                         f"summed, at most its {rows} rows; got {score!r}")
    return float(loss.detach()) * rows, score


def make_optimizer(module: nn.Module, config: RunConfig, *,
                   previous: Mapping[str, Mapping[str, Any]] | None = None
                   ) -> torch.optim.Optimizer:
    """The run's optimizer for one stage; with ``previous`` (an optimizer's state by
    parameter name, `optimizer_states`), each parameter of ``module`` named there starts
    from a copy of that state (SGD's momentum; see aiopipe.runtime.systems.star.replan [Note:
    switching]).

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
    for name, param in module.named_parameters() if previous else ():
        state = previous.get(name) if previous else None
        if state:
            optimizer.state[param] = {key: value.clone() if isinstance(
                value, torch.Tensor) else value for key, value in state.items()}
    return optimizer  # type: ignore[no-any-return]


def optimizer_states(module: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> dict[str, dict[str, Any]]:
    """``optimizer``'s state of each of ``module``'s parameters that has one, by the
    parameter's name (not copied): what `make_optimizer` carries over."""
    return {name: dict(state) for name, param in module.named_parameters()
            if (state := optimizer.state.get(param))}
