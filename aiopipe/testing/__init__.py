"""Testing a model, a plan or a deployment's settings with aiopipe, in pytest: a whole
fleet in one event loop over memory links, in virtual time, with faults on cue and
assertions on the result.

    from aiopipe.testing import assert_exact_accounting, open_fleet

    async def test_a_killed_device_loses_only_its_round():
        async with open_fleet(config) as fleet:          # server + devices, virtual time
            training = fleet.train()
            await fleet.at_iteration(1, 1)                 # device 1 in round 1
            fleet.kill(1)                                  # as SIGKILL would
            result = await training
        assert_exact_accounting(result, lost={1: [(1, 1)]})  # (epoch, round)

`Fleet` (kill, restart, cut, stall or slow a device's link, block its reconnections,
kill and restart the server; wait with `Fleet.until` and `Fleet.at_iteration`),
`open_fleet`, `uniform_costs` (machine-independent virtual time), and for scripted,
hand-written devices `ready_for` and `joined`. Epochs, rounds and iterations are
numbered as the log and the table number them, from 1. On the result: `assert_exact_accounting`
(every sample counted once, a lost round's not at all; `expected_samples` per device),
`assert_same_weights` (against `run_undisturbed`, say). ``pytest_plugins =
["aiopipe.testing.plugin"]`` in a conftest adds the `virtual_clock` fixture. The tests
need pytest-asyncio (``asyncio_mode = "auto"``, or mark them) and its default event loop:
a `VirtualClock` cannot drive uvloop's (the kit says so with a `ConfigError` before
anything starts). A model object in the config is re-initialised from its seed, so
every test that builds the config anew starts from the same weights, run alone or
after others. See ``examples/test_my_fleet.py``.
"""

from aiopipe.testing.checks import (
    assert_exact_accounting,
    assert_same_weights,
    expected_samples,
    run_undisturbed,
)
from aiopipe.testing.fleet import (
    Direction,
    Fleet,
    joined,
    open_fleet,
    ready_for,
    uniform_costs,
)

__all__ = [
    "Direction",
    "Fleet",
    "assert_exact_accounting",
    "assert_same_weights",
    "expected_samples",
    "joined",
    "open_fleet",
    "ready_for",
    "run_undisturbed",
    "uniform_costs",
]
