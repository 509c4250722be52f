"""Links between nodes: the `Link` interface, memory links for simulations, websockets.

See `aiopipe.transport.base` for the contract every link keeps.
"""

from aiopipe.transport.base import DirectionStatistics, Link, LinkStatistics
from aiopipe.transport.memory import MemoryLink, open_memory_link_pair
from aiopipe.transport.network import NETWORK_PRESETS, LinkSpec, NetworkSpec, network_spec
from aiopipe.transport.websocket import (
    CHUNK_BYTES,
    WebSocketLink,
    accept_websocket,
    open_websocket_link,
)

__all__ = [
    "CHUNK_BYTES",
    "NETWORK_PRESETS",
    "DirectionStatistics",
    "Link",
    "LinkSpec",
    "LinkStatistics",
    "MemoryLink",
    "NetworkSpec",
    "WebSocketLink",
    "accept_websocket",
    "network_spec",
    "open_memory_link_pair",
    "open_websocket_link",
]
