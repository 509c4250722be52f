"""What each robust option bounds (issue 41, items 4 and 5; [Note: judging updates] in
aiopipe/runtime/aggregation.py): final test accuracy of the global model, side by side,
for each aggregation option against each attack by one of four devices.

Attacks (device 3 of 4; pipar, vgg5, 200 samples each, B = 20, N = 1, P = 2, 3
epochs, lr 0.05, the poisoning test's setting, in virtual time):
- ``none``: no attack;
- ``act x1e6``: every activation it sends its server replica x1e6 (the issue's attack);
- ``update x30``, ``update x-30``: its whole update (its half and its replica, minus the
  round's start) boosted 30 times, or reversed and boosted: above ``outlier_limit``
  (10 x the round's median), below the update judge's 1000 x;
- ``update x-5``: reversed, 5 times: below every screen.

Options: the aggregator and ``outliers`` with the update judge on (as every star run
now has it) and, marked "judge off", with it switched off (``scale_limit =
1e300`` and no evaluation batch: how the option does on its own, as before the judge);
"clip before" is the clip this branch replaced (an outlier scaled to 10 x the median's
norm, not to it).

    .venv/bin/python bench/robust_options.py [--epochs 3]

Prints one row per option, one column per attack, and the seconds it all took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.protocol import Activation, RoundResult, to_tensor_data, to_torch
from aiopipe.runtime import device as device_module
from aiopipe.runtime.aggregation import update_norms
from aiopipe.runtime.systems.star import coordinator as star_module

BAD = 3
COSTS = CostTable.uniform(5, forward=0.001, backward=0.002)
JUDGE_OFF = {"scale_limit": 1e300}
#: each option's RunConfig keys (the aggregator's under ``options``)
OPTIONS: dict[str, dict[str, Any]] = {
    "fedavg keep (judge off)": JUDGE_OFF,
    "fedavg keep": {},
    "fedavg clip before (judge off)": {"options": {"outliers": "clip"}, **JUDGE_OFF},
    "fedavg clip (judge off)": {"options": {"outliers": "clip"}, **JUDGE_OFF},
    "fedavg clip": {"options": {"outliers": "clip"}},
    "fedavg drop": {"options": {"outliers": "drop"}},
    "fedmedian (judge off)": {"options": {"aggregation": "fedmedian"}, **JUDGE_OFF},
    "fedmedian": {"options": {"aggregation": "fedmedian"}},
    "trimmed-mean 0.25": {"options": {"aggregation": "trimmed-mean", "trim_fraction": 0.25}},
    "krum f=1": {"options": {"aggregation": "krum"}},
}
ATTACKS = ("none", "act x1e6", "update x30", "update x-30", "update x-5")


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _scaled_activations(factor: float) -> Any:
    honest = device_module._ServerRoute.send

    def send(self: Any, message: Any, name: str, *, ready_at: float | None) -> None:
        if self.owner.device_id == BAD and isinstance(message, Activation):
            message = dataclasses.replace(
                message, tensors=(to_tensor_data(to_torch(message.tensors[0]) * factor),))
        honest(self, message, name, ready_at=ready_at)

    return send


def _scaled_update(factor: float) -> Callable[..., dict[str, torch.Tensor]]:
    """Star._whole_state with device BAD's update (whole model minus the round's start)
    times ``factor``: what a device that sent such a model would get the server to see
    (its replica included)."""
    honest = star_module.Star._whole_state

    def whole(self: Any, k: int, result: RoundResult) -> dict[str, torch.Tensor]:
        state = honest(self, k, result)
        if k != BAD:
            return state
        start = self.model.state_dict()
        return {key: start[key] + (v - start[key]) * factor if v.is_floating_point() else v
                for key, v in state.items()}

    return whole


def _clip_before(states: Mapping[int, Mapping[str, torch.Tensor]],
                 start: Mapping[str, torch.Tensor], *, action: str, limit: float,
                 norms: Mapping[int, float] | None = None
                 ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, float]]:
    """`screen_updates` as it was: an outlier clipped to ``limit`` x the median."""
    kept = {k: dict(state) for k, state in states.items()}
    if action == "keep" or len(states) < 3:
        return kept, {}
    found = update_norms(states, start)
    ordered = sorted(found.values())
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    if not median > 0:
        return kept, {}
    outliers = {k: v / median for k, v in found.items() if not v <= limit * median}
    for k, ratio in outliers.items():
        if action == "drop" or not math.isfinite(ratio):
            del kept[k]
        else:
            kept[k] = {key: start[key] + (value - start[key]) * (limit / ratio)
                       if value.is_floating_point() else value
                       for key, value in states[k].items()}
    return kept, outliers


@contextlib.contextmanager
def _attack(name: str, option: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if "judge off" in option:  # no evaluation batch: no loss check either
            stack.enter_context(_patched(star_module.Star, "_probe_once", lambda self: None))
        if "clip before" in option:
            stack.enter_context(_patched(star_module, "screen_updates", _clip_before))
        if name == "act x1e6":
            stack.enter_context(_patched(device_module._ServerRoute, "send",
                                         _scaled_activations(1e6)))
        elif name.startswith("update x"):
            stack.enter_context(_patched(star_module.Star, "_whole_state",
                                         _scaled_update(float(name.removeprefix("update x")))))
        yield


def run(option: str, attack: str, epochs: int) -> tuple[float, list[int]]:
    """Final accuracy, and the devices named (refused or lost) in any epoch."""
    config = RunConfig(mode="pipar", devices=4, samples_per_device=200, batch_size=20,
                       epochs=epochs, split_point=2, parallel_batches=1, test_samples=1000,
                       learning_rate=0.05, **OPTIONS[option])
    with _attack(attack, option):
        try:
            result = asyncio.run(simulate(config, clock=VirtualClock(), cost_table=COSTS))
        except Exception as exc:  # a run the attack killed: no accuracy
            print(f"  ({option}, {attack}: {type(exc).__name__}: {str(exc)[:80]})")
            return math.nan, []
    named = sorted({k for e in result.epochs for k in (*e.updates_refused, *e.devices_lost)})
    return result.final.accuracy, named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.monotonic()
    rows = {}
    for option in OPTIONS:
        rows[option] = [run(option, attack, args.epochs) for attack in ATTACKS]
        print(f"{option:32}" + "".join(f"{acc:>8.3f}" for acc, _ in rows[option]),
              flush=True)
    print()
    print(f"{'final test accuracy':32}" + "".join(f"{a:>14}" for a in ATTACKS))
    for option, row in rows.items():
        cells = [f"{acc:.3f}" + (f" [{','.join(map(str, named))}]" if named else "")
                 for acc, named in row]
        print(f"{option:32}" + "".join(f"{c:>14}" for c in cells))
    print("[k]: devices named (updates_refused or devices_lost) in some epoch")
    print(f"{time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
