"""The device as the coordinator's stage sees it (the previous stage, and for a middle
stage the next): where the coordinator's `StageExecutor` sends a device's gradients and
activations; the session (aiopipe.runtime.session) takes what the device sends.

[Note: middle stages] The coordinator's stage is usually a device's last (the star's
server half: it computes the loss). A system may give it a middle stage instead, the
device running the stages on both sides of it (U-shaped split learning,
examples/ushaped.py): its activations then go back down to the device, whose
gradients for them come up, checked like activations (once each, against the round's
plan). A middle stage computes no loss: the round's loss is the device's. What was in
flight across a reconnection is not re-sent for a middle stage (the device re-sends its
activations, and gets the gradients already computed, as for a last stage).
"""

from __future__ import annotations

from typing import Protocol

from aiopipe.protocol import Activation, Gradient
from aiopipe.runtime.peer import Peer

__all__ = ["DeviceRoute"]

Key = tuple[int, int, int]  # (epoch, iteration, micro-batch)


class DeviceSession(Protocol):
    """What the route uses of the device's session (aiopipe.runtime.session)."""

    name: str
    peer: Peer
    gradients: dict[Key, Gradient]  # computed, for re-sending (one iteration)
    served: int  # micro-batches the coordinator's stage computed this round


class DeviceRoute:
    """The device as the previous stage of the coordinator's (and, for a middle stage,
    the next): gradients go out on the downlink and are kept for re-sending until the
    device moves to the next iteration; activations go out on the downlink."""

    def __init__(self, session: DeviceSession) -> None:
        self.session = session
        self.node = session.name

    def send(self, message: Activation | Gradient, name: str, *,
             ready_at: float | None) -> None:
        session = self.session
        key = (message.epoch, message.iteration, message.micro_batch)
        if isinstance(message, Gradient):
            # the device moves to iteration i+1 only with every gradient of i: older ones
            # will never be asked for again
            for old in [k for k in session.gradients if k[:2] != key[:2]]:
                del session.gradients[old]
            session.gradients[key] = message
            session.served += 1
        session.peer.post(message, name, epoch=key[0], iteration=key[1], micro_batch=key[2],
                          ready_at=ready_at)
