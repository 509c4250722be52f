"""Zero-copy conversions between torch tensors and `TensorData`.

[Note: shared frame memory] `to_torch` returns a tensor that *views* the buffer inside
`TensorData.data`, usually a slice of a received frame (a read-only ``bytes``). The tensor
keeps that buffer alive, and it must not be modified in place: writing to it would write
into the frame (for an immutable ``bytes`` frame, into memory Python believes constant).
Call ``.clone()`` first when a mutable copy is needed; ``load_state_dict``, ``backward``
and ordinary out-of-place ops are safe.

torch warns ("The given buffer is not writable ...") when it wraps a read-only buffer,
once per process. That warning says exactly what the note above says, so `to_torch`
silences that one warning, by message, while it wraps the buffer. (It uses
``warnings.catch_warnings``, which in Python 3.11 swaps the process-wide filter list; do
not rely on warning filters changed by another thread during that instant.)

Only little-endian hosts are supported: the wire carries little-endian bytes and these
functions reinterpret memory without swapping.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Final

import torch

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol.messages import TensorData

__all__ = ["TORCH_DTYPES", "leaves_from_wire", "leaves_to_wire", "state_from_wire",
           "state_to_wire", "to_tensor_data", "to_torch", "wire_dtype"]

#: torch dtype of every wire dtype name (the keys of DTYPE_SIZES).
TORCH_DTYPES: Final[Mapping[str, torch.dtype]] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_WIRE_NAMES: Final[Mapping[torch.dtype, str]] = {v: k for k, v in TORCH_DTYPES.items()}
_NOT_WRITABLE_WARNING: Final = "The given buffer is not writable"


def _check_byte_order() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise LocalProtocolError("aiopipe tensors need a little-endian host")


def wire_dtype(dtype: torch.dtype) -> str:
    """The wire's name of ``dtype``.

    Raises:
        LocalProtocolError: it cannot travel (see ``DTYPE_SIZES``).
    """
    name = _WIRE_NAMES.get(dtype)
    if name is None:
        raise LocalProtocolError(f"tensor dtype {dtype} cannot travel")
    return name


def to_tensor_data(tensor: torch.Tensor) -> TensorData:
    """Describe ``tensor`` for the wire, detached and on the CPU, without copying if possible.

    A contiguous CPU tensor is not copied: the result's ``data`` is a memoryview of the
    tensor's memory (which it keeps alive), so the tensor must not change until the message
    is encoded. A tensor on another device or not contiguous is copied once to make it so.

    Raises:
        LocalProtocolError: the dtype cannot travel (see ``DTYPE_SIZES``), or the host is
            big-endian.
    """
    _check_byte_order()
    name = wire_dtype(tensor.dtype)
    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().data  # a memoryview that keeps the tensor alive
    return TensorData(name, tuple(tensor.shape), data)


def to_torch(data: TensorData) -> torch.Tensor:
    """View ``data`` as a CPU tensor without copying; see [Note: shared frame memory].

    The tensor shares the buffer of ``data.data`` and must not be mutated in place.
    A zero-element tensor is a fresh empty tensor (there is no memory to share).

    Raises:
        LocalProtocolError: ``data.data`` is not C-contiguous, or the host is big-endian.
    """
    _check_byte_order()
    dtype = TORCH_DTYPES[data.dtype]
    view = memoryview(data.data)
    if view.nbytes == 0:
        return torch.empty(data.shape, dtype=dtype)
    if not view.c_contiguous:
        raise LocalProtocolError("tensor bytes are not C-contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.readonly:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _NOT_WRITABLE_WARNING, UserWarning)
            flat = torch.frombuffer(view, dtype=dtype)
    else:
        flat = torch.frombuffer(view, dtype=dtype)
    return flat.view(data.shape)


def state_to_wire(state: Mapping[str, torch.Tensor]) -> dict[str, TensorData]:
    """Convert a state dict for the wire with `to_tensor_data`, keeping its order.

    Raises:
        LocalProtocolError: a key is not a str, a value is not a tensor, or a dtype cannot
            travel.
    """
    out: dict[str, TensorData] = {}
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise LocalProtocolError(f"state key {name!r} is not a str")
        if not isinstance(tensor, torch.Tensor):
            raise LocalProtocolError(f"state[{name!r}] is a {type(tensor).__name__}, not a tensor")
        out[name] = to_tensor_data(tensor)
    return out


def state_from_wire(tensors: Mapping[str, TensorData]) -> dict[str, torch.Tensor]:
    """Convert received tensors to torch with `to_torch` (no copies), keeping their order.

    The tensors share the frame's memory; see [Note: shared frame memory].

    Raises:
        LocalProtocolError: as `to_torch`.
    """
    return {name: to_torch(data) for name, data in tensors.items()}


def leaves_to_wire(tensors: Sequence[torch.Tensor]) -> tuple[TensorData, ...]:
    """An activation's or a gradient's leaves for the wire (`to_tensor_data` each)."""
    return tuple(to_tensor_data(t) for t in tensors)


def leaves_from_wire(tensors: Sequence[TensorData]) -> tuple[torch.Tensor, ...]:
    """Received leaves as torch tensors (`to_torch` each: no copies, shared frame memory)."""
    return tuple(to_torch(t) for t in tensors)
