"""Testing a model, a plan or a deployment's settings with aiopipe, in pytest: a whole
fleet in one event loop over memory links, in virtual time, with faults on cue.

    from aiopipe.testing import open_fleet

    async def test_a_killed_device_loses_only_its_round():
        async with open_fleet(config) as fleet:          # server + devices, virtual time
            training = fleet.train()
            await fleet.until(lambda: fleet.activations_in(1, 0) > 0)   # mid-round
            fleet.kill(1)                                  # as SIGKILL would
            result = await training
        assert result.final.devices_lost == (1,)

`Fleet` (kill, restart, cut, stall a device's reconnections, kill the server),
`open_fleet`, `uniform_costs` (machine-independent virtual time), and for scripted,
hand-written devices `ready_for` and `joined`. ``pytest_plugins =
["aiopipe.testing.plugin"]`` in a conftest adds the `virtual_clock` fixture. The tests
need pytest-asyncio (``asyncio_mode = "auto"``, or mark them). See
``examples/test_my_fleet.py``.
"""

from aiopipe.testing.fleet import Fleet, joined, open_fleet, ready_for, uniform_costs

__all__ = ["Fleet", "joined", "open_fleet", "ready_for", "uniform_costs"]
