"""A device process that uploads its trained model x1e6 every round, against a live FL
server with default options (issue 41, [Note: judging updates] in
aiopipe/runtime/aggregation.py): the server refuses that device's update every round,
names it in its log and in ``metrics.jsonl``, the honest devices train on, and every
process exits 0. (Before: every device's loss went non-finite, the server waited out
its join timeout and exited 1 with no results.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from real_processes import ProcessFleet

from aiopipe.auth import mint_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "poisoned-update-secret-of-32-by!"
RUN = {"mode": "fl", "devices": 4, "samples_per_device": 100, "batch_size": 20,
       "epochs": 2, "test_samples": 200}
BAD = 3

#: ``python -m poisoned_device ARGS``: ``python -m aiopipe.device ARGS`` whose uploads
#: are the trained model x1e6
POISONED_DEVICE = '''
import runpy

from aiopipe.runtime.systems.star.device import StarDevice

honest = StarDevice.upload_state


def upload(self, work, round_no):
    return {name: t * 1e6 if t.is_floating_point() else t
            for name, t in honest(self, work, round_no).items()}


StarDevice.upload_state = upload
runpy.run_module("aiopipe.device", run_name="__main__")
'''


async def test_a_device_process_uploading_a_poisoned_model_is_refused_and_named(
        tmp_path: Path) -> None:
    (tmp_path / "poisoned_device.py").write_text(POISONED_DEVICE)
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server("--token-secret", SECRET, "--join-timeout", "60")
        devices = []
        for k in range(RUN["devices"]):
            token = mint_token(SECRET.encode(), k)
            if k == BAD:
                devices.append(await fleet.start(f"device{k}", [
                    "poisoned_device", "--server", fleet.url, "--device-id", str(k),
                    "--token", token], env={"PYTHONPATH": str(tmp_path)}))
            else:
                devices.append(await fleet.start_device(k, "--token", token))
        await fleet.finish(server, devices, within=240)
    metrics = fleet.metrics()
    assert [m["updates_refused"] for m in metrics] == [[BAD], [BAD]]
    assert all(m["devices_lost"] == [] for m in metrics)
    assert all(m["accuracy"] > 0.15 for m in metrics), metrics
    assert f"device {BAD}'s update is refused" in server.output.text()
