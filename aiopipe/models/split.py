"""A model as a sequence of split units, and how it is cut in two.

A model is an ``nn.Sequential`` whose top-level children are the *split units* (PiPar's
"layers", pipar.txt Tables 2–3). `partition` cuts it into consecutive stages at any cut
points (a multi-device pipeline); splitting at ``P`` puts units 1..P on the device and
units P+1..Q on the server, where Q is the number of units; ``P == Q`` leaves everything
on the device (that is how FL runs) and ``P == 0`` everything on the server (the split
modes refuse it; that is their rule, not this module's).

The two halves *share* the original unit modules (nothing is copied) and keep the
original child names, so the halves' state-dict keys are exactly the whole model's keys
partitioned between them, in the same order: ``merge_states(device.state_dict(),
server.state_dict())`` is the whole model's state dict, and loading a state into the
whole model updates both halves. This is what lets the server stack M^s_k ⊕ M^c_k,
average, and split the result back by key.

[Note: batch-norm state]
Batch-norm running statistics (``running_mean``, ``running_var``) are buffers: they are in
the state dict, travel with the device half at aggregation, and are averaged by FedAvg
exactly like parameters (weighted by samples seen). ``num_batches_tracked`` is an int64
counter: FedAvg takes its weighted mean and rounds it to the nearest integer, keeping
the int64 dtype, so every entry of a state dict follows one rule (float entries averaged,
integer entries averaged then rounded). It only matters for ``momentum=None`` (a
cumulative average); every model in the zoo uses a fixed momentum. A unit never holds a
batch-norm layer and the layer it normalizes on different nodes, because units are never
split inside.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TypeVar

from torch import Tensor, nn

from aiopipe.errors import ConfigError

__all__ = ["as_sequential", "frozen_parameters", "merge_states", "model_digest",
           "partition", "split",
           "unit_count", "units_of", "without_frozen"]

T = TypeVar("T")

_ACCEPTED = (
    "an nn.Sequential whose top-level children are the split units, or a list (or tuple, "
    "or nn.ModuleList) of nn.Module units"
)


def as_sequential(model: nn.Module | Sequence[nn.Module]) -> nn.Sequential:
    """Return ``model`` as an ``nn.Sequential`` of split units.

    An ``nn.Sequential`` is returned as it is (the same object); a list, tuple or
    ``nn.ModuleList`` of modules becomes a new ``nn.Sequential`` of those same modules.

    Raises:
        ConfigError: ``model`` is anything else (another kind of module, a non-module
            element), or has no units.
    """
    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ConfigError("a model needs at least one unit; got an empty nn.Sequential")
        return model
    if isinstance(model, nn.ModuleList):
        units: list[object] = list(model)
    elif isinstance(model, nn.Module):
        raise ConfigError(
            f"a model must be {_ACCEPTED}; got a {type(model).__name__} "
            "(wrap its layers in nn.Sequential so the split points are explicit)"
        )
    elif isinstance(model, Sequence) and not isinstance(model, str | bytes):
        units = list(model)
    else:
        raise ConfigError(f"a model must be {_ACCEPTED}; got {type(model).__name__}")
    if not units:
        raise ConfigError(f"a model needs at least one unit; got an empty {type(model).__name__}")
    for index, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise ConfigError(
                f"a model must be {_ACCEPTED}; unit {index} is a {type(unit).__name__}"
            )
    return nn.Sequential(*(u for u in units if isinstance(u, nn.Module)))


def unit_count(model: nn.Sequential) -> int:
    """Number of split units (top-level children) of ``model``; 0 for an empty half.

    Raises:
        ConfigError: ``model`` is not an ``nn.Sequential`` (see `as_sequential`).
    """
    _require_sequential(model)
    return len(model)


def partition(model: nn.Sequential, cut_points: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` after each of ``cut_points``: ``len(cut_points) + 1`` stages in order.

    Stage s holds units ``cut_points[s-1]+1 .. cut_points[s]`` (1-based; the first from
    unit 1, the last to unit Q); a stage may be empty (an empty ``nn.Sequential`` returns
    its input). The stages share the original unit modules and keep their child names,
    so chaining them computes exactly ``model(x)`` and their state dicts partition the
    whole one. ``partition(model, [P])`` is ``split(model, P)``.

    Raises:
        ConfigError: ``model`` is not an ``nn.Sequential``, or the cut points are not
            integers in ``0..unit_count(model)`` in non-decreasing order.
    """
    _require_sequential(model)
    units = _named_units(model)
    previous = 0
    for point in cut_points:
        if isinstance(point, bool) or not isinstance(point, int):
            raise ConfigError(f"cut point must be an integer; got {point!r}")
        if not previous <= point <= len(units):
            raise ConfigError(
                f"cut points {list(cut_points)} must be non-decreasing in 0..{len(units)} "
                f"for a model of {len(units)} units"
            )
        previous = point
    bounds = [0, *cut_points, len(units)]
    return [nn.Sequential(OrderedDict(units[a:b])) for a, b in itertools.pairwise(bounds)]


def split(model: nn.Sequential, split_point: int) -> tuple[nn.Sequential, nn.Sequential]:
    """Cut ``model`` after unit ``split_point``: return ``(device_half, server_half)``.

    The device half holds units 1..split_point and the server half the rest; either may
    be empty (an empty ``nn.Sequential`` returns its input). Both share the original unit
    modules and keep their child names, so ``server_half(device_half(x))`` computes
    exactly ``model(x)`` and the halves' state dicts partition the whole one.

    Raises:
        ConfigError: ``model`` is not an ``nn.Sequential``, or ``split_point`` is not an
            integer in ``0..unit_count(model)``.
    """
    _require_sequential(model)
    if isinstance(split_point, bool) or not isinstance(split_point, int):
        raise ConfigError(f"split point must be an integer; got {split_point!r}")
    units = len(_named_units(model))
    if not 0 <= split_point <= units:
        raise ConfigError(
            f"split point {split_point} is out of range 0..{units} "
            f"for a model of {units} units"
        )
    device, server = partition(model, [split_point])
    return device, server


def units_of(model: nn.Sequential, first: int, stop: int) -> nn.Sequential:
    """Units ``first .. stop - 1`` (0-based) of ``model`` as one stage (shared modules).

    Raises:
        ConfigError: as `partition`.
    """
    return partition(model, [first, stop])[1]


def frozen_parameters(module: nn.Module) -> frozenset[str]:
    """The state-dict names of ``module``'s frozen parameters (``requires_grad`` false):
    a frozen base never changes, so it need not travel once every node holds it."""
    return frozenset(name for name, p in module.named_parameters() if not p.requires_grad)


def without_frozen(state: Mapping[str, T], module: nn.Module) -> dict[str, T]:
    """``state`` (of ``module``, or of a model holding it under the same names) less
    ``module``'s frozen parameters: what a system sends of it ([Note: frozen bases] in
    aiopipe/runtime/systems/star/coordinator.py); the receiver holds the rest."""
    frozen = frozen_parameters(module)
    return {name: value for name, value in state.items() if name not in frozen}


def merge_states(*states: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Merge state dicts with disjoint keys into one, in the order given.

    ``merge_states(device.state_dict(), server.state_dict())`` rebuilds the whole model's
    state dict from the two halves of `split`. The tensors are not copied.

    Raises:
        ConfigError: a key appears in more than one of ``states``.
    """
    merged: dict[str, Tensor] = {}
    for index, state in enumerate(states):
        for key, value in state.items():
            if key in merged:
                raise ConfigError(
                    f"cannot merge states: key {key!r} of state {index} is already present "
                    "(the states must come from disjoint halves of one model)"
                )
            merged[key] = value
    return merged


def _require_sequential(model: object) -> None:
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"expected an nn.Sequential of split units; got {type(model).__name__} "
            "(use aiopipe.models.as_sequential for a list of modules)"
        )


def _named_units(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    # ``named_children`` drops a module that appears twice (a shared nn.ReLU, say), which
    # would lose a unit; ``_modules`` keeps every entry with its name.
    units: list[tuple[str, nn.Module]] = []
    for name, unit in model._modules.items():
        if unit is None:
            raise ConfigError(f"unit {name!r} of the model is None")
        units.append((name, unit))
    return units


def model_digest(model: nn.Sequential) -> str:
    """A digest of ``model``'s structure (32 hex digits): each unit's module types in
    order and every state entry's name, shape and dtype, not their values. Two nodes
    that built the same model from the same code agree on it; a different version of a
    user's model code, another number of classes or another input shape changes it."""
    import hashlib

    lines = [f"unit {name}: " + ",".join(type(m).__name__ for m in unit.modules())
             for name, unit in model.named_children()]
    lines += [f"{key} {tuple(value.shape)} {value.dtype}"
              for key, value in model.state_dict().items()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]
