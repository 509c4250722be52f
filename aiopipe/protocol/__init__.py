"""The wire: message dataclasses, the frame codec, and torch ⇄ wire tensor conversions.

Pure functions of their inputs (no I/O, no clock). See `aiopipe.protocol.codec` for the
frame layout and `aiopipe.protocol.messages` for the conversation.
"""

from __future__ import annotations

from aiopipe.protocol.codec import (
    FRAME_ALIGNMENT,
    FRAME_FORMAT_VERSION,
    FRAME_MAGIC,
    HEADER_SLACK_BYTES,
    MAX_HEADER_BYTES,
    MAX_TENSOR_NDIM,
    MAX_TREE_DEPTH,
    TENSOR_SLACK_BYTES,
    decode,
    encode,
)
from aiopipe.protocol.messages import (
    DTYPE_SIZES,
    MAX_ACTIONS_CHARS,
    MAX_ADDRESS_CHARS,
    MAX_NODE_NAME_BYTES,
    MODES,
    PROTOCOL_VERSION,
    Activation,
    Bye,
    ErrorMessage,
    Gradient,
    Heartbeat,
    Hello,
    Message,
    Plan,
    RoundReport,
    RoundResult,
    RoundStart,
    TensorData,
    check_node_name,
)
from aiopipe.protocol.tensors import (
    TORCH_DTYPES,
    state_from_wire,
    state_to_wire,
    to_tensor_data,
    to_torch,
)

__all__ = [
    "DTYPE_SIZES",
    "FRAME_ALIGNMENT",
    "FRAME_FORMAT_VERSION",
    "FRAME_MAGIC",
    "HEADER_SLACK_BYTES",
    "MAX_ACTIONS_CHARS",
    "MAX_ADDRESS_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_NODE_NAME_BYTES",
    "MAX_TENSOR_NDIM",
    "MAX_TREE_DEPTH",
    "MODES",
    "PROTOCOL_VERSION",
    "TENSOR_SLACK_BYTES",
    "TORCH_DTYPES",
    "Activation",
    "Bye",
    "ErrorMessage",
    "Gradient",
    "Heartbeat",
    "Hello",
    "Message",
    "Plan",
    "RoundReport",
    "RoundResult",
    "RoundStart",
    "TensorData",
    "check_node_name",
    "decode",
    "encode",
    "state_from_wire",
    "state_to_wire",
    "to_tensor_data",
    "to_torch",
]
