"""Low-rank adapters (LoRA, Hu et al. 2021): fine-tune a few small matrices, not the model.

`add_lora` wraps chosen ``nn.Linear`` layers of any model, in place, in a `LoRALinear`:
the original layer, frozen, plus two trainable matrices A (rank x in) and B (out x rank)
whose product is added to its output, scaled by ``alpha / rank``. B starts at zero, so
the adapted model computes exactly what the base did until it trains. By default every
other parameter is frozen too, and then only A and B train, travel and hold optimizer
state: every system leaves frozen parameters out of its transfers ([Note: frozen
bases] in aiopipe/runtime/systems/star/coordinator.py). `merge_lora` folds the
adapters back into plain ``nn.Linear`` layers for export; `lora_parameters` names the
adapters' tensors.

[Note: adapter names] The wrapped layer stays reachable as ``<name>.base``, so its
state-dict keys become ``<name>.base.weight`` and ``<name>.base.bias``, and the adapters
are ``<name>.lora_a`` and ``<name>.lora_b``. A state dict of the model without adapters
therefore does not load into the adapted model as it is: add the adapters after loading
pretrained weights, or rename ``<name>.weight`` to ``<name>.base.weight``. `merge_lora`
gives back the original names.

A `LoRALinear` has a ``reset_parameters`` that draws A again and zeroes B, so a model
with adapters is re-initialised from a run's seed like any torch model
(`aiopipe.models.initialisers`; the wrapped layer resets itself as its own module).
"""

from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

from aiopipe.errors import ConfigError

__all__ = ["DEFAULT_ALPHA", "DEFAULT_RANK", "LoRALinear", "add_lora", "lora_parameters",
           "merge_lora"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: rank of the update B @ A: a few directions per layer are enough to adapt a pretrained
#: layer (the LoRA paper's finding), and the fewer, the fewer bytes travel
DEFAULT_RANK = 4
#: alpha / rank scales the update; alpha equal to the default rank makes that scale 1 at
#: the defaults (as peft's defaults do), and keeping alpha when changing the rank keeps
#: the update's size, so the learning rate need not be tuned again (the paper's reason)
DEFAULT_ALPHA = 4.0


class LoRALinear(nn.Module):
    """An ``nn.Linear`` (``base``, frozen) plus a trainable low-rank update:
    ``base(x) + (x @ lora_a.T @ lora_b.T) * (alpha / rank)``.

    ``lora_a`` (rank x in) is drawn as ``nn.Linear`` draws its weight (kaiming-uniform,
    from torch's global generator) and ``lora_b`` (out x rank) starts at zero, as in the
    LoRA paper: the update is zero at first and both matrices get gradients.

    Raises:
        ConfigError: ``rank`` is not an integer of at least 1, or ``alpha`` is not a
            finite number above 0.
    """

    def __init__(self, base: nn.Linear, *, rank: int = DEFAULT_RANK,
                 alpha: float = DEFAULT_ALPHA) -> None:
        super().__init__()
        _check(rank, alpha)
        self.rank = rank
        self.alpha = float(alpha)
        self.base = base
        base.requires_grad_(False)
        like = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=like.dtype,
                                               device=like.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, dtype=like.dtype,
                                               device=like.device))
        self.reset_parameters()

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor of the low-rank update."""
        return self.alpha / self.rank

    def reset_parameters(self) -> None:
        """Draw A again (kaiming-uniform, global generator) and zero B; the base is left
        as it is (it is its own module, which `reinitialise` resets before this one)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
            nn.init.zeros_(self.lora_b)

    def forward(self, x: Tensor) -> Tensor:
        update = nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)
        out: Tensor = self.base(x) + update * self.scale
        return out

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing what this module computes: a copy of the base
        with weight ``W + scale * B @ A`` (its parameters keep the base's
        ``requires_grad``). Draws nothing from the global generator."""
        linear = copy.deepcopy(self.base)
        with torch.no_grad():
            linear.weight.add_(self.lora_b @ self.lora_a, alpha=self.scale)
        return linear

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def add_lora(model: ModuleT, *, rank: int = DEFAULT_RANK, alpha: float = DEFAULT_ALPHA,
             targets: Sequence[str] | None = None, freeze_base: bool = True) -> ModuleT:
    """Wrap ``model``'s ``nn.Linear`` layers named by ``targets`` in `LoRALinear`, in place,
    and return ``model``.

    ``targets`` are ``fnmatch`` patterns (case-sensitive) matched against each layer's
    qualified name as ``model.named_modules()`` gives it (``"0.1"`` for layer 1 of unit
    0 of an ``nn.Sequential``, ``"encoder.fc1"``); ``*`` matches across dots too, so
    ``"*fc1"`` is every ``fc1``. None (the default) wraps every ``nn.Linear``. A layer
    already inside a `LoRALinear` is never wrapped again; a layer shared by several
    parents gets one wrapper shared the same way. The wrapped layer is frozen and moves
    to ``<name>.base`` ([Note: adapter names]). With ``freeze_base`` (the default) every
    other parameter that is not an adapter is frozen as well: only A and B train.

    A is drawn from torch's global generator, layer by layer in ``named_modules`` order.

    Raises:
        ConfigError: ``rank`` is not an integer of at least 1, ``alpha`` is not a finite
            number above 0, ``targets`` is empty or a pattern of it (or, without
            targets, the model) matches no ``nn.Linear``, or ``model`` itself is a
            targeted ``nn.Linear`` (nothing holds it to replace it in: wrap it,
            ``LoRALinear(layer)``).
    """
    _check(rank, alpha)
    if isinstance(targets, str):
        raise ConfigError(f"targets must be a sequence of patterns, not the string "
                          f"{targets!r} (write [{targets!r}])")
    inside = {id(m) for lora in model.modules() if isinstance(lora, LoRALinear)
              for m in lora.base.modules()}
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and id(m) not in inside]
    patterns = ["*"] if targets is None else list(targets)
    if not patterns:
        raise ConfigError("add_lora: no targets (None adapts every nn.Linear)")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in linears):
            known = ", ".join(repr(name) for name, _ in linears[:8]) or "none"
            raise ConfigError(f"add_lora: target {pattern!r} matches no nn.Linear of "
                              f"the model (its Linear layers: {known})")
    if isinstance(model, nn.Linear) and any(fnmatch.fnmatchcase("", pattern)
                                            for pattern in patterns):
        raise ConfigError("add_lora replaces layers inside a model; this model is itself "
                          "an nn.Linear: wrap it as LoRALinear(layer) instead")
    wrappers: dict[int, LoRALinear] = {}
    for name, linear in linears:
        if id(linear) not in wrappers and any(fnmatch.fnmatchcase(name, pattern)
                                              for pattern in patterns):
            wrappers[id(linear)] = LoRALinear(linear, rank=rank, alpha=alpha)
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in wrappers:
                parent._modules[child_name] = wrappers[id(child)]
    if freeze_base:
        adapters = {id(p) for lora in model.modules() if isinstance(lora, LoRALinear)
                    for p in (lora.lora_a, lora.lora_b)}
        for param in model.parameters():
            if id(param) not in adapters:
                param.requires_grad_(False)
    return model


def merge_lora(model: ModuleT) -> ModuleT:
    """Replace, in place, every `LoRALinear` of ``model`` by the plain ``nn.Linear`` it
    amounts to (`LoRALinear.merged`) and return ``model``. The state-dict keys go back
    to ``<name>.weight`` ([Note: adapter names]); parameters frozen by `add_lora` stay
    frozen.

    Raises:
        ConfigError: ``model`` itself is a `LoRALinear` (nothing holds it to replace it
            in: use its ``merged()``).
    """
    if isinstance(model, LoRALinear):
        raise ConfigError("merge_lora replaces adapted layers inside a model; this model "
                          "is itself a LoRALinear: use its merged() instead")
    merged: dict[int, nn.Linear] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, LoRALinear):
                if id(child) not in merged:
                    merged[id(child)] = child.merged()
                parent._modules[child_name] = merged[id(child)]
    return model


def lora_parameters(model: nn.Module) -> tuple[str, ...]:
    """The state-dict names of ``model``'s adapter tensors (every `LoRALinear`'s
    ``lora_a`` and ``lora_b``), in ``named_parameters`` order."""
    adapters = {id(p) for lora in model.modules() if isinstance(lora, LoRALinear)
                for p in (lora.lora_a, lora.lora_b)}
    return tuple(name for name, p in model.named_parameters() if id(p) in adapters)


def _check(rank: object, alpha: object) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"LoRA rank must be an integer of at least 1; got {rank!r}")
    if (isinstance(alpha, bool) or not isinstance(alpha, int | float)
            or not math.isfinite(alpha) or alpha <= 0):
        raise ConfigError(f"LoRA alpha must be a finite number above 0; got {alpha!r}")

