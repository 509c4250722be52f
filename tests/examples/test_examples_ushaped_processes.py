"""A hostile device process in a U-shaped run between real processes (the coordinator's
middle stage takes gradients from devices: [Note: middle stages] in
aiopipe/runtime/device_route.py): a device that sends each gradient twice is refused, named
and left out, and the honest devices' turns go on to the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_processes import REPO, ProcessFleet

from aiopipe.auth import mint_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "ushaped-hostile-secret-of-32-by!"
RUN = {"mode": "ushaped:UShaped", "devices": 3, "samples_per_device": 60, "batch_size": 20,
       "epochs": 2, "test_samples": 100, "split_point": 2, "parallel_batches": 2,
       "device_timeout": 10.0, "reconnect_grace": 2.0}
BAD = 2
EXAMPLES = str(REPO / "examples")

#: ``python -m hostile_device ARGS``: ``python -m aiopipe.device ARGS`` whose route to the
#: coordinator sends each gradient twice
HOSTILE_DEVICE = '''
import runpy

import ushaped

honest = ushaped._ToCoordinator.send


def send(self, message, name, *, ready_at):
    honest(self, message, name, ready_at=ready_at)
    if type(message).__name__ == "Gradient":
        honest(self, message, name, ready_at=ready_at)


ushaped._ToCoordinator.send = send
runpy.run_module("aiopipe.device", run_name="__main__")
'''


async def test_a_device_process_sending_gradients_twice_is_refused_and_left_out(
        tmp_path: Path) -> None:
    (tmp_path / "hostile_device.py").write_text(HOSTILE_DEVICE)
    paths = {"PYTHONPATH": f"{tmp_path}:{EXAMPLES}"}
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server("--token-secret", SECRET, "--join-timeout", "60",
                                          env=paths)
        honest, hostile = [], None
        for k in range(RUN["devices"]):
            token = mint_token(SECRET.encode(), k)
            if k == BAD:
                hostile = await fleet.start(f"device{k}", [
                    "hostile_device", "--server", fleet.url, "--device-id", str(k),
                    "--token", token], env=paths)
            else:
                honest.append(await fleet.start_device(k, "--token", token, env=paths))
        assert hostile is not None
        await fleet.finish(server, honest, within=240)
        assert await hostile.wait(60) != 0  # refused: it says so and exits with an error
    log = server.output.text()
    assert f"device {BAD} broke the protocol: gradient (0, 0, 0) sent twice" in log, log[-3000:]
    metrics = fleet.metrics()
    assert len(metrics) == 2
    assert BAD in metrics[0]["devices_lost"], metrics
    assert all(m["loss"] == m["loss"] for m in metrics)  # finite: not NaN

