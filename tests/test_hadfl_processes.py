"""HADFL between real processes over real websockets (paper §III-D): a server and four
device processes that average their models over device-to-device links. A device
SIGKILLed mid-training is bypassed by its ring, training goes on without a deadlock, and
the device, started again, rejoins from the coordinator's backup; a device stopped
(SIGSTOP: its links silent, not broken) is asked by its downstream and bypassed after
twice the ring's waiting time."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from typing import Any

import pytest
from real_processes import ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = {"mode": "hadfl", "devices": 4, "model": "vgg5", "samples_per_device": 960,
       "batch_size": 48, "epochs": 6, "device_slowdown": [1, 1, 2, 2], "ring_size": 4,
       "test_samples": 200, "heartbeat_interval": 0.5, "device_timeout": 8.0,
       "reconnect_grace": 2.0, "ring_timeout": 1.0}


async def test_a_sigkilled_device_is_bypassed_and_rejoins_from_the_backup(tmp_path: Any
                                                                          ) -> None:
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(4)]
        await server.output.wait_for(r"^\s+2\s", within=120)  # epoch 2's row: epoch 3 runs
        await asyncio.sleep(0.2)
        devices[2].send_signal(signal.SIGKILL)
        assert await devices[2].wait(30) == -signal.SIGKILL
        killed_at = time.monotonic()
        survivors = [d for d in devices if d is not devices[2]]
        waits = [asyncio.ensure_future(d.output.wait_for(r"bypassing", within=60))
                 for d in survivors]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        bypassed = [line for d in survivors for line in d.output.find(r"bypassing")]
        restarted = await fleet.start_device(2, "--listen", "127.0.0.1:0")
        await restarted.output.wait_for(r"starts from the coordinator's backup", within=120)
        await fleet.finish(server, [*devices[:2], devices[3], restarted], within=240)
    epochs = fleet.metrics()
    assert len(epochs) == 6
    assert all(math.isfinite(float(str(e["loss"]))) for e in epochs)
    assert any(2 in e["devices_lost"] for e in epochs)  # type: ignore[operator]
    rounds = [c for e in epochs for c in e["changes"]]  # type: ignore[attr-defined]
    assert any(2 in r["rings"][0] for r in rounds[-2:])  # back in the rings
    print(f"bypass logged {min(line.at for line in bypassed) - killed_at:+.2f} s "
          "after the kill was seen")


async def test_a_stopped_device_is_asked_then_bypassed(tmp_path: Any) -> None:
    async with ProcessFleet(tmp_path, RUN | {"epochs": 4}) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(4)]
        await server.output.wait_for(r"^\s+2\s", within=120)
        devices[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        others = [d for d in devices if d is not devices[1]]
        waits = [asyncio.ensure_future(d.output.wait_for(r"ring member device1 is dead",
                                                         within=60)) for d in others]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        found = [line for d in others for line in d.output.find(r"ring member device1 is dead")]
        devices[1].send_signal(signal.SIGKILL)
        await fleet.finish(server, others, within=240)
    assert found, fleet.all_output()
    # waited ring_timeout, then asked and waited as long again (the stop may have come
    # while the ring was still training: at least that long after it)
    noticed = min(line.at for line in found) - stopped_at
    assert noticed >= 2 * RUN["ring_timeout"] - 0.5
    print(f"stopped device bypassed {noticed:.2f} s after the stop")
    assert len(fleet.metrics()) == 4
