"""The messages nodes exchange: frozen, slotted dataclasses validated on construction.

A tensor travels as `TensorData` (dtype name, shape, raw C-contiguous little-endian
bytes); `aiopipe.protocol.tensors` converts to and from torch without copies. These
modules are pure: no I/O, no torch. The messages live by who sends them:
`aiopipe.protocol.control` (coordinator ⇄ device), `aiopipe.protocol.stage_data`
(device ⇄ device within a round), `aiopipe.protocol.systems` (FTPipeHD's replicas,
HADFL's ring) and `aiopipe.protocol.secagg` (secure aggregation); this module gathers
them into `Message`.

Conversation of a device ``k`` with the coordinator ``C`` (the server)::

    k → C  Hello(version, device_id, session, address)
    C → k  Rest()   (in a run whose links rest: the link starts at rest, below)
    C → k  Plan(device_id, mode, run, run_id, server_time, session, peer_keys,
                inputs, target, num_classes)
    k → C  Ready(samples, inputs, target, num_classes, model_digest, host)   (a new session
           only: the device has built the run's model and opened its own data)
    after each epoch, to every device that announced held-out data:
      C → k  EvalRequest(epoch, tensors)              (the whole global model)
      k → C  EvalResult(epoch, samples, loss_sum, correct)
    when the coordinator plans from profiles (PiPar §3.3.1), once every device is ready:
      C → k  ProfileRequest(batch_sizes), then Probe(data)     (times the downlink)
      k → C  Profile(costs, seconds, downlink_bps), then Probe(data)   (the uplink)
    repeat per round (aggregation period, or epoch):
      C → k  RoundStart(round, epoch, first_iteration, iterations, tensors, stage, stages,
                        first_unit, stop_unit, parallel_batches, micro_batch_size,
                        version, actions, peers, rows)
      per iteration, as the round's actions say, between neighbouring stages (the
      coordinator's own stage in the split modes, another device in a pipeline):
        p → p+1  Activation(run_id, stage, epoch, iteration, micro_batch, version,
                            source, destination, tensors, labels)
        p+1 → p  Gradient(run_id, stage, epoch, iteration, micro_batch, version,
                          source, destination, tensors)
      asteroid's data-parallel groups, once per iteration (REDUCE), to each member
      of the same stage:
        k → k'   GroupGradient(run_id, stage, epoch, iteration, version, source,
                               destination, tensors)
      k → C  RoundResult(round, samples, loss_sum, correct, tensors)
      k → C  RoundReport(round, report)
      k → C  RoundStalled(round, reason)   (the round cannot finish here)
      k → C  Accusation(round, culprit, reason)   (a neighbour's values were refused)
      C → k  RoundAccepted(round)   (result and report held, to a device not drawn for
                                     the next round; the next RoundStart says as much)
      C → k  Rest()   (in a run whose links rest: nothing is expected of k until C's
                       next message; neither end beats or watches till then)
      ftpipehd's chain replication, every ``chain_replication_every`` batches:
        p → p+1  Replica(round, stage, batches, loss_sum, correct, tensors)
        S-1 → C  Replica(...)                  (the last stage's, to the coordinator)
      and when the coordinator recovers a round from them:
        C → k    ReplicaRequest(round, batches, stages)
        k → C    Replica(...) for each stage asked (no tensors: not held)
      with ``secure_aggregation`` (fl, sfl, pipar), after the round's results, for
      step in 0..3 (aiopipe.protocol.secagg):
        C → k    SecAggRequest(round, step, clients, dropped, length, tensors)
        k → C    SecAggReply(round, step, tensors)
    C → k  Bye(reason)
    either way, any time: Heartbeat(seq) (in a run whose links rest, only while the
    link is awake: from C's first message after a Rest); ErrorMessage(code, message)
    before closing.

Links between devices are authenticated by the fabric (`aiopipe.transport.fabric`)
before any of these messages travel on them.
"""

from __future__ import annotations

from typing import Final

from aiopipe.auth import MAX_NODE_NAME_BYTES
from aiopipe.protocol.base import DTYPE_SIZES, TensorData, check_node_name
from aiopipe.protocol.control import (
    MAX_ACTIONS_CHARS,
    MAX_ADDRESS_CHARS,
    MAX_REASON_CHARS,
    MODES,
    TRAINING_FINISHED,
    Accusation,
    Bye,
    ErrorMessage,
    EvalRequest,
    EvalResult,
    Heartbeat,
    Hello,
    Plan,
    Probe,
    Profile,
    ProfileRequest,
    Ready,
    Rest,
    RoundAccepted,
    RoundReport,
    RoundResult,
    RoundStalled,
    RoundStart,
)
from aiopipe.protocol.secagg import SecAggReply, SecAggRequest
from aiopipe.protocol.stage_data import Activation, FramePart, Gradient, GroupGradient
from aiopipe.protocol.systems import (
    Replica,
    ReplicaRequest,
    RingBypass,
    RingChunk,
    RingHandshake,
    SyncedModel,
)

__all__ = [
    "DTYPE_SIZES",
    "MAX_ACTIONS_CHARS",
    "MAX_ADDRESS_CHARS",
    "MAX_NODE_NAME_BYTES",
    "MAX_REASON_CHARS",
    "MODES",
    "PROTOCOL_VERSION",
    "TRAINING_FINISHED",
    "Accusation",
    "Activation",
    "Bye",
    "ErrorMessage",
    "EvalRequest",
    "EvalResult",
    "FramePart",
    "Gradient",
    "GroupGradient",
    "Heartbeat",
    "Hello",
    "Message",
    "Plan",
    "Probe",
    "Profile",
    "ProfileRequest",
    "Ready",
    "Replica",
    "ReplicaRequest",
    "Rest",
    "RingBypass",
    "RingChunk",
    "RingHandshake",
    "RoundAccepted",
    "RoundReport",
    "RoundResult",
    "RoundStalled",
    "RoundStart",
    "SecAggReply",
    "SecAggRequest",
    "SyncedModel",
    "TensorData",
    "check_node_name",
]

#: Version of the conversation drawn above, which `Hello.version` names.
PROTOCOL_VERSION: Final = 13


#: Every message kind that travels (`aiopipe.protocol.codec` frames each).
Message = (
    Hello
    | Plan
    | Ready
    | EvalRequest
    | EvalResult
    | ProfileRequest
    | Profile
    | Probe
    | FramePart
    | RoundStart
    | Activation
    | Gradient
    | GroupGradient
    | RoundResult
    | RoundReport
    | RoundStalled
    | RoundAccepted
    | Rest
    | Accusation
    | Replica
    | ReplicaRequest
    | RingChunk
    | RingBypass
    | RingHandshake
    | SyncedModel
    | SecAggRequest
    | SecAggReply
    | Heartbeat
    | Bye
    | ErrorMessage
)
