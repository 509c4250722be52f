"""The server's connection bounds: `aiopipe.transport.guard`'s guard, under the name the
server's code and the public API (`aiopipe.ConnectionLimits`) have always used.

One implementation guards the server's port and every device's peer port alike; it lives
in the transport layer, which must not import the runtime (DESIGN §3). [Note: bounded
before authentication] is written there.
"""

from __future__ import annotations

from aiopipe.transport.guard import ConnectionGuard, ConnectionLimits, GuardedSite

__all__ = ["ConnectionGuard", "ConnectionLimits", "GuardedSite"]
