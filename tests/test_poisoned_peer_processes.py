"""A device process that sends its neighbour activations x1e6, in an FTPipeHD run
between real processes over real websockets (issue 41; [Note: judging arrivals] in
aiopipe/runtime/judge.py): the neighbour refuses them and names it, the server excludes
it (its log, ``devices_excluded`` in ``metrics.jsonl``), re-partitions over the two
honest devices, and they finish the run with finite losses, exit 0. (Before: the
neighbour's weights went non-finite, the recoveries cascaded until "device 0 is gone".)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from real_processes import ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = {"mode": "ftpipehd", "devices": 3, "model": "vgg5", "samples_per_device": 200,
       "batch_size": 20, "epochs": 2, "test_samples": 200, "heartbeat_interval": 0.5,
       "device_timeout": 5.0, "reconnect_grace": 2.0}
BAD = 1

#: ``python -m poisoning_device ARGS``: ``python -m aiopipe.device ARGS`` whose
#: activations to other devices are x1e6
POISONING_DEVICE = '''
import dataclasses
import runpy

from aiopipe.protocol import Activation, to_tensor_data, to_torch
from aiopipe.runtime import peer

honest = peer.Peer.post


def post(self, message, *args, **kwargs):
    if isinstance(message, Activation) and message.destination.startswith("device"):
        message = dataclasses.replace(
            message, tensor=to_tensor_data(to_torch(message.tensor) * 1e6))
    return honest(self, message, *args, **kwargs)


peer.Peer.post = post
runpy.run_module("aiopipe.device", run_name="__main__")
'''


async def test_a_device_process_poisoning_its_neighbour_is_excluded(tmp_path: Path) -> None:
    (tmp_path / "poisoning_device.py").write_text(POISONING_DEVICE)
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        devices = []
        for k in range(RUN["devices"]):
            if k == BAD:
                devices.append(await fleet.start(f"device{k}", [
                    "poisoning_device", "--server", fleet.url, "--device-id", str(k),
                    "--listen", "127.0.0.1:0"], env={"PYTHONPATH": str(tmp_path)}))
            else:
                devices.append(await fleet.start_device(k, "--listen", "127.0.0.1:0"))
        honest = [d for k, d in enumerate(devices) if k != BAD]
        await fleet.finish(server, honest, within=240)
        assert await devices[BAD].wait(30) != 0  # told it is excluded
    metrics = fleet.metrics()
    assert [m["devices_excluded"] for m in metrics] == [[BAD], []]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert [m["samples"] for m in metrics] == [RUN["samples_per_device"]] * 2
    log = server.output.text()
    assert f"device {BAD} is excluded from the run: device 2 refused what it sent" in log
    assert f"device{BAD} sent values out of range" in log
