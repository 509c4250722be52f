"""A system of the user's, named ``mode = "module:attribute"``: the coordinator and every
device find it through the registry (aiopipe.runtime.systems.registry), and it trains."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fleet import COSTS, vgg5_shaped

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError, TrainingError
from aiopipe.protocol import RoundResult
from aiopipe.runtime.device_half import DeviceHalf
from aiopipe.runtime.systems.base import Rounds
from aiopipe.runtime.systems.registry import SystemOptions
from aiopipe.runtime.systems.star.coordinator import Star
from aiopipe.runtime.systems.star.device import StarDevice


class CountingDevice(StarDevice):
    """A star device that counts the rounds it runs."""

    rounds: ClassVar[list[int]] = []

    async def run_round(self, start: Any) -> int:
        CountingDevice.rounds.append(self.node.device_id)
        return await super().run_round(start)


class CountingStar(Star):
    """A star (split learning, one micro-batch) that counts its rounds on both sides."""

    device_half: ClassVar[type[DeviceHalf]] = CountingDevice
    rounds: ClassVar[int] = 0

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        CountingStar.rounds += 1
        return await super().run_round(rounds, round_no, epoch, first, work, participants)


async def test_a_system_named_by_module_and_attribute_runs_on_both_halves() -> None:
    CountingStar.rounds, CountingDevice.rounds = 0, []
    config = RunConfig(mode=f"{__name__}:CountingStar", model=vgg5_shaped, devices=2,
                       samples_per_device=40, batch_size=10, epochs=2, split_point=2,
                       test_samples=20)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert [e.device_samples for e in result.epochs] == [(40, 40)] * 2
    assert CountingStar.rounds == 2
    assert sorted(CountingDevice.rounds) == [0, 0, 1, 1]


@pytest.mark.parametrize(("mode", "reason"), [
    ("no_such_module_here:System", "cannot import no_such_module_here"),
    (f"{__name__}:CountingDevice", "is not a system class"),
    (f"{__name__}:Missing", "is not a system class"),
])
def test_a_mode_that_names_no_system_is_refused_with_why(mode: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        RunConfig(mode=mode)


@dataclasses.dataclass(frozen=True, slots=True)
class TunedOptions:
    """`Tuned`'s options."""

    turns: int = 1


class Tuned(CountingStar):
    """A system with an option of its own, ``turns`` (default 1)."""

    options: ClassVar[SystemOptions] = SystemOptions(
        TunedOptions, keys={"turns": "how many turns"}, check=lambda config: None)


def test_a_users_system_has_options_of_its_own(tmp_path: Path) -> None:
    mode = f"{__name__}:Tuned"
    assert RunConfig(mode=mode).options_as(TunedOptions).turns == 1
    assert RunConfig(mode=mode, options={"turns": 3}).options == TunedOptions(turns=3)
    assert RunConfig(mode=mode, options=TunedOptions(turns=2)).options.turns == 2
    with pytest.raises(ConfigError, match=r"'options'.*'bogus' is not an option of mode "
                       r".*Tuned \(its options: turns\)"):
        RunConfig(mode=mode, options={"bogus": 1})
    with pytest.raises(ConfigError, match=r"'turns' is not an option of mode pipar"):
        RunConfig(mode="pipar", options={"turns": 3})
    with pytest.raises(TypeError, match="not a TunedOptions"):
        RunConfig(mode="pipar").options_as(TunedOptions)
    path = tmp_path / "run.toml"
    path.write_text(f'mode = "{mode}"\n[tuned]\nturns = 4\n')
    config = RunConfig.from_toml(path)
    assert config.options_as(TunedOptions).turns == 4
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml())
    assert RunConfig.from_toml(again) == config


@dataclasses.dataclass(frozen=True, slots=True)
class LimitOptions:
    """`Limited`'s options: one whose default TOML cannot hold."""

    limit: Any = None


class Limited(CountingStar):
    """A system whose option ``limit`` defaults to None."""

    options: ClassVar[SystemOptions] = SystemOptions(LimitOptions, keys={"limit": "a limit"})


@pytest.mark.parametrize("given", [{}, {"limit": [1, None]}, {"limit": {"a": None}}])
def test_an_option_a_config_file_cannot_hold_is_refused_when_the_config_is_made(
        given: dict[str, Any]) -> None:
    # (before, the run's config.toml and the devices' plans could not be written, and
    # a simulation said only that the devices did not join)
    with pytest.raises(ConfigError, match=r"config key 'limit': got .*None.*TOML has no "
                                          r"null"):
        RunConfig(mode=f"{__name__}:Limited", options=given)
    assert RunConfig(mode=f"{__name__}:Limited", options={"limit": [1, {"a": 2}]}
                     ).to_toml().endswith("[limited]\nlimit = [1, { a = 2 }]\n")


class PlanlessStar(CountingStar):
    """A system whose coordinator makes plans that cannot be sent (a server-side bug:
    a key that is not 64 hex digits)."""

    def peer_keys(self, device_id: int) -> dict[str, str]:
        return {"device9": "no key"}


async def test_a_plan_the_server_cannot_make_stops_the_run_with_why() -> None:
    config = RunConfig(mode=f"{__name__}:PlanlessStar", model=vgg5_shaped, devices=2,
                       samples_per_device=40, batch_size=10, epochs=1, split_point=2,
                       test_samples=20)
    with pytest.raises(TrainingError, match="must be 64 hex digits") as caught:
        await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert "did not join" not in str(caught.value)
