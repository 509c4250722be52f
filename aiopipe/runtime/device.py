"""A device: `run_device` runs device k of a run until the server says Bye, on the
device shell (`aiopipe.runtime.device_node.DeviceNode`) with the device half of the
run's system (aiopipe.runtime.device_half)."""

from __future__ import annotations

import torch

from aiopipe import data as datasets
from aiopipe.clock import Clock, SystemClock
from aiopipe.runtime.compute import resolve_torch_device, warm_up_torch
from aiopipe.runtime.device_connection import Connector
from aiopipe.runtime.device_node import COORDINATOR, DeviceNode
from aiopipe.runtime.device_reports import DeviceSummary
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link
from aiopipe.transport.fabric import Endpoint

__all__ = ["COORDINATOR", "Connector", "DeviceSummary", "run_device"]


async def run_device(server: Link | Connector, device_id: int, *, clock: Clock | None = None,
                     cost_table: CostTable | None = None, clock_offset: float | None = None,
                     model: torch.nn.Sequential | None = None,
                     max_frame_bytes: int | None = None,
                     shape_uplink: bool = False,
                     endpoint: Endpoint | None = None,
                     dataset: datasets.Dataset | None = None,
                     profile: bool = True, torch_device: str = "cpu",
                     held_out: datasets.Dataset | None = None) -> DeviceSummary:
    """Run device ``device_id`` until the server says Bye.

    Args:
        server: an open link to the server, or a connector (a callable returning an async
            context manager that opens a new link) so that the device can reconnect
            with backoff when a link breaks or goes silent ([Note: reconnection]).
        device_id: this device's id, 0..K-1.
        clock: defaults to the system clock.
        cost_table: charge compute from this table (virtual-time simulation).
        clock_offset: server clock minus this clock; estimated from the handshake when
            None.
        model: the user's own model when the config names "custom".
        max_frame_bytes: refuse larger frames from the server.
        shape_uplink: pace a websocket uplink, and the websocket links to peer devices,
            at the plan's network rate for this device's uplink (sender-side shaping, to
            emulate a slow link on one machine).
        endpoint: where this device listens for peer devices, for runs that link devices
            directly (a pipeline); its address goes to the server in the Hello.
        dataset: this device's own training data; None: its shard of the run's
            ``dataset`` as ``data_partition`` splits it (an emulated fleet).
        profile: time its own compute and links when the coordinator asks
            (aiopipe.runtime.profiling [Note: device profiles]); False for a device that
            shares the coordinator's machine and cost table (a simulation), which then
            answers with none.
        torch_device: where its stage computes: "auto", "cpu", "cuda" or "cuda:N"
            (`aiopipe.runtime.compute.resolve_torch_device`).
        held_out: this device's own held-out data: it evaluates each epoch's global
            model on it when the coordinator asks (`EvalRequest`).

    Raises:
        TrainingError: the server refused us, the conversation broke down, a peer link
            failed, or the device could not reconnect.
        TransportError: the link failed and there is no connector to reconnect with.
    """
    warm_up_torch()
    node = DeviceNode(server, device_id, clock or SystemClock(), cost_table, clock_offset, model,
                       max_frame_bytes, endpoint)
    node.own_data = dataset
    node.profiles = profile and cost_table is None
    node.torch_device = resolve_torch_device(torch_device)
    node.held_out = held_out
    node.shape_uplink = shape_uplink
    try:
        return await node.run()
    finally:
        if node.half is not None:
            node.half.close()
        node.compute.close()


