"""The `Strategy` protocol: how the devices' models of a round become the global model.

A strategy is asked three things by a coordinator that averages device models (fl, sfl
and pipar: aiopipe.runtime.systems.star.coordinator):

- `Strategy.configure_round`: before a round, the settings every device of it gets
  (a flat mapping of numbers, strings and booleans; FedProx's ``proximal_mu``). They
  travel in the `RoundStart` (``sync["strategy"]``) and reach the run's train hook
  (`aiopipe.runtime.stage.TrainHook`) as ``StageWork.round_settings``.
- `Strategy.aggregate`: the round's starting global state, the devices' states and
  their weights (samples trained) -> the next global state. It may be called more than
  once a round, on subsets of the devices, while the coordinator's judge looks for an
  aggregate it can install ([Note: judging updates] in aiopipe.runtime.aggregation), so
  it must leave the strategy's own state as it was; what a server optimizer would keep
  (momentum, moments) it stages, and
- `Strategy.installed`: the aggregate returned last became the global model: keep what
  it staged.

`state_dict` / `load_state_dict` carry the server's state (flat name -> tensor) through
the coordinator's checkpoints.

[Note: strategies see what is uploaded] The states a strategy gets hold the entries the
devices upload: their floating and integer buffers, and the parameters that train.
Frozen parameters (``requires_grad`` false, [Note: frozen bases] in
aiopipe/runtime/systems/star/coordinator.py) are taken out before and put back, as the
round's start had them, after (`uploaded_aggregate`), so no strategy can move them and
none keeps state for them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Settings", "State", "Stateless", "Strategy", "uploaded_aggregate"]

#: A model's state: entry name -> tensor (what `torch.nn.Module.state_dict` holds).
State = dict[str, torch.Tensor]
#: What a round's devices are told: flat, msgpack- and TOML-able values.
Settings = Mapping[str, bool | int | float | str]


@runtime_checkable
class Strategy(Protocol):
    """How device updates become the global model (module docstring).

    A class may also declare ``train_hook = "module:factory"``: the device-side hook its
    devices use unless the run names its own (``train_hook``), as `FedProx` does.
    """

    def configure_round(self, round_no: int) -> Settings:
        """The settings every device of round ``round_no`` gets ({}: none)."""
        ...

    def aggregate(self, start: Mapping[str, torch.Tensor],
                  states: Mapping[int, Mapping[str, torch.Tensor]],
                  weights: Mapping[int, float]) -> State:
        """The next global state from the devices' ``states`` (by device id; every one
        with ``start``'s keys and shapes), weighted by ``weights`` where the strategy
        weighs; ``start``: the round's starting global state. Returns tensors of
        ``start``'s dtypes; leaves the strategy's state unchanged (stage it for
        `installed`).

        Raises:
            TrainingError: the states cannot be aggregated.
        """
        ...

    def installed(self) -> None:
        """The state `aggregate` returned last is now the global model."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The server-side state to checkpoint ({}: none)."""
        ...

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take back what `state_dict` gave (a resumed run)."""
        ...


class Stateless:
    """The defaults of a strategy without settings or server state: subclass it and
    write `aggregate`."""

    def configure_round(self, round_no: int) -> Settings:
        """No settings."""
        return {}

    def installed(self) -> None:
        """Nothing to keep."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """No state."""
        return {}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """No state to take."""


def uploaded_aggregate(strategy: Strategy, start: Mapping[str, torch.Tensor],
                       states: Mapping[int, Mapping[str, torch.Tensor]],
                       weights: Mapping[int, float], frozen: Collection[str] = ()
                       ) -> State:
    """``strategy``'s aggregate of what the devices upload: ``frozen`` entries taken out
    of ``start`` and ``states`` and put back from ``start`` ([Note: strategies see what
    is uploaded]).

    Raises:
        TrainingError: as `Strategy.aggregate`.
    """
    if not frozen:
        return strategy.aggregate(start, states, weights)
    skip = set(frozen)
    moving = {key: value for key, value in start.items() if key not in skip}
    aggregate = strategy.aggregate(
        moving, {k: {key: v for key, v in state.items() if key not in skip}
                 for k, state in states.items()}, weights)
    return {key: aggregate[key] if key in moving else value for key, value in start.items()}
