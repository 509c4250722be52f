"""What devices send each other within a round: a stage's activations and gradients to
its neighbours, a data-parallel group's gradients (Asteroid), and the parts of a frame
too large to send at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol.base import TensorData, check_index, check_node_name

__all__ = ["Activation", "FramePart", "Gradient", "GroupGradient"]


@dataclass(frozen=True, slots=True)
class FramePart:
    """Part ``index`` of ``count`` of one frame too large to send at once in the
    background (aiopipe.runtime.peer [Note: background sends]): its bytes ``data`` (a
    1-D uint8 tensor). The parts go in order; the receiver joins and decodes them."""

    index: int
    count: int
    data: TensorData

    def __post_init__(self) -> None:
        check_index("index", self.index)
        if isinstance(self.count, bool) or not isinstance(self.count, int) or not (
                self.index < self.count):
            raise LocalProtocolError(f"count must be an int above index {self.index}, got "
                                     f"{self.count!r}")
        if self.data.dtype != "uint8" or len(self.data.shape) != 1:
            raise LocalProtocolError("a frame part's data must be a 1-D uint8 tensor")


@dataclass(frozen=True, slots=True)
class Activation:
    """Output of stage ``stage`` for one micro-batch, with its labels, sent to the next
    stage.

    Stage-addressed: ``run_id`` (the `Plan`'s), the sending ``stage``, the micro-batch's
    ids, the ``version`` of the weights that computed it (optimizer steps they had taken),
    and the sending and receiving node (``source``, ``destination``). The receiver checks
    every field against its plan.
    """

    run_id: int
    stage: int
    epoch: int
    iteration: int
    micro_batch: int
    version: int
    source: str
    destination: str
    tensor: TensorData
    labels: TensorData

    def __post_init__(self) -> None:
        for name in ("run_id", "stage", "epoch", "iteration", "micro_batch", "version"):
            check_index(name, getattr(self, name))
        check_node_name(self.source)
        check_node_name(self.destination)
        if not self.tensor.shape or not self.labels.shape:
            raise LocalProtocolError("activation and labels need a batch dimension")
        if self.tensor.shape[0] != self.labels.shape[0]:
            raise LocalProtocolError(
                f"activation batch {self.tensor.shape[0]} != labels batch {self.labels.shape[0]}"
            )


@dataclass(frozen=True, slots=True)
class Gradient:
    """Gradient of the loss with respect to one micro-batch's input of stage ``stage``,
    sent back to the previous stage; addressed like `Activation`."""

    run_id: int
    stage: int
    epoch: int
    iteration: int
    micro_batch: int
    version: int
    source: str
    destination: str
    tensor: TensorData

    def __post_init__(self) -> None:
        for name in ("run_id", "stage", "epoch", "iteration", "micro_batch", "version"):
            check_index(name, getattr(self, name))
        check_node_name(self.source)
        check_node_name(self.destination)


@dataclass(frozen=True, slots=True)
class GroupGradient:
    """A data-parallel group's all-reduce (Asteroid): the gradients a member of stage
    ``stage`` accumulated over iteration ``iteration`` (by parameter name), sent to each
    other member; each sums every member's in member order, so all step alike.
    Addressed like `Activation` (no micro-batch: it is the iteration's)."""

    run_id: int
    stage: int
    epoch: int
    iteration: int
    version: int
    source: str
    destination: str
    tensors: Mapping[str, TensorData]

    def __post_init__(self) -> None:
        for name in ("run_id", "stage", "epoch", "iteration", "version"):
            check_index(name, getattr(self, name))
        check_node_name(self.source)
        check_node_name(self.destination)
