"""How a model's modules initialise their own parameters, and which parameters none does.

`RunConfig` asks `parameters_not_reset` whether a user's module can be drawn again from
the seed; `aiopipe.runtime.factories.reinitialise` calls each module's `initialiser`
([Note: initial weights] in aiopipe/runtime/factories.py). A walk over the modules:
nothing is computed, and torch is needed only by whoever built the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["initialiser", "parameters_not_reset"]


def initialiser(module: nn.Module) -> Callable[[], object] | None:
    """How ``module`` initialises its own parameters: its ``reset_parameters``, or the
    private ``_reset_parameters`` of the torch layers that have only that
    (``nn.MultiheadAttention``, ``nn.Transformer``); None when it has neither."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method  # type: ignore[no-any-return]
    return None


def parameters_not_reset(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters that `reinitialise` would leave as they are:
    those held directly by no module that has an initialiser. torch's layers have one; a
    bare ``nn.Parameter`` in a user's module usually does not."""
    covered = {id(param) for module in model.modules() if initialiser(module) is not None
               for param in module.parameters(recurse=False)}
    return [name for name, param in model.named_parameters() if id(param) not in covered]
