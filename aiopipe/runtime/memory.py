"""What a stage's training holds in memory, measured (Asteroid's Eq. 3, checked).

A member of a stage holds its weights, their gradients and the optimizer's state for the
whole round, and, for each micro-batch forwarded and not yet backwarded, what autograd
saved for the backward: the tensors the forward's operations kept (their inputs, masks,
pooling indices...), the stage's received input and its output. `saved_bytes` measures
the second through autograd's saved-tensor hooks: each distinct storage once, the
parameters' own left out (they are counted with the weights). `state_bytes` counts the
first from the tensors themselves.

These are the tensors' own bytes, not the process's: the allocator's slack, the
interpreter and torch's libraries (about 300 MB of resident memory for a CPU process)
come on top and are the same for every plan, which is why a plan's budget is for what
training holds (docs/design.md §Asteroid).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

__all__ = ["saved_bytes", "state_bytes"]

T = TypeVar("T")


def saved_bytes(run: Callable[[], T], parameters: Iterable[torch.Tensor],
                also: Iterable[torch.Tensor] = ()) -> tuple[T, int]:
    """``run()``'s result and the bytes of the distinct storages autograd saved while it
    ran, with those of ``also`` (tensors kept beside them: a stage's input and output),
    leaving out ``parameters``' storages."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    if isinstance(result, torch.Tensor):
        pack(result)
    for tensor in also:
        pack(tensor)
    return result, sum(seen.values())


def state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``module``'s parameters and buffers, a gradient per trainable parameter
    (a frozen one takes none), and the optimizer's state tensors (SGD's momentum)."""
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    gradients = sum(p.numel() * p.element_size() for p in module.parameters()
                    if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if isinstance(t, torch.Tensor))
    return parameters + gradients + buffers + state
