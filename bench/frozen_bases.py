"""Bytes an epoch moves with a frozen base, or with low-rank adapters, against full
fine-tuning, side by side, in every system (issue 44, item 4; [Note: frozen bases] in
aiopipe/runtime/systems/star/coordinator.py; aiopipe/models/adapters.py).

Two comparisons, each of two runs that differ only in what trains: three devices of
unequal shares, synthetic-cifar10, virtual time, the same seed and config otherwise
(each system's own options: `MODES`).

- *frozen*: a four-unit model (3072 -> 32 -> 32 -> 32 -> 10), its first two units
  frozen (98.6% of its parameters) or not; per mode the last epoch's bytes up, down and
  between devices (the linked systems' activations, gradients, replicas, backups, group
  gradients and ring chunks) of both runs and their ratio, and whether the frozen units
  came back bit for bit.
- *lora*: a four-unit MLP (3072 -> 512 -> 512 -> 256 -> 10) fully fine-tuned, or with
  rank-4 adapters on every Linear layer and everything else frozen (`add_lora`); both
  start from the same weights. Per mode: the last epoch's bytes up, down and between
  devices (in the star modes an epoch is one round: no ``aggregation_every``), the SGD
  momentum held for the trainable tensors (read from a stepped optimizer's state, one
  model copy), trainable and total parameters, and each epoch's training loss of both.

Deterministic: bytes on the wire and tensors, not seconds.

    .venv/bin/python bench/frozen_bases.py [--compare frozen lora] [--modes fl sl ...]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import torch
from torch import nn

from aiopipe import CostTable, RunConfig, RunResult, VirtualClock, simulate
from aiopipe.models import add_lora
from aiopipe.runtime.factories import make_loss, make_optimizer
from aiopipe.runtime.plan import build_model, train_dataset

COSTS = CostTable.uniform(4, forward=0.001, backward=0.002)


def frozen_base(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Four units; the first two frozen."""
    features = 1
    for side in in_shape:
        features *= side
    model = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.ReLU()),
                          nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                          nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
                          nn.Linear(32, num_classes))
    for unit in list(model)[:2]:
        unit.requires_grad_(False)
    return model


def everything_trained(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """The same model with nothing frozen."""
    return frozen_base(num_classes, in_shape).requires_grad_(True)


def wide_mlp(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Four units of Linear layers wide enough that adapters matter; all trained."""
    features = 1
    for side in in_shape:
        features *= side
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 512), nn.ReLU()),
                         nn.Sequential(nn.Linear(512, 512), nn.ReLU()),
                         nn.Sequential(nn.Linear(512, 256), nn.ReLU()),
                         nn.Linear(256, num_classes))


def wide_mlp_lora(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """`wide_mlp` with rank-4 adapters on every Linear layer, everything else frozen.
    Built under the same seed, its base draws the same weights as `wide_mlp`'s."""
    return add_lora(wide_mlp(num_classes, in_shape), rank=4)


#: Each mode's own settings: the linked systems cut the four units as the star modes'
#: split point does (the frozen units alone on device 0), FTPipeHD and Asteroid keep
#: replicas (chain replication, stage backups), Asteroid's second stage is a group of
#: two (an all-reduce), and HADFL's ring is every device, two local steps a round.
MODES: dict[str, dict[str, Any]] = {
    "fl": {}, "sl": {}, "sfl": {}, "pipar": {},
    "pipeline": {"options": {"partition": [2, 3], "schedule": "1f1b"}},
    "ftpipehd": {"parallel_batches": 1,
                 "options": {"partition": [2, 3], "chain_replication_every": 2}},
    "asteroid": {"options": {"partition": [2], "stage_groups": [[0], [1, 2]],
                             "chain_replication_every": 2}},
    "hadfl": {"parallel_batches": 1,
              "options": {"warmup_epochs": 0, "local_steps": 2, "ring_size": 3}},
}


def _config(mode: str, model: object) -> RunConfig:
    config = RunConfig(mode=mode, model=model, devices=3,  # type: ignore[arg-type]
                       samples_per_device=(40, 30, 70), batch_size=10, epochs=2,
                       split_point=2, parallel_batches=2, learning_rate=0.05, momentum=0.9,
                       test_samples=20, seed=4)
    return config.replace(**MODES[mode])


def _ratio(a: int, b: int, digits: int) -> str:
    return f"{a / b:.{digits}f}" if b else "-"


async def compare(mode: str) -> str:
    config = _config(mode, frozen_base)
    frozen = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    full = await simulate(config.replace(model=everything_trained), clock=VirtualClock(),
                          cost_table=COSTS)
    dataset = train_dataset(config)
    initial = build_model(config, num_classes=dataset.num_classes,
                          in_shape=dataset.in_shape).state_dict()
    kept = all(torch.equal(frozen.model.state_dict()[k], v) for k, v in initial.items()
               if k.startswith(("0.", "1.")))
    (a_up, a_down, a_peer), (b_up, b_down, b_peer) = _per_epoch(frozen), _per_epoch(full)
    return (f"| {mode} | {a_up} | {b_up} | {_ratio(a_up, b_up, 3)} | "
            f"{a_down} | {b_down} | {_ratio(a_down, b_down, 3)} | "
            f"{a_peer} | {b_peer} | {_ratio(a_peer, b_peer, 3)} | "
            f"{'yes' if kept else 'NO'} |")


def optimizer_state_bytes(config: RunConfig) -> int:
    """Bytes of the optimizer's state after one step of the run's optimizer on one batch
    of the run's data, over one whole copy of the run's initial model: what a model copy
    holds besides its weights (SGD with momentum: a buffer per tensor that had a
    gradient)."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = make_optimizer(model, config)
    x, y = dataset.batch(range(config.batch_size))
    make_loss(config)(model(x), y).backward()
    optimizer.step()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


def _parameter_counts(config: RunConfig) -> tuple[int, int]:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def _per_epoch(result: RunResult) -> tuple[int, int, int]:
    """The last epoch's bytes up, down and between devices (one round in the star
    modes: no ``aggregation_every`` here)."""
    last = result.epochs[-1]
    return last.bytes_up, last.bytes_down, sum(last.peer_bytes)


async def compare_lora(mode: str) -> str:
    config = _config(mode, wide_mlp)
    adapted = config.replace(model=wide_mlp_lora)
    full = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    lora = await simulate(adapted, clock=VirtualClock(), cost_table=COSTS)
    (full_up, full_down, full_peer) = _per_epoch(full)
    (lora_up, lora_down, lora_peer) = _per_epoch(lora)
    trainable, total = _parameter_counts(adapted)
    return (f"| {mode} | {full_up} | {lora_up} | {_ratio(lora_up, full_up, 4)} | "
            f"{full_down} | {lora_down} | {_ratio(lora_down, full_down, 4)} | "
            f"{full_peer} | {lora_peer} | {_ratio(lora_peer, full_peer, 4)} | "
            f"{optimizer_state_bytes(config)} | {optimizer_state_bytes(adapted)} | "
            f"{_parameter_counts(config)[0]} / {trainable} / {total} | "
            f"{_losses(full)} | {_losses(lora)} |")


def _losses(result: RunResult) -> str:
    return " -> ".join(f"{epoch.loss:.4f}" for epoch in result.epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs="*", choices=["frozen", "lora"],
                        default=["frozen", "lora"])
    parser.add_argument("--modes", nargs="*", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()
    if "frozen" in args.compare:
        print("| mode | up B, frozen base | up B, all trained | ratio | down B, frozen | "
              "down B, all | ratio | peer B, frozen | peer B, all | ratio | "
              "frozen units bit for bit |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for mode in args.modes:
            print(asyncio.run(compare(mode)))
    if "lora" in args.compare:
        print("\n| mode | up B, full | up B, LoRA | ratio | down B, full "
              "| down B, LoRA | ratio | peer B, full | peer B, LoRA | ratio | "
              "optimizer state B, full | "
              "optimizer state B, LoRA | trainable full / trainable LoRA / total params "
              "| loss by epoch, full | loss by epoch, LoRA |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for mode in args.modes:
            print(asyncio.run(compare_lora(mode)))


if __name__ == "__main__":
    main()
