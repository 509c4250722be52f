"""Links between nodes: the `Link` interface, memory links for simulations, websockets,
and the fabric of endpoints on which every node listens and dials, with peers that
authenticate each other.

See `aiopipe.transport.base` for the contract every link keeps.
"""

from aiopipe.transport.base import DirectionStatistics, Link, LinkStatistics, WireSpan
from aiopipe.transport.fabric import (
    PEER_LIMITS,
    Endpoint,
    MemoryEndpoint,
    MemoryFabric,
    WebSocketEndpoint,
    open_websocket_endpoint,
)
from aiopipe.transport.guard import ConnectionGuard, ConnectionLimits, GuardedLink, GuardedSite
from aiopipe.transport.memory import MemoryLink, open_memory_link_pair
from aiopipe.transport.network import NETWORK_PRESETS, LinkSpec, NetworkSpec, network_spec
from aiopipe.transport.peering import MAX_HANDSHAKES, accept_peer, dial_peer
from aiopipe.transport.websocket import (
    CHUNK_BYTES,
    WebSocketLink,
    accept_websocket,
    open_websocket_link,
    turned_away,
)

__all__ = [
    "CHUNK_BYTES",
    "MAX_HANDSHAKES",
    "NETWORK_PRESETS",
    "PEER_LIMITS",
    "ConnectionGuard",
    "ConnectionLimits",
    "DirectionStatistics",
    "Endpoint",
    "GuardedLink",
    "GuardedSite",
    "Link",
    "LinkSpec",
    "LinkStatistics",
    "MemoryEndpoint",
    "MemoryFabric",
    "MemoryLink",
    "NetworkSpec",
    "WebSocketEndpoint",
    "WebSocketLink",
    "WireSpan",
    "accept_peer",
    "accept_websocket",
    "dial_peer",
    "network_spec",
    "open_memory_link_pair",
    "open_websocket_endpoint",
    "open_websocket_link",
    "turned_away",
]
