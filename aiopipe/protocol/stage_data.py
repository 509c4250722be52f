"""What devices send each other within a round: a stage's activations and gradients to
its neighbours, a data-parallel group's gradients (Asteroid), and the parts of a frame
too large to send at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol.base import TensorData, check_index, check_node_name
from aiopipe.protocol.fields import MAX_LEAVES

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

    ``tensors``: the values that cross the cut, in the order the next stage takes them
    (one for a model of one stream; a skip connection or a mask adds more), each with
    the micro-batch's rows first. ``labels``: the micro-batch's targets, rows first.

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
    tensors: tuple[TensorData, ...]
    labels: TensorData

    def __post_init__(self) -> None:
        for name in ("run_id", "stage", "epoch", "iteration", "micro_batch", "version"):
            check_index(name, getattr(self, name))
        check_node_name(self.source)
        check_node_name(self.destination)
        if not isinstance(self.labels, TensorData) or not self.labels.shape:
            raise LocalProtocolError("labels need a batch dimension")
        _check_rows(self.tensors, self.labels.shape[0], "activation")


@dataclass(frozen=True, slots=True)
class Gradient:
    """Gradient of the loss with respect to one micro-batch's input of stage ``stage``,
    sent back to the previous stage; addressed like `Activation`. ``tensors``: one per
    floating-point leaf of the activation, in its order (integer and boolean leaves, such
    as a mask, have no gradient)."""

    run_id: int
    stage: int
    epoch: int
    iteration: int
    micro_batch: int
    version: int
    source: str
    destination: str
    tensors: tuple[TensorData, ...]

    def __post_init__(self) -> None:
        for name in ("run_id", "stage", "epoch", "iteration", "micro_batch", "version"):
            check_index(name, getattr(self, name))
        check_node_name(self.source)
        check_node_name(self.destination)
        _check_rows(self.tensors, None, "gradient")


def _described(value: object) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _check_rows(tensors: tuple[TensorData, ...], rows: int | None, what: str) -> None:
    """``tensors`` is a tuple of 1 to `MAX_LEAVES` tensors that each have ``rows`` rows
    first (None: the first one's).

    Raises:
        LocalProtocolError: it is not.
    """
    if not isinstance(tensors, tuple) or not 1 <= len(tensors) <= MAX_LEAVES or any(
            not isinstance(t, TensorData) for t in tensors):
        raise LocalProtocolError(f"{what} needs a tuple of 1 to {MAX_LEAVES} TensorData, "
                                 f"got {_described(tensors)}")
    if rows is None:
        if not tensors[0].shape:
            raise LocalProtocolError(f"{what} tensor 0 has no batch dimension")
        rows = tensors[0].shape[0]
    for i, tensor in enumerate(tensors):
        if not tensor.shape or tensor.shape[0] != rows:
            raise LocalProtocolError(f"{what} tensor {i} of shape {tensor.shape} does not "
                                     f"have the micro-batch's {rows} rows first")


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
