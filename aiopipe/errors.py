"""The one exception tree of aiopipe.

::

    AiopipeError
    ├── ConfigError            bad configuration or arguments (local misuse, before running)
    ├── ProtocolError          a frame or message that breaks the wire contract
    │   ├── LocalProtocolError     we were asked to send something invalid
    │   └── RemoteProtocolError    the peer sent something invalid
    │       ├── FrameTooLargeError     ... larger than the plan allows
    │       ├── RefusedError           ... a device whose data or model do not fit the run
    │       └── PoisonedValueError     ... tensors that are not finite or far beyond the run's scale
    ├── TransportError         the link cannot carry bytes any more
    │   ├── LinkClosedError        we closed it (trio's ClosedResourceError)
    │   └── LinkBrokenError        the peer or the network broke it (BrokenResourceError)
    ├── AuthenticationError    credentials missing or wrong at the handshake
    └── TrainingError          the run cannot go on (no device left, a node failed)
        ├── DeviceLostError        one device dropped out (its round is excluded)
        ├── RoundStalledError      a device's round cannot finish (FTPipeHD replays it)
        ├── NeighbourFaultError    a device refused what a neighbour sent (it names it)
        └── SecureAggregationError fewer devices than the threshold survived a secure round

Foreign exceptions (aiohttp, OSError, msgpack) are translated once, at the transport or
codec boundary, so callers only ever catch these.
"""

from __future__ import annotations

__all__ = [
    "AiopipeError",
    "AuthenticationError",
    "ConfigError",
    "DeviceLostError",
    "FrameTooLargeError",
    "LinkBrokenError",
    "LinkClosedError",
    "LocalProtocolError",
    "NeighbourFaultError",
    "PoisonedValueError",
    "ProtocolError",
    "RefusedError",
    "RemoteProtocolError",
    "RoundStalledError",
    "SecureAggregationError",
    "TrainingError",
    "TransportError",
]


class AiopipeError(Exception):
    """Root of every error aiopipe raises on purpose."""


class ConfigError(AiopipeError):
    """A configuration value or argument is invalid; the message says which and why."""


class ProtocolError(AiopipeError):
    """A frame or message breaks the wire contract."""


class LocalProtocolError(ProtocolError):
    """We were asked to build or send a message that is not valid."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a frame or message that is not valid."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame is larger than the maximum the plan allows."""


class RefusedError(RemoteProtocolError):
    """A device announced data or a model that do not fit the run (it is told why, with
    code "refused")."""


class PoisonedValueError(RemoteProtocolError):
    """A peer sent tensors shaped as the plan says but with values that would poison the
    stage: NaN or Inf, or far beyond the run's own scale (`aiopipe.runtime.judge`).
    ``sender`` names the peer (its node name), so that the one who sent them is blamed,
    never the receiver."""

    def __init__(self, sender: str, reason: str) -> None:
        super().__init__(f"{sender} sent values out of range: {reason}")
        self.sender, self.reason = sender, reason

    def __reduce__(self) -> tuple[type[PoisonedValueError], tuple[str, str]]:
        return type(self), (self.sender, self.reason)


class TransportError(AiopipeError):
    """The link cannot carry bytes any more."""


class LinkClosedError(TransportError):
    """The link was closed by this side; using it again is a local mistake."""


class LinkBrokenError(TransportError):
    """The peer closed the link, or the network broke it."""


class AuthenticationError(AiopipeError):
    """Credentials were missing or wrong at the handshake."""


class TrainingError(AiopipeError):
    """Training cannot continue (for example, every device was lost)."""


class DeviceLostError(TrainingError):
    """A device disconnected, broke the protocol or went silent; the run goes on without
    it until it rejoins."""


class RoundStalledError(TrainingError):
    """A device said its round cannot finish (a neighbour's link failed, or no gradient
    came in time: FTPipeHD's timer)."""


class NeighbourFaultError(TrainingError):
    """A device's round stopped because it refused what a neighbour sent (the plan
    broken, values out of range): ``culprit`` is the neighbour's node name. The device
    is not at fault; it tells the coordinator who is (`Accusation`)."""

    def __init__(self, culprit: str, error: BaseException | str) -> None:
        text = str(error)
        super().__init__(text if text.startswith(culprit) else
                         f"{culprit} broke the protocol: {text}")
        self.culprit, self.error = culprit, text

    def __reduce__(self) -> tuple[type[NeighbourFaultError], tuple[str, str]]:
        return type(self), (self.culprit, self.error)


class SecureAggregationError(TrainingError):
    """A secure aggregation round (aiopipe.secagg) cannot give the sum: fewer devices
    than its threshold took part to the end, or a device's neighbourhood lost too many
    to unmask. The message says which step and how many were needed."""
