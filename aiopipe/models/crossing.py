"""What crosses a cut: one tensor, or a tuple of them (its *leaves*), rows first.

A unit takes and returns either one tensor or a flat tuple of tensors (a residual
stream and a skip connection, a hidden state and its attention mask, a model's two
inputs): `aiopipe.models.split_units` makes such units wherever several values are
live at a cut. Every leaf holds the micro-batch's rows first, so a micro-batch can be
split by rows (a data-parallel group) and a per-sample shape describes it.

A cut is described per sample by its `Crossing`: each leaf's dtype name (the wire's,
`aiopipe.protocol.TORCH_DTYPES`) and shape without the rows. The runtime checks what
arrives against it leaf by leaf, sizes frames and costs from it, and gradients travel
for its floating-point leaves only (`gradient_leaves`): an integer or boolean leaf (a
token id, a mask) has none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aiopipe.errors import ConfigError
from aiopipe.protocol.base import DTYPE_SIZES
from aiopipe.protocol.tensors import TORCH_DTYPES, wire_dtype

__all__ = ["Crossing", "Leaf", "Value", "as_crossing", "crossing_bytes", "crossing_of",
           "example", "gradient_leaves", "is_floating", "joined", "leaves", "single"]

#: What a unit takes or returns: one tensor, or a flat tuple of them.
Value = torch.Tensor | tuple[torch.Tensor, ...]
#: One leaf per sample: its dtype name and its shape without the rows.
Leaf = tuple[str, tuple[int, ...]]
#: What crosses one cut per sample, leaf by leaf.
Crossing = tuple[Leaf, ...]


def single(shape: Sequence[int], dtype: str = "float32") -> Crossing:
    """The crossing of one tensor of per-sample ``shape``."""
    return ((dtype, tuple(int(d) for d in shape)),)


def as_crossing(inputs: Crossing | Sequence[int]) -> Crossing:
    """``inputs`` as a crossing: a crossing as it is, a shape (ints) as one float32
    tensor of that per-sample shape (a model of one float input, as images are)."""
    if all(isinstance(d, int) for d in inputs):
        return single(inputs)  # type: ignore[arg-type]
    return tuple((str(dtype), tuple(shape)) for dtype, shape in inputs)  # type: ignore[misc]


def leaves(value: object) -> tuple[torch.Tensor, ...]:
    """``value`` (a tensor, or a tuple or list of tensors) as a tuple of tensors.

    Raises:
        ConfigError: it is neither (a dict, a nested tuple, a number).
    """
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple | list) and value and all(
            isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise ConfigError(f"a unit must take and return a tensor or a flat tuple of tensors, "
                      f"got {_describe(value)}")


def joined(tensors: Sequence[torch.Tensor]) -> Value:
    """What a unit takes for ``tensors``: the tensor itself when there is one, else the
    tuple (the inverse of `leaves`)."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def crossing_of(value: object) -> Crossing:
    """The per-sample crossing of ``value`` (a tensor or a tuple of them, rows first).

    Raises:
        ConfigError: not tensors, a dtype that cannot travel, or a leaf without rows.
    """
    out = []
    for i, t in enumerate(leaves(value)):
        if t.dim() == 0:
            raise ConfigError(f"value {i} crossing a cut has no rows (a 0-d tensor): every "
                              "value that crosses a cut must hold the micro-batch's rows "
                              "first")
        out.append((wire_dtype(t.dtype), tuple(int(d) for d in t.shape[1:])))
    return tuple(out)


def example(crossing: Crossing, rows: int, *, random: bool = False) -> Value:
    """Values of ``crossing`` for ``rows`` samples, as a unit takes them: zeros (with
    ``random``, floats drawn from torch's global generator)."""
    made = []
    for dtype, shape in crossing:
        kind = TORCH_DTYPES[dtype]
        if random and kind.is_floating_point:
            made.append(torch.randn(rows, *shape, dtype=kind))
        else:
            made.append(torch.zeros(rows, *shape, dtype=kind))
    return joined(made)


def is_floating(dtype: str) -> bool:
    """Whether a leaf of wire dtype ``dtype`` carries a gradient."""
    return TORCH_DTYPES[dtype].is_floating_point


def gradient_leaves(crossing: Crossing) -> Crossing:
    """The leaves of ``crossing`` that a gradient travels for (its floating ones)."""
    return tuple(leaf for leaf in crossing if is_floating(leaf[0]))


def crossing_bytes(crossing: Crossing) -> int:
    """Bytes of one sample's values across a cut, all leaves together."""
    return sum(DTYPE_SIZES[dtype] * math.prod(shape) for dtype, shape in crossing)


def _describe(value: object) -> str:
    if isinstance(value, tuple | list):
        inner = ", ".join(type(v).__name__ for v in value[:4])
        return f"{type(value).__name__} of ({inner}{', ...' if len(value) > 4 else ''})"
    return type(value).__name__
