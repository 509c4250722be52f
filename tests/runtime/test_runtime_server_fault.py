"""A failure of the server's own work stops the run with one clear error ([Note: server
faults] in aiopipe/runtime/coordinator.py), instead of the device resending the failing pass
for ever."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiopipe import Device, RunConfig, Server, TrainingError, VirtualClock, simulate
from aiopipe.runtime.stage import StageWork

CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=80, batch_size=20, epochs=2,
                   split_point=2, parallel_batches=2, test_samples=40, seed=5)
FAILURE = r"the server's work for device \d failed: RuntimeError: out of memory \(pretend\)"


@pytest.fixture
def failing_pass(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The server's fifth pass (and every later one) runs out of memory."""
    calls: list[int] = []
    real = StageWork.forward_backward

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) >= 5:
            raise RuntimeError("out of memory (pretend)")
        return real(*args, **kwargs)

    monkeypatch.setattr(StageWork, "forward_backward", flaky)
    return calls


@pytest.mark.slow
async def test_in_one_process_the_run_stops_with_a_training_error(failing_pass: list[int]
                                                                  ) -> None:
    with pytest.raises(TrainingError, match=FAILURE):
        await simulate(CONFIG, clock=VirtualClock())


async def test_over_websockets_the_run_stops_and_the_devices_are_let_go(
        failing_pass: list[int]) -> None:
    async def device(url: str, k: int) -> None:
        async with Device(url, k) as node:
            await node.run()

    async def run() -> tuple[BaseException | None, list[BaseException | None]]:
        async with Server(CONFIG, join_timeout=60) as server:
            devices = [asyncio.ensure_future(device(server.url, k)) for k in range(2)]
            try:
                await server.run()
            except TrainingError as exc:
                error: BaseException | None = exc
            else:
                error = None
            outcomes = await asyncio.gather(*devices, return_exceptions=True)
        return error, [o if isinstance(o, BaseException) else None for o in outcomes]

    # before [Note: server faults] this never ended: reconnect, resend, fail, ...
    error, devices = await asyncio.wait_for(run(), 60)
    assert isinstance(error, TrainingError)
    assert error.args[0].startswith("the server's work for device")
    assert "RuntimeError: out of memory (pretend)" in error.args[0]
    assert len(failing_pass) < 20  # the failing pass was not tried over and over
    for outcome in devices:  # each device is told why the run ended
        assert isinstance(outcome, TrainingError), outcome
        assert "the server ended the run: training failed:" in str(outcome)
        assert "out of memory (pretend)" in str(outcome)
