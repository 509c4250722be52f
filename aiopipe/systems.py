"""What a system of your own is written with: the public side of aiopipe's systems.

A training system is a pair of halves (docs/design.md, "Systems as pairs"). A run names
it as ``mode = "module:attribute"``: the coordinator half, a class that follows the
`System` protocol and declares, as class attributes, its ``device_half`` (a
`DeviceHalf` subclass), ``links_devices``, ``recovers_lost_devices`` and
``micro_batch_sizes(config)``, and optionally its ``options`` (`SystemOptions`). The
coordinator and every device import the module (a device's process must be able to).

- The coordinator half (inherit `SystemDefaults` for what most systems do alike) is
  built from a `Setup`, plans with the devices' sample counts
  (``prepare``) and runs each round through `Rounds`: ``rounds.play(device_id, start,
  stage)`` sends device ``device_id`` its `RoundStart` and runs ``stage``, the
  `ServerStage` the coordinator computes for it (a `StageWork` and its `Assignment`),
  until the device's `RoundResult` is in.
- The device half runs a round on a device (`DeviceHalf.run_round`; by default the stage
  the `RoundStart` assigns), seeing the node through `DeviceContext`, and takes the
  system's own messages by type (`DeviceHalf.handlers`).
- A stage's work is run by a `StageExecutor`: one iteration's `Action` list (made by the
  schedule helpers: `gpipe`, `pipar`, `one_f_one_b`, then `with_transfers`, checked by
  `check_schedule`), computing on the node's compute queue, waiting in an `Inbox` for
  what arrives and posting what it sends to a `Route`.

examples/ushaped.py is a whole system written with these names only.
"""

from __future__ import annotations

from aiopipe.models.crossing import Crossing, crossing_bytes
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    Activation,
    Gradient,
    Hello,
    Message,
    Replica,
    RoundResult,
    RoundStart,
    TensorData,
    state_from_wire,
    state_to_wire,
    to_tensor_data,
    to_torch,
)
from aiopipe.runtime.arrivals import ArrivalRules
from aiopipe.runtime.assignment import Assignment, check_data_message
from aiopipe.runtime.delivery import Delivery
from aiopipe.runtime.device_half import DeviceContext, DeviceHalf, Handler, StageRules
from aiopipe.runtime.executor import Identity, Inbox, Route, StageExecutor
from aiopipe.runtime.factories import make_loss, make_optimizer, unit_crossings
from aiopipe.runtime.stage import Sent, ServerStage, StageWork
from aiopipe.runtime.stage_round import COORDINATOR
from aiopipe.runtime.systems.base import Rounds, Setup, System, SystemDefaults, refuse_replica
from aiopipe.runtime.systems.registry import SystemOptions
from aiopipe.scheduler.actions import Action, Schedule
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.scheduler.schedule import (
    check_schedule,
    gpipe,
    one_f_one_b,
    pipar,
    with_transfers,
)

__all__ = [
    "COORDINATOR",
    "HEADER_SLACK_BYTES",
    "Action",
    "Activation",
    "ArrivalRules",
    "Assignment",
    "Crossing",
    "Delivery",
    "DeviceContext",
    "DeviceHalf",
    "DeviceProfile",
    "Gradient",
    "Handler",
    "Hello",
    "Identity",
    "Inbox",
    "Message",
    "Replica",
    "RoundResult",
    "RoundStart",
    "Rounds",
    "Route",
    "Schedule",
    "Sent",
    "ServerStage",
    "Setup",
    "StageExecutor",
    "StageRules",
    "StageWork",
    "System",
    "SystemDefaults",
    "SystemOptions",
    "TensorData",
    "check_data_message",
    "check_schedule",
    "crossing_bytes",
    "gpipe",
    "make_loss",
    "make_optimizer",
    "one_f_one_b",
    "pipar",
    "refuse_replica",
    "state_from_wire",
    "state_to_wire",
    "to_tensor_data",
    "to_torch",
    "unit_crossings",
    "with_transfers",
]
